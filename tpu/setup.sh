#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# On every worker (idempotent, safe to rerun): copy this checkout, install jaxrl with its `tpu`
# extra (jax[tpu] at the jax version jaxrl pins, with libtpu), install gcsfuse from Google's apt
# repository and mount gs://$BUCKET at /gcs (checkpoints must live where every host sees them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"
: "${BUCKET:?set BUCKET (a gs:// bucket name without the prefix)}"
root="$(cd "$here/.." && pwd)"
tarball="$(mktemp -t jaxrl.XXXXXX.tgz)"
trap 'rm -f "$tarball"' EXIT
tar -C "$root" --exclude .git --exclude outputs -czf "$tarball" .
gc compute tpus tpu-vm scp "$tarball" "$TPU_NAME":jaxrl.tgz --zone "$ZONE" --worker=all
on_all_workers "
set -euo pipefail
mkdir -p ~/jaxrl && tar -C ~/jaxrl -xzf ~/jaxrl.tgz
python3 -m pip install -q -e \"\$HOME/jaxrl[tpu]\"
if ! command -v gcsfuse >/dev/null; then
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg \
    | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\" \
    | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  sudo apt-get update -q && sudo apt-get install -y -q gcsfuse
fi
if ! mountpoint -q /gcs; then
  sudo mkdir -p /gcs && sudo chown \"\$USER\" /gcs
  gcsfuse --implicit-dirs $BUCKET /gcs
fi
echo \"setup: \$(hostname) ready (jax \$(python3 -c 'import jax; print(jax.__version__)'))\"
"
