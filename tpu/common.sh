#!/usr/bin/env bash
# Shared settings and helpers for the tpu/ scripts (sourced, not run).
# Required: TPU_NAME, ZONE. Optional: PROJECT (else gcloud's default project), QR_ID (the
# queued-resource id, default "$TPU_NAME-qr"), RUN_NAME (default: a timestamp).
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
QR_ID="${QR_ID:-$TPU_NAME-qr}"
export RUN_NAME="${RUN_NAME:-jaxrl-$(date +%Y%m%d-%H%M%S)}"
# Per-run files on every worker's local disk: the training log, its pid and its exit status.
# shellcheck disable=SC2034  # used by the scripts that source this file
RUN_DIR_REMOTE="\$HOME/runs/$RUN_NAME"

gc() {
  if [ -n "${PROJECT:-}" ]; then
    gcloud --project "$PROJECT" "$@"
  else
    gcloud "$@"
  fi
}

# State of the queued resource (ACTIVE, WAITING_FOR_RESOURCES, SUSPENDED, ...), empty if none.
qr_state() {
  gc compute tpus queued-resources describe "$QR_ID" --zone "$ZONE" \
    --format='value(state.state)' 2>/dev/null || true
}

# Run a shell command on every worker of the slice.
on_all_workers() {
  gc compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$1"
}

# Run a shell command on worker 0 only (prints its output).
on_worker0() {
  gc compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=0 --command "$1"
}
