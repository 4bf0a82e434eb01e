#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Start `python -m jaxrl.train "$@"` on every worker, detached from the ssh session (nohup), with
# outputs in /gcs/$RUN_NAME. Each worker keeps its log, pid and, once training ends, its exit
# status under ~/runs/$RUN_NAME/ (train.log, pid, exit_code); babysit.sh reads exit_code.
# Idempotent: a worker where this run is still alive is left alone.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"
args=$(printf ' %q' "$@" --output_dir "/gcs/$RUN_NAME" --run_name "$RUN_NAME")
on_all_workers "
set -euo pipefail
run=$RUN_DIR_REMOTE
mkdir -p \"\$run\"
if [ -f \"\$run/pid\" ] && kill -0 \"\$(cat \"\$run/pid\")\" 2>/dev/null; then
  echo \"launch: \$(hostname) already runs $RUN_NAME\"; exit 0
fi
rm -f \"\$run/exit_code\"
cd ~/jaxrl
nohup bash -c 'python3 -m jaxrl.train$args >> \"\$0/train.log\" 2>&1; echo \$? > \"\$0/exit_code\"' \"\$run\" \
  > /dev/null 2>&1 < /dev/null &
echo \$! > \"\$run/pid\"
echo \"launch: \$(hostname) started $RUN_NAME (log: \$run/train.log)\"
"
