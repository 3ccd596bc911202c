#!/usr/bin/env bash
# Step "dirs": the shared directories on FSx every node and job expects, and one private
# directory per cluster user in each tree that holds a user's runs (runbooks/users.md).
#
#   envs/, platform/      root:root 0755: built by the lifecycle, read by everyone; a job must
#                         not change the env or the package under other jobs.
#   data/                 root:<group> 3775: shared inputs (the data bucket's association);
#                         setgid keeps new entries in the group, the sticky bit keeps anyone
#                         from renaming or deleting another user's entries.
#   artefacts/            root:<group> 3775 likewise (the artefacts bucket's association:
#                         what is written here is exported to S3).
#   models/               root:root 0755: model weights (DC-AE, Gemma-2, a pretrained Sana) that an
#                         admin stages with sudo (runbooks/data.md, "Model weights"); every job reads
#                         them, no user can swap them under another's job.
#   artefacts/checkpoints/<user>/, logs/<user>/, cache/inductor/<user>/, cache/neuron/<user>/,
#   runs/<user>/, exports/<user>/
#                         <user>:<group> 0700: run directories, job logs (Slurm's --output
#                         /fsx/logs/%u/...), compile caches, runs started by hand (--output-dir) and
#                         exported models. Their parents are root:root 0755
#                         (logs/ is 1755: root-owned, sticky), so no user can create, rename or
#                         replace another user's directory, nor plant one before its owner.
#   logs/provision/       root 0755: the node status files this lifecycle writes as root.
#   logs/root/            root 0700: output of the jobs root submits (the rollout).
#   <home_root>/          root 0755: one 0700 home per cluster user inside (step "users").
#
# Every directory is created and owned through lifecycle_scripts/safe_fs.py, which walks each
# path with O_NOFOLLOW and changes owner/mode on file descriptors: a symlink a user planted
# anywhere on the way fails this step with one line instead of being followed by root. Owners
# are numeric (the cluster's fixed UIDs/GID): this step runs before the accounts exist here.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX CFG_CLUSTER_GID CFG_CLUSTER_USERS HOME_ROOT_DIR

gid=$CFG_CLUSTER_GID
safe_fs dir "$FSX" 0:0 0755 envs envs/.locks platform platform/.locks
safe_fs dir "$FSX" "0:$gid" 3775 data artefacts
safe_fs dir "$FSX" 0:0 1755 logs
safe_fs dir "$FSX" 0:0 0755 logs/provision artefacts/checkpoints cache cache/inductor cache/neuron models runs exports
safe_fs dir "$FSX" 0:0 0700 logs/root

read -r -a specs <<<"$CFG_CLUSTER_USERS"
for spec in "${specs[@]}"; do
  name=${spec%%:*} uid=${spec##*:}
  safe_fs userdir "$FSX" "$uid:$gid" 0700 "logs/$name" "artefacts/checkpoints/$name" \
    "cache/inductor/$name" "cache/neuron/$name" "runs/$name" "exports/$name"
done

# The home root may lie outside FSX's tree only in name (settings.sh keeps it under fsx_mount).
safe_fs dir "$(dirname "$HOME_ROOT_DIR")" 0:0 0755 "$(basename "$HOME_ROOT_DIR")"
safe_fs dir "$HOME_ROOT_DIR" 0:0 0700 .locks
log "shared directories ready under $FSX: envs platform models (0755) data artefacts (group $gid, 3775) logs (1755)" \
  "cache runs exports; private logs, checkpoints, compile caches, runs and exports for ${#specs[@]} users"
