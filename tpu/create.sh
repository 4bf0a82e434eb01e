#!/usr/bin/env bash
# Create a TPU VM (SPOT=1 for a spot VM that may be preempted; babysit.sh handles that).
set -euo pipefail
: "${TPU_NAME:?}" "${ZONE:?}" "${ACCELERATOR:?}" "${RUNTIME:?}"
extra=()
[ "${SPOT:-0}" = 1 ] && extra+=(--spot)
gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" \
  --accelerator-type "$ACCELERATOR" --version "$RUNTIME" "${extra[@]}"
