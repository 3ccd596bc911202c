#!/usr/bin/env bash
# Step "containers" (optional: on_init_complete.sh turns a failure into a WARN line in the
# node's status file, never a failed node): enroot + pyxis for Sana's container jobs
# (SANA_CONTAINER_IMAGE in training/slurm/launch.sh, runbooks/containers.md).
#
# No AWS source says the Extended-mode AMI ships them (its samples promise "Slurm and Docker";
# awslabs/awsome-distributed-ai 1.architectures/5.sagemaker-hyperpod/Extensions/observability/
# README.md), so this step installs what is missing, as AWS's reference lifecycle does
# (LifecycleScripts/base-config/lifecycle_script.py runs utils/install_enroot_pyxis.sh on every
# node by default, Config.enable_docker_enroot_pyxis = True). Learnt from it, done our way:
#   gpu, trn, login
#     enroot  NVIDIA's enroot and enroot+caps .debs of ENROOT_VERSION (the reference's pin),
#             with squashfs-tools, parallel, fuse-overlayfs and squashfuse, through apt-get;
#     pyxis   built from NVIDIA's source of PYXIS_VERSION against the node's Slurm headers
#             (CPPFLAGS=-I /opt/slurm/include, as the reference) and installed with its own
#             `make install` (prefix /usr/local: PYXIS_PLUGIN);
#     enroot.conf (NVIDIA/enroot doc/configuration.md keys), written whole:
#       ENROOT_RUNTIME_PATH / ENROOT_DATA_PATH / ENROOT_TEMP_PATH  on the local NVMe
#           (/opt/dlami/nvme once dlami-nvme.service has finished, the reference's wait,
#           else /opt/sagemaker; unpacked rootfs are large and per node)
#       ENROOT_CACHE_PATH      ${HOME}/.cache/enroot: each user's own layer cache (on FSx, every node)
#       ENROOT_SQUASH_OPTIONS  -comp lzo -noD (enroot's default; tests/containers squashes the same)
#       ENROOT_ROOTFS_WRITABLE yes, ENROOT_MOUNT_HOME no, ENROOT_RESTRICT_DEV no (EFA/Neuron devices)
#       ENROOT_CONFIG_PATH     ${HOME}/.config/enroot: each user's .credentials (ECR login)
#     plus <fsx>/images (root 0755) for the .sqsh files root imports by digest (import_image.sh),
#     and each cluster user's runtime/data directory, made by root for that user (below).
#   controller
#     registers pyxis in /opt/slurm/etc/plugstack.conf itself: compute and login nodes run
#     slurmd configless and get plugstack.conf from the controller, and an included file only
#     travels with it when it is named without a path next to slurm.conf (Slurm
#     configless_slurm.html, "Limitations"; the reference's `include .../plugstack.conf.d/
#     pyxis.conf` does not reach them, see its utils/slurm_fix_plugstackconf.sh). The line is
#     `optional`, not pyxis's own `required`: on a node where the plugin is missing or broken
#     srun still runs every job that is not a container job. Then `scontrol reconfigure`, which
#     sends the new file to the running slurmds ("The nodes will have to be notified of any
#     changes to the configuration file through an scontrol reconfig or a slurmd restart",
#     configless_slurm.html); nothing is restarted (the reference restarts slurmctld/slurmd).
# Whether srun on a node really loads pyxis depends on the controller and on Slurm's timing:
# the late check (container_check.sh, after slurmd) tests that.
# With containerRuntime=false nothing is installed or configured (one WARN line on gpu, trn
# and login nodes). On a private cluster (privateNetwork) nothing is downloaded: GitHub and Ubuntu's
# archive are unreachable, so enroot and pyxis must be on the AMI (else one WARN line says so), and
# the images come from this account's ECR only (import_image.sh and launch.sh refuse any other).
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars FSX CFG_CLUSTER_GID CFG_CLUSTER_USERS NODE_ROLE CFG_CONTAINER_RUNTIME
PRIVATE_NETWORK=${CFG_PRIVATE_NETWORK:-false}

