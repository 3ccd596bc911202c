#!/usr/bin/env bash
# Step "containers": make enroot + pyxis usable for Sana's container jobs on this node
# (SANA_CONTAINER_IMAGE in training/slurm/launch.sh, runbooks/containers.md).
#
# Verify, then configure; never install. The HyperPod AMI ships both: pyxis as
# /opt/slurm/lib/slurm/spank_pyxis.so registered in /opt/slurm/etc/plugstack.conf with a
# `required` line, enroot as an installed package (awslabs/awsome-distributed-ai
# 1.architectures/5.sagemaker-hyperpod/LifecycleScripts/base-config/utils/install_enroot_pyxis.sh,
# which detects exactly these and skips its own install when they are there). A node without
# them fails here with one line instead of failing every container job later.
#
# enroot.conf (NVIDIA/enroot doc/configuration.md keys), written whole like the samples do:
#   ENROOT_RUNTIME_PATH / ENROOT_DATA_PATH / ENROOT_TEMP_PATH  on the local NVMe
#       (/opt/dlami/nvme, else /opt/sagemaker; unpacked rootfs are large and per node)
#   ENROOT_CACHE_PATH      ${HOME}/.cache/enroot: each user's own layer cache (on FSx, every node)
#   ENROOT_SQUASH_OPTIONS  -comp lzo -noD (enroot's default; tests/containers squashes the same)
#   ENROOT_ROOTFS_WRITABLE yes, ENROOT_MOUNT_HOME no, ENROOT_RESTRICT_DEV no (EFA/Neuron devices)
#   ENROOT_CONFIG_PATH     ${HOME}/.config/enroot: each user's .credentials (ECR login)
# plus <fsx>/images (root 0755) for the .sqsh files root imports by digest (import_image.sh), and
# each cluster user's runtime/data directory, made by root for that user (below).
# Then `srun --help` must list --container-image (pyxis loaded by this node's srun).
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX CFG_CLUSTER_GID CFG_CLUSTER_USERS

SLURM_ETC=${SLURM_ETC:-${PLATFORM_ROOT}/opt/slurm/etc}
ENROOT_CONF=${PLATFORM_ROOT}/etc/enroot/enroot.conf
MOUNTS=${PLATFORM_ROOT:-}/proc/mounts

command -v enroot >/dev/null 2>&1 \
  || die "enroot is not installed on this node; the HyperPod AMI ships it: use a current HyperPod AMI (or install enroot+caps from NVIDIA/enroot releases)"

# pyxis registered: a `required ... spank_pyxis.so` line, or an include that pulls one in.
pyxis_registered() {
  local conf=$SLURM_ETC/plugstack.conf
  [[ -r $conf ]] || return 1
  grep -qE '^[[:space:]]*(required|optional)[[:space:]]+[^[:space:]]*spank_pyxis\.so' "$conf" && return 0
  local inc
  while read -r inc; do
    # shellcheck disable=SC2086 # an include is a glob (plugstack.conf(5))
    grep -qsE '^[[:space:]]*(required|optional)[[:space:]]+[^[:space:]]*spank_pyxis\.so' $inc && return 0
  done < <(sed -n 's/^[[:space:]]*include[[:space:]]\+//p' "$conf")
  return 1
}
pyxis_registered \
  || die "pyxis is not registered in $SLURM_ETC/plugstack.conf (no spank_pyxis.so line); the HyperPod AMI registers it: use a current HyperPod AMI"

# The node's local NVMe, as the samples choose it.
local_scratch() {
  local dir
  for dir in /opt/dlami/nvme /opt/sagemaker; do
    if [[ -r $MOUNTS ]] && awk -v d="$dir" '$2 == d { found = 1 } END { exit !found }' "$MOUNTS"; then
      echo "${PLATFORM_ROOT}$dir"
      return 0
    fi
  done
  # On stderr: stdout is this function's value (the scratch path), captured below.
  log "WARNING: neither /opt/dlami/nvme nor /opt/sagemaker is mounted; enroot unpacks images under /tmp" >&2
  echo "${PLATFORM_ROOT}/tmp"
}
scratch=$(local_scratch)

