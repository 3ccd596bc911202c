#!/usr/bin/env bash
# Step "profile": /etc/profile.d/sana-platform.sh, THE one place the environment of the
# training package's job scripts is defined (read by training/slurm/launch.sh). Login
# shells source it; training/slurm/launch.sh sources it on every node of a job.
# It is sourced by sh as well as bash (/etc/profile), so it is plain POSIX `export`s. It
# holds no timestamp: re-provisioning writes the same bytes.
#
# Inputs (exported by on_init_complete.sh from settings.env and node.env; tests/slurm runs this
# script alone with exactly these to get real profiles): PLATFORM_ROOT, NODE_ROLE,
# NODE_GROUP, FSX, ENV_GPU_DIR, ENV_NEURON_DIR, CFG_RDZV_PORT, CFG_REGION, CFG_PROJECT,
# CFG_CLUSTER_NAME, CFG_ARTEFACTS_BUCKET, CFG_DATA_BUCKET.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars NODE_ROLE NODE_GROUP FSX ENV_GPU_DIR ENV_NEURON_DIR CFG_RDZV_PORT CFG_REGION CFG_PROJECT \
  CFG_CLUSTER_NAME CFG_ARTEFACTS_BUCKET CFG_DATA_BUCKET

# export_line NAME VALUE: `export NAME='VALUE'`, single-quoted for sh.
export_line() {
  printf "export %s='%s'\n" "$1" "${2//\'/\'\\\'\'}"
}

common_env() {
  export_line SANA_ROLE "$NODE_ROLE"
  export_line SANA_GROUP "$NODE_GROUP"
  export_line SANA_PROJECT "$CFG_PROJECT"
  export_line SANA_CLUSTER "$CFG_CLUSTER_NAME"
  export_line SANA_REGION "$CFG_REGION"
  export_line SANA_FSX "$FSX"
  export_line SANA_PLATFORM_DIR "$FSX/platform/current"
  export_line SANA_ENV_GPU "$ENV_GPU_DIR"
  export_line SANA_ENV_NEURON "$ENV_NEURON_DIR"
  # Each user's runs, logs and compile caches live in <root>/<user>/ (training/slurm/launch.sh),
  # private directories the dirs step made for every cluster user (shared_dirs.sh).
  # Checkpoints sit under the artefacts bucket's data repository association, so FSx exports
  # them to S3 itself: a job needs no AWS credentials (the node blocks them, imds_block.sh).
  export_line SANA_CHECKPOINT_ROOT "$FSX/artefacts/checkpoints"
  export_line SANA_LOG_ROOT "$FSX/logs"
  export_line SANA_DATA_ROOT "$FSX/data"
  export_line SANA_CACHE_ROOT "$FSX/cache"
  # torchrun's c10d rendezvous port. 29500 is below Linux's default ephemeral range
  # (32768-60999, net.ipv4.ip_local_port_range), so no outgoing connection takes it.
  export_line SANA_RDZV_PORT "$CFG_RDZV_PORT"
  export_line SANA_ARTEFACTS_BUCKET "$CFG_ARTEFACTS_BUCKET"
  export_line SANA_DATA_BUCKET "$CFG_DATA_BUCKET"
  # boto3 does not take the region from instance metadata; the buckets live in this one.
  # shellcheck disable=SC2016 # expanded by the shell that sources the profile
  printf 'export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-%s}"\n' "$CFG_REGION"
}

# NCCL over EFA on p5/p4d (aws-ofi-nccl ships on the HyperPod GPU AMI).
gpu_env() {
  echo "# NCCL over EFA (p5/p4d)"
  export_line FI_PROVIDER efa
  # p4d/p5 EFA supports GPUDirect RDMA: NCCL reads/writes GPU memory directly.
  export_line FI_EFA_USE_DEVICE_RDMA 1
  # DataLoader workers fork after libfabric initialised: keep registered memory fork-safe and
  # avoid the huge-page ENOMEM on fork (awsome-distributed-training EFA cheatsheet).
  export_line FI_EFA_FORK_SAFE 1
  export_line FI_EFA_USE_HUGE_PAGE 0
  # NCCL's bootstrap/socket traffic goes over the VPC interface, never loopback or docker
  # bridges (wrong interface = hangs at init on multi-node jobs).
  export_line NCCL_SOCKET_IFNAME '^docker,lo,veth'
  export_line NCCL_DEBUG WARN
}