ENROOT_VERSION=3.4.1
PYXIS_VERSION=0.19.0
# pyxis's Makefile: PLUGINDIR = $(DESTDIR)$(prefix)/lib/slurm, prefix ?= /usr/local (the
# reference keeps it). LIFECYCLE_PYXIS_PREFIX moves it (tests/slurm: a plugin real Slurm loads).
PYXIS_PREFIX=${LIFECYCLE_PYXIS_PREFIX:-/usr/local}
PYXIS_PLUGIN=$PYXIS_PREFIX/lib/slurm/spank_pyxis.so
SLURM_PREFIX=${PLATFORM_ROOT}/opt/slurm
SLURM_ETC=${SLURM_ETC:-$SLURM_PREFIX/etc}
ENROOT_CONF=${PLATFORM_ROOT}/etc/enroot/enroot.conf
# enroot's .deb installs the enroot command here (NVIDIA/enroot packaging).
ENROOT_BIN=${PLATFORM_ROOT}/usr/bin/enroot
MOUNTS=${PLATFORM_ROOT}/proc/mounts

# no_downloads_here WHAT: on a private cluster, stop before a download that cannot reach the internet.
no_downloads_here() {
  [[ $PRIVATE_NETWORK == true ]] || return 0
  die "$1 is not on this AMI and a private cluster (privateNetwork) cannot download it: no internet egress to NVIDIA's releases on github.com or Ubuntu's archive; container jobs need an AMI that carries enroot and pyxis (runbooks/containers.md, \"Private network\")"
}

# fetch URL DEST: download with retries (the reference retries every download with backoff).
fetch() {
  curl -fsSL --retry 5 --retry-delay 5 --connect-timeout 30 -o "$2" "$1" 2>&1 \
    || die "cannot download $1 (curl exit $?)"
}

work=""
cleanup() { if [[ -n $work ]]; then rm -rf "$work"; fi; }
trap cleanup EXIT
scratch_dir() {
  if [[ -z $work ]]; then
    mkdir -p "${PLATFORM_ROOT}/tmp"
    work=$(mktemp -d "${PLATFORM_ROOT}/tmp/sana-containers.XXXXXX")
  fi
}

