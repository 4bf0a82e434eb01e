#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Keep a run going until it finishes: recreate the TPU after a (spot) preemption, set it up again,
# and relaunch with --resume_from_checkpoint true after a preemption or a crash. Stops with the
# run's status on success (0) or on a configuration error (2: relaunching cannot fix bad input),
# and after MAX_RESTARTS relaunches. Run it in tmux/screen on a machine that stays up.
#   bash tpu/babysit.sh --algo dpo --model_name_or_path ... [any jaxrl.train flags]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"
POLL_S="${POLL_S:-60}"
MAX_RESTARTS="${MAX_RESTARTS:-20}"
restarts=0
resume=()
launched=0
log() { echo "babysit [$(date +%H:%M:%S)] $*" >&2; }

while true; do
  state="$(qr_state)"
  if [ "$state" != ACTIVE ]; then
    log "TPU ${state:-missing}; (re)creating it"
    if ! bash "$here/create.sh" || ! bash "$here/setup.sh"; then
      log "create/setup failed; retrying in ${POLL_S}s"
      sleep "$POLL_S"
      continue
    fi
    if [ "$launched" = 1 ]; then  # the run was going when the TPU went away: continue it
      restarts=$((restarts + 1))
      resume=(--resume_from_checkpoint true)
    fi
    launched=0
  fi
  if [ "$launched" = 0 ]; then
    if bash "$here/launch.sh" "$@" "${resume[@]}"; then
      launched=1
    else
      log "launch failed; retrying in ${POLL_S}s"
    fi
  fi
  sleep "$POLL_S"
  [ "$launched" = 1 ] || continue
  code="$(on_worker0 "cat $RUN_DIR_REMOTE/exit_code 2>/dev/null || true" 2>/dev/null | tr -dc 0-9)"
  case "$code" in
    "") continue ;;  # still running (or unreachable: the state check above catches preemption)
    0) log "run $RUN_NAME finished"; exit 0 ;;
    2)
      log "run $RUN_NAME stopped on a configuration error (exit 2); not retrying." \
        "See ~/runs/$RUN_NAME/train.log on worker 0."
      exit 2 ;;
    *)
      restarts=$((restarts + 1))
      if [ "$restarts" -gt "$MAX_RESTARTS" ]; then
        log "run $RUN_NAME failed $restarts times (last exit $code); giving up"
        exit 1
      fi
      log "run $RUN_NAME exited $code (143 = preempted/SIGTERM); resuming from the newest checkpoint"
      resume=(--resume_from_checkpoint true)
      launched=0 ;;
  esac
done