# Neuron runtime and compiler on trn1/trn1n/trn2 (Neuron collectives over EFA).
trn_env() {
  echo "# Neuron runtime/compiler and EFA (trn1/trn1n/trn2)"
  export_line FI_PROVIDER efa
  export_line FI_EFA_USE_DEVICE_RDMA 1
  export_line FI_EFA_FORK_SAFE 1
  # 32 workers per node each with glibc's default 8*cores malloc arenas exhaust host memory
  # (Neuron's PyTorch training guides set 64).
  export_line MALLOC_ARENA_MAX 64
  # Full-bf16 weights need stochastic rounding to keep training (runbooks/train-trainium.md, bf16).
  export_line NEURON_RT_STOCHASTIC_ROUNDING_EN 1
  # The compile cache is per user ($SANA_CACHE_ROOT/neuron/<user>, set by launch.sh): a cache
  # another user can write would let them choose the graphs this user's job runs.
  export_line NEURON_CC_FLAGS '--model-type=transformer'
  # The Neuron runtime's root-comm (collectives bootstrap) port; launch.sh builds
  # NEURON_RT_ROOT_COMM_ID=<rank 0's node>:<this port>. Reserved below (reserve_ports).
  export_line SANA_NEURON_COMM_PORT "$NEURON_COMM_PORT"
}

# 46820 (Neuron's samples use it for NEURON_RT_ROOT_COMM_ID) lies inside Linux's ephemeral
# range (32768-60999), so an outgoing connection may already hold it when rank 0's runtime
# binds it. Reserved ports are never handed out as ephemeral ones (kernel
# Documentation/networking/ip-sysctl.rst, ip_local_reserved_ports); the Neuron samples' Slurm
# scripts reserve theirs the same way (sysctl -w net.ipv4.ip_local_reserved_ports=...).
# Written to sysctl.d (survives a reboot) and applied now, merged with what is reserved.
NEURON_COMM_PORT=${NEURON_COMM_PORT:-46820}
reserve_ports() {
  local proc=${PLATFORM_ROOT}/proc/sys/net/ipv4/ip_local_reserved_ports current=""
  [[ -r $proc ]] && current=$(<"$proc")
  local wanted=$current
  if [[ ,$current, != *,"$NEURON_COMM_PORT",* ]]; then wanted=${current:+$current,}$NEURON_COMM_PORT; fi
  mkdir -p "${PLATFORM_ROOT}/etc/sysctl.d"
  printf 'net.ipv4.ip_local_reserved_ports = %s\n' "$wanted" \
    | write_atomically "${PLATFORM_ROOT}/etc/sysctl.d/90-sana-neuron.conf" 0644
  mkdir -p "$(dirname "$proc")"
  printf '%s\n' "$wanted" >"$proc" || die "cannot reserve port $NEURON_COMM_PORT in $proc"
  log "reserved port $NEURON_COMM_PORT (ip_local_reserved_ports=$wanted)"
}

render_profile() {
  echo "# Sana platform node profile (role $NODE_ROLE). Written by lifecycle_scripts/node_profile.sh"
  echo "# at provisioning; edits are lost when the node is re-provisioned."
  common_env
  case $NODE_ROLE in
    gpu) gpu_env ;;
    trn) trn_env ;;
    controller | login) ;;
    *) die "unknown role '$NODE_ROLE'" ;;
  esac
}

mkdir -p "$(dirname "$PROFILE_PATH")"
profile=$(render_profile)
printf '%s\n' "$profile" | write_atomically "$PROFILE_PATH" 0644
log "wrote $PROFILE_PATH for role $NODE_ROLE ($(grep -c '^export ' "$PROFILE_PATH") variables)"
if [[ $NODE_ROLE == trn ]]; then reserve_ports; fi