install_enroot() {
  if [[ -x $ENROOT_BIN ]]; then
    log "enroot $("$ENROOT_BIN" version 2>/dev/null || echo '?') is installed"
    return 0
  fi
  local arch base pkg deb debs=()
  no_downloads_here "enroot"
  arch=$(dpkg --print-architecture) || die "dpkg --print-architecture failed; enroot is installed from .debs"
  base=${LIFECYCLE_ENROOT_RELEASE_URL:-https://github.com/NVIDIA/enroot/releases/download/v$ENROOT_VERSION}
  scratch_dir
  for pkg in enroot enroot+caps; do
    deb="$work/${pkg}_${ENROOT_VERSION}-1_${arch}.deb"
    fetch "$base/$(basename "$deb")" "$deb"
    # A download that is not the package asked for (an error page, another release) stops here.
    [[ $(dpkg-deb --field "$deb" Package 2>/dev/null) == "$pkg" && \
       $(dpkg-deb --field "$deb" Version 2>/dev/null) == "$ENROOT_VERSION-1" ]] \
      || die "$base/$(basename "$deb") is not the Debian package $pkg $ENROOT_VERSION-1"
    debs+=("$deb")
  done
  log "installing enroot $ENROOT_VERSION ($arch) and what it runs with"
  apt_install squashfs-tools parallel fuse-overlayfs squashfuse "${debs[@]}" \
    || die "apt-get install of enroot $ENROOT_VERSION failed (its output above says why)"
  [[ -x $ENROOT_BIN ]] || die "enroot $ENROOT_VERSION was installed but $ENROOT_BIN is missing"
  log "enroot $("$ENROOT_BIN" version 2>/dev/null || echo '?') installed"
}

install_pyxis() {
  local plugin=${PLATFORM_ROOT}$PYXIS_PLUGIN
  if [[ -f $plugin ]]; then
    log "pyxis is installed ($PYXIS_PLUGIN)"
    return 0
  fi
  no_downloads_here "pyxis"
  [[ -r $SLURM_PREFIX/include/slurm/spank.h ]] \
    || die "no Slurm headers at /opt/slurm/include/slurm/spank.h: pyxis is built against this node's Slurm (HyperPod installs it under /opt/slurm)"
  if ! command -v make >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1; then
    apt_install gcc make libc6-dev || die "pyxis needs a C compiler and make; apt-get install gcc make libc6-dev failed"
  fi
  local url=${LIFECYCLE_PYXIS_SOURCE_URL:-https://github.com/NVIDIA/pyxis/archive/refs/tags/v$PYXIS_VERSION.tar.gz}
  scratch_dir
  fetch "$url" "$work/pyxis.tar.gz"
  mkdir "$work/pyxis"
  tar -xzf "$work/pyxis.tar.gz" -C "$work/pyxis" --strip-components=1 \
    || die "$url is not a pyxis source archive (tar failed)"
  log "building pyxis $PYXIS_VERSION against $SLURM_PREFIX/include"
  # pyxis's Makefile appends the environment's CPPFLAGS to its own (a CPPFLAGS= argument
  # would replace them).
  CPPFLAGS="-I $SLURM_PREFIX/include" make -C "$work/pyxis" -j "$(nproc)" \
    || die "building pyxis $PYXIS_VERSION failed (the compiler output above says why)"
  make -C "$work/pyxis" install prefix="$PYXIS_PREFIX" DESTDIR="$PLATFORM_ROOT" \
    || die "make install of pyxis $PYXIS_VERSION failed"
  [[ -f $plugin ]] || die "pyxis's make install did not put $PYXIS_PLUGIN in place"
  log "pyxis $PYXIS_VERSION installed at $PYXIS_PLUGIN"
}

# pyxis_registration FILE: how plugstack.conf registers pyxis: "direct <line>", "include
# <name>" (an adjacent file configless ships), "path-include <glob>" (one it does not), or nothing.
pyxis_registration() {
  local conf=$1 pattern='^[[:space:]]*(required|optional)[[:space:]]+[^[:space:]]*spank_pyxis\.so' inc
  [[ -r $conf ]] || return 1
  if grep -qE "$pattern" "$conf"; then echo "direct $(grep -m1 -E "$pattern" "$conf")"; return 0; fi
  while read -r inc; do
    if [[ $inc == */* ]]; then
      # shellcheck disable=SC2086 # an include is a glob (plugstack.conf(5))
      if grep -qsE "$pattern" ${PLATFORM_ROOT}$inc; then echo "path-include $inc"; return 0; fi
    elif grep -qsE "$pattern" "$(dirname "$conf")/$inc"; then
      echo "include $inc"
      return 0
    fi
  done < <(sed -n 's/^[[:space:]]*include[[:space:]]\+\([^[:space:]]*\).*/\1/p' "$conf")
  return 1
}

register_pyxis() {
  local conf=$SLURM_ETC/plugstack.conf found tmp out
  [[ -f $SLURM_ETC/slurm.conf ]] \
    || die "no $SLURM_ETC/slurm.conf on the controller (HyperPod writes it there); pyxis is not registered"
  if found=$(pyxis_registration "$conf"); then
    case $found in
      path-include*)
        warn "$conf registers pyxis through '${found#path-include }', which configless nodes never receive (Slurm ships only includes named without a path, next to slurm.conf): move that line into $conf itself"
        ;;
      *) log "pyxis is already registered in $conf (${found})" ;;
    esac
    return 0
  fi
  tmp=$(mktemp "$conf.XXXXXX")
  if [[ -f $conf ]]; then cp -p "$conf" "$tmp"; fi
  {
    echo "# pyxis (container jobs: srun --container-image), added by the Sana platform lifecycle"
    echo "# (lifecycle_scripts/container_runtime.sh). optional: a node without the plugin runs every other job."
    echo "optional $PYXIS_PLUGIN"
  } >>"$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$conf"
  log "registered pyxis in $conf (optional $PYXIS_PLUGIN); configless nodes receive it with plugstack.conf"
  if out=$(slurm_ping 2>&1); then
    out=$(PATH="$PATH:/opt/slurm/bin" scontrol reconfigure 2>&1) \
      || warn "scontrol reconfigure failed ($(printf '%s' "$out" | tail -n 1)): running slurmds get pyxis at their next start"
    log "scontrol reconfigure: slurmctld sends the new plugstack.conf to the running slurmds"
  else
    log "slurmctld is not up yet ($(printf '%s' "$out" | head -n 1)): it reads plugstack.conf when it starts"
  fi
}

# wait_for_dlami_nvme: the DLAMI mounts the instance-store NVMe at /opt/dlami/nvme from
# dlami-nvme.service, which may still run while the lifecycle does; the reference waits up to
# 120 s for it to be active with ExecMainStatus 0 before choosing enroot's paths
# (utils/install_enroot_pyxis.sh: "race condition when mapping enroot path to /opt/dlami/nvme").
wait_for_dlami_nvme() {
  local wait_s=${LIFECYCLE_NVME_WAIT_S:-120} poll_s=${LIFECYCLE_NVME_POLL_S:-5} out load active status
  local deadline=$((SECONDS + wait_s)) remaining
  while :; do
    out=$(systemctl show --property=LoadState,ActiveState,ExecMainStatus dlami-nvme.service 2>/dev/null || true)
    load=$(sed -n 's/^LoadState=//p' <<<"$out")
    active=$(sed -n 's/^ActiveState=//p' <<<"$out")
    status=$(sed -n 's/^ExecMainStatus=//p' <<<"$out")
    if [[ $load == not-found || -z $load ]]; then log "no dlami-nvme.service on this AMI"; return 0; fi
    if [[ $active == active && $status == 0 ]]; then log "dlami-nvme.service has finished"; return 0; fi
    if [[ $active == failed ]]; then log "WARNING: dlami-nvme.service failed (status $status)"; return 0; fi
    remaining=$((deadline - SECONDS))
    if ((remaining <= 0)); then
      log "WARNING: dlami-nvme.service is still $active after ${wait_s}s; choosing enroot's paths without it"
      return 0
    fi
    log "waiting for dlami-nvme.service ($active; ${remaining}s left)"
    sleep $((remaining < poll_s ? remaining : poll_s))
  done
}

# The node's local NVMe, as the reference chooses it.
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

configure_enroot() {
  wait_for_dlami_nvme
  local scratch node_scratch tmp spec uid specs
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
    cp -p "$ENROOT_CONF" "$ENROOT_CONF.ami" # the packaged one, kept once for comparison
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
  log "enroot configured: scratch $node_scratch, per-user cache ~/.cache/enroot, images $FSX/images (root, by digest)"
}

if [[ $CFG_CONTAINER_RUNTIME != true ]]; then
  if [[ $NODE_ROLE == controller ]]; then
    log "containerRuntime=false: pyxis is not registered"
  else
    warn "containerRuntime=false: enroot and pyxis are not installed or configured here, container jobs (SANA_CONTAINER_IMAGE) cannot run on this node"
  fi
  exit 0
fi
case $NODE_ROLE in
  controller) register_pyxis ;;
  *)
    install_enroot
    install_pyxis
    configure_enroot
    log "enroot $("$ENROOT_BIN" version 2>/dev/null || echo '?') + pyxis $PYXIS_PLUGIN ready; srun loads pyxis once slurmd has the controller's plugstack.conf (checked by sana-node-ready.service)"
    if [[ $PRIVATE_NETWORK == true ]]; then
      log "private network: container images only from ${CFG_IMAGE_REGISTRY:-the account ECR}, imported by root (import_image.sh)"
    fi
    ;;
esac
