#!/usr/bin/env bash
# Step "dirs": the shared directories on FSx every node and job expects.
#   envs/, platform/   root-owned, 0755: built by the lifecycle, read by everyone; a job
#                      must not change the env or the package under other jobs.
#   checkpoints/, logs/, data/, cache/ (+ neuron/)
#                      1777 like /tmp: every cluster user writes there (jobs run as the
#                      submitting user), nobody removes another user's files.
#   logs/provision/    0755: the node status files this lifecycle writes as root.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX

make_dir() {
  local mode=$1 dir=$2
  mkdir -p "$dir"
  chmod "$mode" "$dir"
}

for dir in envs envs/.locks platform; do
  make_dir 0755 "$FSX/$dir"
done
for dir in checkpoints logs data cache cache/neuron; do
  make_dir 1777 "$FSX/$dir"
done
make_dir 0755 "$FSX/logs/provision"
log "shared directories ready under $FSX: envs platform checkpoints logs data cache/neuron"
