#!/usr/bin/env bash
# Step "dirs": the shared directories on FSx every node and job expects.
#   envs/, platform/   root:root 0755: built by the lifecycle, read by everyone; a job
#                      must not change the env or the package under other jobs.
#   data/, checkpoints/, logs/ (+ logs/slurm/)
#                      root:<cluster group> 2775: every cluster user (all in the group,
#                      step "users") writes there; setgid keeps new files and directories in
#                      the group, so a run started by one researcher can be resumed by another.
#                      logs/slurm/ holds Slurm's own job output (#SBATCH --output=/fsx/logs/slurm/...).
#   cache/ (+ neuron/) 1777 like /tmp: compile caches any job, of any user, may fill.
#   logs/provision/    root 0755: the node status files this lifecycle writes as root.
#   <home_root>/       root 0755: one 0700 home per cluster user inside (step "users").
# Owners are numeric (the group's fixed GID): this step runs before the group exists here.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX CFG_CLUSTER_GID HOME_ROOT_DIR

# make_dir OWNER MODE DIR. MODE has five digits: GNU chmod keeps a directory's setgid bit
# (inherited from a setgid parent such as logs/) unless a 5-digit numeric mode clears it
# explicitly (coreutils manual, "Directories and the Set-User-ID and Set-Group-ID Bits").
# A symlink is refused, never followed: logs/ is group-writable, so a cluster user could put
# one at logs/slurm or logs/provision, and root's chown/chmod would then apply to its target.
make_dir() {
  local owner=$1 mode=$2 dir=$3
  [[ ! -L $dir ]] || die "$dir is a symlink (to $(readlink "$dir")); the platform expects a directory there: move the link away"
  mkdir -p "$dir"
  chown "$owner" "$dir"
  chmod "$mode" "$dir"
}

for dir in envs envs/.locks platform platform/.locks; do
  make_dir 0:0 00755 "$FSX/$dir"
done
for dir in data checkpoints logs logs/slurm; do
  make_dir "0:$CFG_CLUSTER_GID" 02775 "$FSX/$dir"
done
for dir in cache cache/neuron; do
  make_dir 0:0 01777 "$FSX/$dir"
done
make_dir 0:0 00755 "$FSX/logs/provision"
make_dir 0:0 00755 "$HOME_ROOT_DIR"
make_dir 0:0 00700 "$HOME_ROOT_DIR/.locks"
log "shared directories ready under $FSX: envs platform data checkpoints logs (group $CFG_CLUSTER_GID, 2775) cache homes"
