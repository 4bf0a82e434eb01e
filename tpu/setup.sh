#!/usr/bin/env bash
# On every worker: copy this checkout, install jax[tpu] and jaxrl, mount gs://$BUCKET at /gcs.
set -euo pipefail
: "${TPU_NAME:?}" "${ZONE:?}" "${BUCKET:?}"
root="$(cd "$(dirname "$0")/.." && pwd)"
tar -C "$root" --exclude .git --exclude outputs -czf /tmp/jaxrl.tgz .
gcloud compute tpus tpu-vm scp /tmp/jaxrl.tgz "$TPU_NAME":~/jaxrl.tgz --zone "$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  mkdir -p ~/jaxrl && tar -C ~/jaxrl -xzf ~/jaxrl.tgz
  python3 -m pip install -q -U 'jax[tpu]' && python3 -m pip install -q -e ~/jaxrl
  if ! mountpoint -q /gcs; then
    sudo mkdir -p /gcs && sudo chown \$USER /gcs
    (command -v gcsfuse >/dev/null) || (sudo apt-get update -q && sudo apt-get install -y -q gcsfuse)
    gcsfuse --implicit-dirs $BUCKET /gcs
  fi"
