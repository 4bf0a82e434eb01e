#!/usr/bin/env bash
# Run `python -m jaxrl.train "$@"` on every worker, outputs under /gcs/$RUN_NAME.
set -euo pipefail
: "${TPU_NAME:?}" "${ZONE:?}"
run="${RUN_NAME:-jaxrl-$(date +%Y%m%d-%H%M%S)}"
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  cd ~/jaxrl && python3 -m jaxrl.train $args --output_dir /gcs/$run --run_name $run"
