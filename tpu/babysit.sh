#!/usr/bin/env bash
# Keep a (spot) run going: on preemption recreate the VM, set it up again and resume from the
# newest checkpoint. Stops when a launch exits 0 (training finished).
set -uo pipefail
: "${TPU_NAME:?}" "${ZONE:?}"
export RUN_NAME="${RUN_NAME:-jaxrl-$(date +%Y%m%d-%H%M%S)}"
here="$(dirname "$0")"
resume=()
while true; do
  state=$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" --format='value(state)' 2>/dev/null)
  if [ "$state" != "READY" ]; then
    gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --quiet 2>/dev/null
    bash "$here/create.sh" && bash "$here/setup.sh" || { sleep 60; continue; }
  fi
  bash "$here/launch.sh" "$@" "${resume[@]}" && break
  echo "babysit: run stopped (preempted or failed); resuming from the newest checkpoint" >&2
  resume=(--resume_from_checkpoint true)
  sleep 30
done
