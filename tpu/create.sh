#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Request the TPU VM as a queued resource (Google's recommended way to obtain TPU capacity) and
# wait until it is ACTIVE. SPOT=1 asks for spot capacity (cheaper, may be preempted: babysit.sh
# recreates it); the default is on-demand. Idempotent: an ACTIVE or queued request is kept, a
# FAILED or SUSPENDED one (e.g. after a spot preemption) is deleted and requested again.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"
: "${ACCELERATOR:?set ACCELERATOR, e.g. v5litepod-8}" "${RUNTIME:?set RUNTIME, e.g. v2-alpha-tpuv5-lite}"
POLL_S="${POLL_S:-30}"
CREATE_TIMEOUT_S="${CREATE_TIMEOUT_S:-7200}"

state="$(qr_state)"
case "$state" in
  ACTIVE | WAITING_FOR_RESOURCES | ACCEPTED | PROVISIONING | CREATING)
    echo "create: queued resource $QR_ID is $state; not requesting it again" ;;
  *)
    if [ -n "$state" ]; then
      echo "create: queued resource $QR_ID is $state; deleting it (and its TPU) to request again"
      gc compute tpus queued-resources delete "$QR_ID" --zone "$ZONE" --force --quiet
    fi
    tier=()
    [ "${SPOT:-0}" = 1 ] && tier+=(--spot)
    gc compute tpus queued-resources create "$QR_ID" --node-id "$TPU_NAME" --zone "$ZONE" \
      --accelerator-type "$ACCELERATOR" --runtime-version "$RUNTIME" "${tier[@]}"
    ;;
esac

waited=0
while true; do
  state="$(qr_state)"
  case "$state" in
    ACTIVE) echo "create: $TPU_NAME is ACTIVE"; exit 0 ;;
    FAILED | SUSPENDED | "")
      echo "create: queued resource $QR_ID is ${state:-missing}; see" \
        "gcloud compute tpus queued-resources describe $QR_ID --zone $ZONE" >&2
      exit 1 ;;
  esac
  if [ "$waited" -ge "$CREATE_TIMEOUT_S" ]; then
    echo "create: still $state after ${waited}s; the request stays queued, rerun to keep waiting" >&2
    exit 1
  fi
  sleep "$POLL_S"
  waited=$((waited + POLL_S))
done