# Root-made, never through a link (lifecycle_scripts/safe_fs.py). Each cluster user's runtime
# and container directories exist before the user's first job, owned by that user, under
# root-only parents: in a shared 1777 directory another user could create them first and then
# own (and fill) the root file system of this user's containers. ENROOT_TEMP_PATH stays a
# sticky scratch directory (enroot makes its temp files there with mktemp).
mkdir -p "$scratch"
safe_fs dir "$scratch" 0:0 1777 tmp
safe_fs dir "$scratch" 0:0 0755 tmp/enroot tmp/enroot/data
read -r -a specs <<<"${CFG_CLUSTER_USERS:-}"
for spec in "${specs[@]}"; do
  uid=${spec##*:}
  safe_fs userdir "$scratch" "$uid:$CFG_CLUSTER_GID" 0700 "tmp/enroot/user-$uid" "tmp/enroot/data/user-$uid"
done
# The image store: root-owned, imported by digest as root (import_image.sh); a job runs only
# images from here or files its own user owns (training/slurm/launch.sh, container mode).
safe_fs dir "$FSX" 0:0 0755 images images/by-tag

# Paths inside enroot.conf are the node's, without the test prefix.
node_scratch=${scratch#"$PLATFORM_ROOT"}
mkdir -p "$(dirname "$ENROOT_CONF")"
if [[ -f $ENROOT_CONF && ! -f $ENROOT_CONF.ami ]]; then
  cp -p "$ENROOT_CONF" "$ENROOT_CONF.ami" # the AMI's own, kept once for comparison
fi
tmp=$(mktemp "$ENROOT_CONF.XXXXXX")
# shellcheck disable=SC2016 # $(id -u) and ${HOME} are expanded by enroot, per user
{
  echo "# Written by the Sana platform lifecycle (lifecycle_scripts/container_runtime.sh)."
  printf 'ENROOT_RUNTIME_PATH        %s/tmp/enroot/user-$(id -u)\n' "$node_scratch"
  printf 'ENROOT_DATA_PATH           %s/tmp/enroot/data/user-$(id -u)\n' "$node_scratch"
  printf 'ENROOT_TEMP_PATH           %s/tmp\n' "$node_scratch"
  # Per user: enroot trusts a layer already in its cache without checking its digest again
  # (NVIDIA/enroot src/docker.sh, docker::_download_extract), so a shared cache would let one
  # user choose the layers of another user's import.
  printf 'ENROOT_CACHE_PATH          ${HOME}/.cache/enroot\n'
  printf 'ENROOT_CONFIG_PATH         ${HOME}/.config/enroot\n'
  printf 'ENROOT_SQUASH_OPTIONS      -comp lzo -noD\n'
  printf 'ENROOT_ROOTFS_WRITABLE     yes\n'
  printf 'ENROOT_MOUNT_HOME          no\n'
  printf 'ENROOT_RESTRICT_DEV        no\n'
} >"$tmp"
chmod 0644 "$tmp"
mv -f "$tmp" "$ENROOT_CONF"

if command -v srun >/dev/null 2>&1; then
  srun --help 2>&1 | grep -q -- '--container-image' \
    || die "srun --help does not list --container-image: pyxis is registered in $SLURM_ETC/plugstack.conf but not loaded by srun; check the plugstack.conf line and spank_pyxis.so"
else
  die "srun is not installed on this node; HyperPod's Slurm (Extended mode) should have put it on PATH"
fi
log "enroot $(enroot version 2>/dev/null || echo '?') + pyxis ready: scratch $node_scratch, per-user cache ~/.cache/enroot, images $FSX/images (root, by digest)"
