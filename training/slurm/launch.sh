#!/usr/bin/env bash
# Shared launcher behind the Sana Slurm job scripts (train-gpu, train-trainium, precompute,
# bench, export, report). The .sbatch files only carry the #SBATCH header and call this script,
# so the environment, the paths and the torchrun line are written once.
#
#   launch.sh job  KIND [CONFIG] [ARGS...]   in the batch step (first node of the allocation):
#                                            node profile, run/log dirs, then one task per node
#                                            with srun (srun --auto-resume=1 on HyperPod)
#   launch.sh node KIND [CONFIG] [ARGS...]   in every srun task: torchrun for this node
#   launch.sh record KIND                    a pipeline stage's job, after its step succeeded:
#                                            writes the stage's run.json (training/pipeline/)
#   launch.sh paths                          outside a job: the roots and package a job of this
#                                            package resolves, one KEY=VALUE a line
#
# KIND is gpu | trainium | precompile | precompute | bench | export | report. CONFIG is a YAML
# file (gpu, trainium, precompile, bench; default: the 600M preset; precompute, export and
# report take none); ARGS go to the entrypoint unchanged. export and report run one process.
# The job runs as the submitting user and writes only under $SANA_LOG_ROOT and
# $SANA_CHECKPOINT_ROOT (the package tree is root's and read-only). The package and env are
# resolved once per job and pinned for its reruns (pin_job_environment).
# Operator guide: runbooks/train-slurm.md.
set -euo pipefail

# training/slurm/launch.sh -> the directory that holds the `training` package, with symlinks
# resolved (pwd -P): /fsx/platform/current moves when the platform is updated (rollout), and
# every node and every rerun of this job must keep running the code the job started with
# (pin_job_environment below makes that hold across requeues too).
PACKAGE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
readonly PACKAGE_ROOT
readonly LAUNCHER=$PACKAGE_ROOT/training/slurm/launch.sh
readonly KINDS_TEXT="gpu, trainium, precompile, precompute, bench, export or report"

die() {
  echo "launch.sh: $*" >&2
  exit 1
}

# Source the node profile written by the lifecycle scripts. Whatever the submitting shell
# exported wins over the profile (`SANA_CHECKPOINT_ROOT=... sbatch`, `NCCL_DEBUG=INFO sbatch`
# must not be overwritten): a login shell holds the login node's profile, which only has the
# cluster-wide values, so the compute node still adds its own backend settings (NCCL/EFA,
# Neuron). The node's identity (SANA_ROLE, SANA_GROUP) is the exception: it must describe the
# node the job runs on, not the login node it was submitted from.
load_node_profile() {
  local profile=${SANA_PROFILE:-/etc/profile.d/sana-platform.sh}
  if [[ ! -r $profile ]]; then
    echo "launch.sh: no node profile at $profile; using defaults for unset SANA_* variables"
    return 0
  fi
  local -a names
  local -A submitted=()
  mapfile -t names < <(compgen -e | grep -vxE 'SANA_(ROLE|GROUP)' || true)
  local name
  for name in "${names[@]}"; do submitted[$name]=${!name-}; done
  set +u # a profile is written for interactive shells, not for `set -u`
  # shellcheck source=/dev/null
  source "$profile"
  set -u
  for name in "${names[@]}"; do
    # Only what the profile changed: re-exporting everything would trip over readonly ones.
    if [[ ${!name-} != "${submitted[$name]}" ]]; then export "$name=${submitted[$name]}"; fi
  done
  echo "launch.sh: loaded node profile $profile"
}

# Defaults equal what the lifecycle profile writes on the cluster
# (lifecycle_scripts/node_profile.sh), so a node without the profile still finds FSx.
apply_defaults() {
  export SANA_FSX=${SANA_FSX:-/fsx}
  export SANA_PLATFORM_DIR=${SANA_PLATFORM_DIR:-$SANA_FSX/platform/current}
  export SANA_ENV_GPU=${SANA_ENV_GPU:-$SANA_FSX/envs/gpu}
  export SANA_ENV_NEURON=${SANA_ENV_NEURON:-$SANA_FSX/envs/neuron}
  export SANA_CHECKPOINT_ROOT=${SANA_CHECKPOINT_ROOT:-$SANA_FSX/checkpoints}
  export SANA_LOG_ROOT=${SANA_LOG_ROOT:-$SANA_FSX/logs}
  export SANA_DATA_ROOT=${SANA_DATA_ROOT:-$SANA_FSX/data}
  export SANA_RDZV_PORT=${SANA_RDZV_PORT:-29500}
  # Rank 0 advertises its metrics port here for the controller's collector (training/observability).
  export SANA_METRICS_TARGETS_DIR=${SANA_METRICS_TARGETS_DIR:-$SANA_FSX/observability/targets}
  # HyperPod's marker directory; overridable so tests can exercise both srun forms.
  export SANA_HYPERPOD_DIR=${SANA_HYPERPOD_DIR:-/opt/sagemaker_cluster}
}

# own_dir ROOT VAR: ROOT/<this user>, checked to be this user's alone (trusted_path: owned by us,
# no one else may write it or the directories above it) and printed; one line naming VAR otherwise.
# A ROOT of the user's own choosing (`SANA_LOG_ROOT=~/runs sbatch ...`) gets the directory made.
own_dir() {
  local root=$1 var=$2 dir why
  dir=$root/$(id -un)
  if [[ ! -e $dir && ! -L $dir ]]; then
    # Succeeds only where this user may write (a root of their own); never under the platform's.
    { mkdir -p "$root" && mkdir -m 0700 "$dir"; } 2>/dev/null \
      || die "$dir does not exist: the lifecycle makes $root/<user> for every cluster user at boot (add the user to clusterUsers and re-run it, runbooks/users.md), or set $var to a directory of yours"
  fi
  [[ -d $dir && ! -L $dir ]] || die "$dir is not a directory; it must be your own directory ($var)"
  why=$(trusted_path "$dir")
  [[ -z $why && $(stat -c %u "$dir") == "$(id -u)" ]] \
    || die "$dir is not yours alone (${why:-owner uid $(stat -c %u "$dir")}): another user could change what this job reads there; it must be your own directory ($var)"
  echo "$dir"
}

# Compile caches of this user only (compiled graphs and kernels are code the job runs): the
# inductor cache training/model/compile.py puts under $SANA_FSX/cache/inductor/$USER and the Neuron
# cache $SANA_CACHE_ROOT/neuron/<user> (NEURON_COMPILE_CACHE_URL, unless the submitter chose one).
use_own_compile_caches() {
  local kind=$1 cache_root=${SANA_CACHE_ROOT:-$SANA_FSX/cache}
  case $(accelerator_of "$kind") in
    gpu) [[ -d $SANA_FSX/cache/inductor ]] && { own_dir "$SANA_FSX/cache/inductor" "the inductor cache root" >/dev/null || exit 1; } ;;
    neuron)
      if [[ -z ${NEURON_COMPILE_CACHE_URL:-} && -d $cache_root/neuron ]]; then
        NEURON_COMPILE_CACHE_URL=$(own_dir "$cache_root/neuron" SANA_CACHE_ROOT) || exit 1
        export NEURON_COMPILE_CACHE_URL
      fi ;;
  esac
  return 0
}

# bench runs on either accelerator: the partition picks it (trn -> trainium, else gpu), and
# SANA_BENCH_BACKEND=gpu|trainium overrides.
bench_backend() {
  local backend=${SANA_BENCH_BACKEND:-}
  if [[ -z $backend ]]; then
    [[ ${SLURM_JOB_PARTITION:-} == trn ]] && backend=trainium || backend=gpu
  fi
  [[ $backend == gpu || $backend == trainium ]] \
    || die "SANA_BENCH_BACKEND=$backend: unknown; use gpu or trainium"
  echo "$backend"
}

# The accelerator family a kind runs on: precompute needs GPUs (DC-AE + Gemma-2). export and
# report need no accelerator, only an env with the package's libraries: the partition's
# (both envs carry diffusers; the Neuron env has no matplotlib, so a report with bench charts
# belongs on gpu).
accelerator_of() {
  case $1 in
    trainium | precompile) echo neuron ;;
    bench) [[ $(bench_backend) == trainium ]] && echo neuron || echo gpu ;;
    export | report) [[ ${SLURM_JOB_PARTITION:-} == trn ]] && echo neuron || echo gpu ;;
    gpu | precompute) echo gpu ;;
    *) die "unknown job kind '$1'; use $KINDS_TEXT" ;;
  esac
}

# Kinds that run ONE process on one node (a second rank would write the same output).
single_process() {
  [[ $1 == export || $1 == report ]]
}

# Python environment: the CUDA env for GPU work, the Neuron env for Trainium.
env_dir_for() {
  case $(accelerator_of "$1") in
    gpu) echo "$SANA_ENV_GPU" ;;
    neuron) echo "$SANA_ENV_NEURON" ;;
  esac
}

count_gpus() {
  command -v nvidia-smi >/dev/null || return 0
  nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}

# NeuronCores visible to torch-neuronx: trn1/trn1n 32 (16 devices x 2), trn2 64 (16 devices x
# 8 physical cores / logical NC size 2, the trn2 default). neuron-ls reports the logical count
# per device; without it, derive it from the device nodes and the instance family.
count_neuron_cores() {
  if command -v neuron-ls >/dev/null; then
    neuron-ls --json-output 2>/dev/null \
      | "$1" -c 'import json, sys; print(sum(int(d.get("nc_count", 0)) for d in json.load(sys.stdin)))' \
      && return 0
  fi
  local devices
  devices=$(find /dev -maxdepth 1 -name 'neuron[0-9]*' 2>/dev/null | wc -l)
  ((devices > 0)) || return 0
  local family
  family=$(cat /sys/devices/virtual/dmi/id/product_name 2>/dev/null || true)
  case $family in
    trn2*) echo $((devices * 8 / ${NEURON_LOGICAL_NC_CONFIG:-2})) ;;
    *) echo $((devices * 2)) ;;
  esac
}

# One torchrun worker per accelerator; SANA_NPROC_PER_NODE overrides (CPU tests, partial nodes).
nproc_per_node() {
  local kind=$1 python=$2 count
  if single_process "$kind"; then
    echo 1
    return 0
  fi
  if [[ -n ${SANA_NPROC_PER_NODE:-} ]]; then
    [[ $SANA_NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] \
      || die "SANA_NPROC_PER_NODE=$SANA_NPROC_PER_NODE: not a positive integer"
    echo "$SANA_NPROC_PER_NODE"
    return 0
  fi
  case $(accelerator_of "$kind") in
    gpu) count=$(count_gpus) ;;
    neuron) count=$(count_neuron_cores "$python") ;;
  esac
  [[ ${count:-0} -gt 0 ]] \
    || die "$(hostname): no $(accelerator_of "$kind") accelerators found (nvidia-smi -L / neuron-ls); set SANA_NPROC_PER_NODE to run anyway"
  echo "$count"
}

# SageMaker's name for this node's instance type (bench results carry it). Nitro instances
# report their EC2 type as the DMI product name; "local" elsewhere.
instance_type() {
  local product
  product=$(cat /sys/devices/virtual/dmi/id/product_name 2>/dev/null || true)
  if [[ $product =~ ^[a-z][a-z0-9-]*\.[0-9]*[a-z]+$ ]]; then echo "ml.$product"; else echo local; fi
}

# The content hash a package is installed under: the lifecycle copies it to
# <fsx>/platform/<hash>/training (lifecycle_scripts/install_package.sh; the hash is
# stacks/cluster.py package_hash of lifecycle_scripts/ + training/ + the node settings). Elsewhere (a checkout) the
# sha256 of the training/ tree's files, prefixed "tree-" so it is never mistaken for one.
package_hash_of() {
  local root=$1
  if [[ $(basename "$(dirname "$root")") == platform ]]; then
    basename "$root"
    return 0
  fi
  printf 'tree-%s\n' "$(cd "$root" && find training -type f ! -path '*/__pycache__/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)"
}

# The requirements hash of an env: lifecycle_scripts/python_env.sh builds each env at
# <envs>/<kind>-<key> (key = sha256 of the requirements file, the pip index, the base Python
# and its recipe version) and, only once pip and the import check passed, writes
# "key=<key> built_by=... requirements=..." into <env>/.sana-env-ready. That marker is read,
# not the directory name: it exists only for a complete env. None (empty) for an env the
# lifecycle did not build.
env_hash_of() {
  local marker=$1/.sana-env-ready
  [[ -r $marker ]] || return 0
  sed -n 's/^key=\([^ ]*\).*/\1/p' "$marker"
}

readonly PINNED_VARS=(SANA_PACKAGE_ROOT SANA_PACKAGE_HASH SANA_ENV_PATH SANA_ENV_HASH)

# Pinned job environment. The package and env symlinks are resolved ONCE per job, at its first
# start (SLURM_RESTART_COUNT unset or 0: a pinned-env left by a job of the same name and id on
# an earlier cluster is overwritten), and kept in <job log dir>/pinned-env; every later start
# of the same job (SLURM_RESTART_COUNT >= 1) reuses them. A later start is a requeue (`scontrol requeue`, or HyperPod's auto-resume, which on GPU nodes
# (GRES) requeues the whole job rather than rerunning the step: awslabs/awsome-distributed-ai
# 1.architectures/5.sagemaker-hyperpod/tools/devops-agent/docs/hyperpod-mental-model.md,
# "Slurm auto-resume requeues, not shrinks-in-place, on GRES nodes"). A requeue reruns the
# batch script from the path it was submitted as, e.g. /fsx/platform/current/..., which may
# now be a newer package: that launcher then re-executes the pinned one, so the job goes on
# with the code, env and config defaults it started with. Exports PINNED_VARS
# (training/provenance.py writes them into every checkpoint) and sets PIN_ORIGIN.
PIN_ORIGIN=""
pin_job_environment() {
  local kind=$1
  shift
  local pin=$SANA_JOB_LOG_DIR/pinned-env
  if [[ -f $pin && ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
    local key value
    while IFS='=' read -r key value; do
      case $key in
        SANA_PACKAGE_ROOT | SANA_PACKAGE_HASH | SANA_ENV_PATH | SANA_ENV_HASH | SANA_CONTAINER_SQSH) export "$key=$value" ;;
      esac
    done <"$pin"
    [[ -n ${SANA_PACKAGE_ROOT:-} && -n ${SANA_ENV_PATH:-} ]] \
      || die "$pin lacks SANA_PACKAGE_ROOT or SANA_ENV_PATH; resubmit the job (a new job id pins afresh)"
    if [[ $SANA_PACKAGE_ROOT != "$PACKAGE_ROOT" ]]; then
      [[ -z ${SANA_PINNED_REEXEC:-} ]] || die "pinned launcher $SANA_PACKAGE_ROOT is not the one running ($PACKAGE_ROOT)"
      [[ -f $SANA_PACKAGE_ROOT/training/slurm/launch.sh ]] \
        || die "the package job $SLURM_JOB_ID was pinned to ($SANA_PACKAGE_ROOT, in $pin) is gone; resubmit the job to run the current package"
      echo "launch.sh: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $PACKAGE_ROOT is not the package it was pinned to; re-executing $SANA_PACKAGE_ROOT/training/slurm/launch.sh"
      SANA_PINNED_REEXEC=1 exec bash "$SANA_PACKAGE_ROOT/training/slurm/launch.sh" job "$kind" "$@"
    fi
    PIN_ORIGIN="reused from $pin"
    return 0
  fi
  local env_link
  export SANA_PACKAGE_ROOT=$PACKAGE_ROOT
  SANA_PACKAGE_HASH=$(package_hash_of "$PACKAGE_ROOT")
  if [[ -n ${SANA_CONTAINER_IMAGE:-} ]]; then
    # Container mode: the image is the env (resolved once, pinned like a venv); inside it the
    # node step reports the image's own package (run_node).
    SANA_CONTAINER_SQSH=$(resolve_container_image "$SANA_CONTAINER_IMAGE") || exit 1
    export SANA_CONTAINER_SQSH SANA_ENV_PATH=$SANA_CONTAINER_SQSH
    SANA_ENV_HASH=$(basename "$SANA_CONTAINER_SQSH" .sqsh)
  else
    env_link=$(env_dir_for "$kind")
    SANA_ENV_PATH=$(readlink -f "$env_link") || die "cannot resolve the env $env_link; build the $kind env or point SANA_ENV_GPU/SANA_ENV_NEURON at one"
    export SANA_ENV_PATH
    SANA_ENV_HASH=$(env_hash_of "$SANA_ENV_PATH")
  fi
  export SANA_PACKAGE_HASH SANA_ENV_HASH
  local name tmp
  tmp=$(mktemp "$pin.XXXXXX")
  for name in "${PINNED_VARS[@]}"; do printf '%s=%s\n' "$name" "${!name}"; done >"$tmp"
  [[ -z ${SANA_CONTAINER_SQSH:-} ]] || printf 'SANA_CONTAINER_SQSH=%s\n' "$SANA_CONTAINER_SQSH" >>"$tmp"
  chmod 0644 "$tmp" # readable like the rest of the job's logs (mktemp makes it 0600)
  mv -f "$tmp" "$pin"
  PIN_ORIGIN="pinned at first start in $pin"
}

# ---- Container mode (opt-in; venvs stay the default) -------------------------------------------
# SANA_CONTAINER_IMAGE = an image URI (<registry>/<repo>:<tag> or @sha256:<digest>, e.g. the ECR
# repository `make push-image` pushes to, imported by root) or a squashfs file. The job then
# runs the same srun/torchrun flow with every node's task inside that image through pyxis
# (NVIDIA/pyxis: srun --container-image/--container-mounts, see runbooks/containers.md), with
# the image's own package and venv (containers/*.Dockerfile install them at CONTAINER_ROOT).
readonly CONTAINER_ROOT=${SANA_CONTAINER_ROOT:-/opt/sana}

# Images come only from where this job's user can trust them: the root-owned image store
# <images dir> (lifecycle_scripts/container_runtime.sh makes it root 0755; root imports into it
# by digest, lifecycle_scripts/import_image.sh), or a .sqsh file only this user (or root) can
# change. A job never imports an image itself: it has no registry credentials (the node's are
# root's, lifecycle_scripts/imds_block.sh), and a store any user could write would let one
# user choose the image another user's job runs.
#   <registry>/<repo>@sha256:<hex>  -> <images dir>/sha256-<hex>.sqsh
#   <registry>/<repo>:<tag>         -> the digest root recorded in <images dir>/by-tag/<registry>/<repo>/<tag>
#                                      (the platform's ECR tags are immutable, stacks/images.py)
#   /path/to/file.sqsh              -> that file, if trusted_path accepts it

# trusted_path PATH: "" when PATH (a file or directory, resolved) and every directory above it
# can be changed only by root or this user (owner root or us, no group/other write bit except on
# a sticky directory, where others cannot rename or delete what is ours); else why not.
trusted_path() {
  local path=$1 me owner mode
  me=$(id -u)
  [[ -e $path ]] || { echo "$path does not exist"; return 0; }
  path=$(readlink -f "$path")
  read -r owner mode < <(stat -c '%u %a' "$path")
  if [[ $owner != 0 && $owner != "$me" ]]; then echo "$path belongs to uid $owner"; return 0; fi
  if (((8#$mode) & 8#022)); then echo "$path is writable by others (mode $mode)"; return 0; fi
  local dir=$path
  while [[ $dir != / ]]; do
    dir=$(dirname "$dir")
    read -r owner mode < <(stat -c '%u %a' "$dir")
    if [[ $owner != 0 && $owner != "$me" ]]; then echo "$dir (above $path) belongs to uid $owner"; return 0; fi
    if (((8#$mode) & 8#022)) && ! (((8#$mode) & 8#1000)); then
      echo "$dir (above $path) is writable by others (mode $mode) without the sticky bit"
      return 0
    fi
  done
}

# The registry a job of a private cluster may run images from (its own ECR), or nothing: read from
# the platform settings installed with this package (lifecycle_scripts/install_package.sh copies
# them to <package>/lifecycle/, world-readable; a checkout has none and is not a private cluster).
private_image_registry() {
  local settings=$PACKAGE_ROOT/lifecycle/platform-settings.json
  [[ -e $settings ]] || return 0
  python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))
print(s["image_registry"] if s.get("private_network") else "")' "$settings" 2>/dev/null \
    || die "cannot read the private_network and image_registry settings of $settings (installed with this package)"
}

# The .sqsh of an image digest in the store (present or not).
store_path_of() {
  echo "${SANA_IMAGES_DIR:-$SANA_FSX/images}/sha256-$1.sqsh"
}

# Resolve SANA_CONTAINER_IMAGE to the .sqsh the job runs; one line naming the fix otherwise.
resolve_container_image() {
  local image=$1 why digest index store=${SANA_IMAGES_DIR:-$SANA_FSX/images}
  local import_hint="the platform team imports it: sudo bash /fsx/platform/current/lifecycle/import_image.sh $image (runbooks/containers.md)"
  local only_registry
  only_registry=$(private_image_registry) || exit 1
  if [[ -n $only_registry ]]; then
    # privateNetwork: images come from this account's ECR only, imported by root into the store.
    local ecr_only="a private cluster runs images from its own ECR only ($only_registry): push the image there (make push-image), have it imported and name it by its URI (runbooks/containers.md)"
    if [[ $image == /* ]]; then
      local resolved
      resolved=$(readlink -f "$image")
      [[ $(dirname "$resolved") == "$(readlink -f "$store")" && $(basename "$resolved") =~ ^sha256-[0-9a-f]{64}\.sqsh$ ]] \
        || die "SANA_CONTAINER_IMAGE=$image: not an image imported from ECR into $store; $ecr_only"
    elif [[ ${image%%/*} != "$only_registry" ]]; then
      die "SANA_CONTAINER_IMAGE=$image: registry ${image%%/*} is not this cluster's; $ecr_only"
    fi
  fi
  if [[ $image == /* ]]; then
    [[ -f $image ]] || die "SANA_CONTAINER_IMAGE=$image: no such file; import it first (runbooks/containers.md) or give an image URI"
    why=$(trusted_path "$image")
    [[ -z $why ]] || die "SANA_CONTAINER_IMAGE=$image: not an image only you or root can change ($why); another user could replace what your job runs: use an image from $store or a .sqsh in a directory of yours"
    readlink -f "$image"
    return 0
  fi
  if [[ $image =~ ^[^/@:]+(:[0-9]+)?/[a-z0-9._/-]+@sha256:([0-9a-f]{64})$ ]]; then
    digest=${BASH_REMATCH[2]}
  elif [[ $image =~ ^([^/@:]+(:[0-9]+)?/[a-z0-9._/-]+):([A-Za-z0-9_][A-Za-z0-9._-]{0,127})$ ]]; then
    index=$store/by-tag/${BASH_REMATCH[1]}/${BASH_REMATCH[3]}
    [[ -f $index ]] || die "SANA_CONTAINER_IMAGE=$image: not imported on this cluster; $import_hint"
    why=$(trusted_path "$index")
    [[ -z $why ]] || die "SANA_CONTAINER_IMAGE=$image: the tag index $index is not root's ($why); ask the platform team to re-import the image"
    digest=$(sed -n 's/^sha256:\([0-9a-f]\{64\}\)$/\1/p' "$index")
    [[ -n $digest ]] || die "SANA_CONTAINER_IMAGE=$image: $index holds no sha256 digest; ask the platform team to re-import the image"
  else
    die "SANA_CONTAINER_IMAGE=$image: not <registry>/<repo>:<tag>, <registry>/<repo>@sha256:<digest> or a .sqsh path (runbooks/containers.md)"
  fi
  local sqsh
  sqsh=$(store_path_of "$digest")
  [[ -f $sqsh ]] || die "SANA_CONTAINER_IMAGE=$image: sha256:$digest is not imported on this cluster; $import_hint"
  why=$(trusted_path "$sqsh")
  [[ -z $why ]] || die "SANA_CONTAINER_IMAGE=$image: $sqsh is not root's ($why); the image store must be root-only (lifecycle_scripts/container_runtime.sh)"
  echo "$sqsh"
}

# --container-mounts: FSx (and the job's roots and the launcher where they lie outside it), the
# EFA devices on GPU nodes, the Neuron devices on Trainium nodes. enroot.conf keeps /dev
# unrestricted as well (container_runtime.sh), but naming the devices keeps the job correct on
# a node whose enroot config restricts /dev.
container_mounts() {
  local kind=$1 path dev
  local -a mounts=("$SANA_FSX:$SANA_FSX")
  for path in "$SANA_LOG_ROOT" "$SANA_CHECKPOINT_ROOT" "$SANA_DATA_ROOT" "$PACKAGE_ROOT"; do
    [[ $path == "$SANA_FSX" || $path == "$SANA_FSX"/* || ! -e $path ]] || mounts+=("$path:$path")
  done
  case $(accelerator_of "$kind") in
    gpu) [[ -d /dev/infiniband ]] && mounts+=(/dev/infiniband:/dev/infiniband) ;;
    neuron) for dev in /dev/neuron[0-9]*; do [[ -e $dev ]] && mounts+=("$dev:$dev"); done ;;
  esac
  local IFS=,
  echo "${mounts[*]}"
}

entry_module() {
  case $1 in
    gpu) echo training.gpu ;;
    trainium | precompile) echo training.trainium ;;
    precompute) echo training.precompute ;;
    bench) echo training.bench ;;
    export) echo training.export ;;
    report) echo training.pipeline.report ;;
  esac
}

run_job() {
  local kind=$1
  shift
  [[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job; submit with sbatch (runbooks/train-slurm.md)"
  load_node_profile
  apply_defaults
  if [[ $kind == bench ]]; then bench_backend >/dev/null; fi # fail here on a bad SANA_BENCH_BACKEND

  local run_name=${SLURM_JOB_NAME:-sana-$kind} user
  user=$(id -un)
  # One user, one set of directories: logs, runs and compile caches live in <root>/<user>/,
  # which the lifecycle makes for every cluster user and nobody else can write
  # (lifecycle_scripts/shared_dirs.sh). Another user can then neither plant the weights
  # `--resume auto` loads nor the kernels a job runs, nor rename or read a run.
  export USER=$user
  export SANA_JOB_LOG_DIR
  SANA_JOB_LOG_DIR=$(own_dir "$SANA_LOG_ROOT" SANA_LOG_ROOT)/$run_name-$SLURM_JOB_ID || exit 1
  mkdir -p "$SANA_JOB_LOG_DIR" || die "cannot create $SANA_JOB_LOG_DIR; check SANA_LOG_ROOT"
  # Training writes into a run directory named after the Slurm job name, NOT the job id, so
  # a resubmitted job with the same name finds its checkpoints and `--resume auto` goes on.
  # A pipeline stage (SANA_PIPELINE_STAGE, training/pipeline/) of any kind keeps its output and
  # run.json there too: its job name carries the stage's content hash.
  export SANA_RUN_DIR=$SANA_CHECKPOINT_ROOT/$user/$run_name
  if [[ $kind == gpu || $kind == trainium || -n ${SANA_PIPELINE_STAGE:-} ]]; then
    own_dir "$SANA_CHECKPOINT_ROOT" SANA_CHECKPOINT_ROOT >/dev/null || exit 1
    mkdir -p "$SANA_RUN_DIR" || die "cannot create $SANA_RUN_DIR; check SANA_CHECKPOINT_ROOT"
  fi
  use_own_compile_caches "$kind"
  # Before the tee below: it may re-execute the pinned launcher, which starts its own.
  pin_job_environment "$kind" "$@"
  # Everything from here on (this script and every node's torchrun, labelled by srun) also
  # goes to job.log, next to the per-rank logs.
  exec > >(tee -a "$SANA_JOB_LOG_DIR/job.log") 2>&1
  local tee_pid=$!

  # --kill-on-bad-exit=1: "terminate a step if any task exits with a non-zero exit code"
  # (srun(1), https://slurm.schedmd.com/srun.html#OPT_kill-on-bad-exit): one node's torchrun
  # exiting after a rank failed ends the other nodes' tasks, the backstop behind the failure
  # markers (training/failure/) for a rank that dies without one (SIGKILL, OOM killer).
  local -a srun_args=(--nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label)
  if single_process "$kind"; then srun_args[0]=--nodes=1; fi
  if [[ -d $SANA_HYPERPOD_DIR ]]; then
    # HyperPod's Slurm plugin: on a hardware fault it replaces the node and reruns this srun
    # step in the same job; the entrypoint then resumes from the newest complete checkpoint.
    srun_args+=(--auto-resume=1)
  fi

  local -a container_args=()
  if [[ -n ${SANA_CONTAINER_SQSH:-} ]]; then
    # pyxis (NVIDIA/pyxis): the task runs in the image; no home mount (enroot.conf too), the
    # launcher itself is reached through the FSx mount.
    container_args=(--container-image="$SANA_CONTAINER_SQSH" --container-mounts="$(container_mounts "$kind")"
      --no-container-mount-home --container-writable)
    srun_args+=("${container_args[@]}")
    echo "launch.sh: container image $SANA_CONTAINER_SQSH"
  fi

  echo "launch.sh: job $SLURM_JOB_ID ($run_name) kind=$kind nodes=$SLURM_JOB_NUM_NODES [$SLURM_JOB_NODELIST] restart=${SLURM_RESTART_COUNT:-0} user=$(id -un)"
  echo "launch.sh: package $SANA_PACKAGE_ROOT hash=$SANA_PACKAGE_HASH ($PIN_ORIGIN)"
  echo "launch.sh: env $SANA_ENV_PATH requirements_hash=${SANA_ENV_HASH:-none (no .sana-env-ready: not built by lifecycle_scripts/python_env.sh)}"
  echo "launch.sh: logs $SANA_JOB_LOG_DIR"
  if [[ $kind == gpu || $kind == trainium ]]; then echo "launch.sh: run dir (checkpoints) $SANA_RUN_DIR"; fi
  if [[ -n ${SANA_PIPELINE_STAGE:-} ]]; then echo "launch.sh: pipeline stage $SANA_PIPELINE_STAGE (output in $SANA_RUN_DIR)"; fi
  case $(accelerator_of "$kind") in
    gpu) echo "launch.sh: compile cache (inductor) ${SANA_FSX}/cache/inductor/$user" ;;
    neuron) echo "launch.sh: compile cache (neuron) ${NEURON_COMPILE_CACHE_URL:-none set: the Neuron default}" ;;
  esac
  echo "launch.sh: srun ${srun_args[*]}"
  local status=0
  export SANA_STEP_STARTED_AT
  SANA_STEP_STARTED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  srun "${srun_args[@]}" bash "$LAUNCHER" node "$kind" "$@" || status=$?
  echo "launch.sh: job $SLURM_JOB_ID step finished with exit code $status"
  if [[ $status == 0 && -n ${SANA_PIPELINE_STAGE:-} ]]; then
    # A pipeline stage (training/pipeline/): its run.json, the only mark of a finished stage,
    # is written here, after every task of the step succeeded, never by a failed one. One
    # task, in the same env or image as the step; it fails the job when the output is not
    # what the stage promised (e.g. no final checkpoint).
    echo "launch.sh: recording pipeline stage $SANA_PIPELINE_STAGE"
    srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1 "${container_args[@]}" bash "$LAUNCHER" record "$kind" || status=$?
    echo "launch.sh: job $SLURM_JOB_ID record step finished with exit code $status"
  fi
  exec >&- 2>&-
  wait "$tee_pid" || true # let tee flush job.log before Slurm reaps the job
  return "$status"
}

# This node's static torchrun node rank: SLURM_NODEID (its index in the step's node list), checked
# against the expanded job node list so that node rank 0 is the node named $1 (the master).
static_node_rank() {
  local head=$1 id=${SLURM_NODEID:-}
  [[ $id =~ ^[0-9]+$ ]] || die "SLURM_NODEID='$id': not set by srun; run the node step through launch.sh job"
  local -a hosts
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  local mine=${SLURMD_NODENAME:-${hosts[$id]:-}}
  [[ ${hosts[$id]:-} == "$mine" && ${hosts[0]} == "$head" ]] \
    || die "SLURM_NODEID=$id is ${hosts[$id]:-nothing} in $SLURM_JOB_NODELIST but this node is $mine; node ranks would not match the master $head"
  echo "$id"
}

# The Python and package root of this task (sets `python` and `package_root` of the caller):
# the image's in container mode, else the env the batch step pinned.
resolve_python() {
  local kind=$1 env_dir
  package_root=$PACKAGE_ROOT
  if [[ -n ${SANA_CONTAINER_SQSH:-} ]]; then
    # Inside the image: its venv and its package; provenance names the image's package hash
    # (SANA_IMAGE_PACKAGE_HASH in its image.env = its sana.package-hash label, containers/image.py).
    package_root=$CONTAINER_ROOT
    python=$CONTAINER_ROOT/venv/bin/python
    [[ -x $python ]] || die "$(hostname): no Python at $python in $SANA_CONTAINER_SQSH; is it an image built from containers/ (make image)?"
    local image_hash
    image_hash=$(sed -n 's/^SANA_IMAGE_PACKAGE_HASH=//p' "$CONTAINER_ROOT/image.env" 2>/dev/null || true)
    export SANA_PACKAGE_ROOT=$CONTAINER_ROOT SANA_PACKAGE_HASH=${image_hash:-unknown}
  else
    # The env the batch step resolved and pinned (exported to every srun task); the symlink only
    # when run by hand outside `launch.sh job`.
    env_dir=${SANA_ENV_PATH:-$(env_dir_for "$kind")}
    python=$env_dir/bin/python
    [[ -x $python ]] || die "$(hostname): no Python at $python; build the $kind env or point SANA_ENV_GPU/SANA_ENV_NEURON at one"
  fi
}

# The record step of a pipeline stage (run_job, after the step succeeded): run.json and the
# lineage files, written by training/pipeline/record.py from $SANA_PIPELINE_STAGE.
run_record() {
  local kind=$1 python package_root
  resolve_python "$kind"
  export PYTHONPATH=$package_root${PYTHONPATH:+:$PYTHONPATH}
  exec "$python" -m training.pipeline record "$SANA_PIPELINE_STAGE"
}

# Print the roots and package identity a job of this package resolves (load_node_profile,
# apply_defaults, package_hash_of), so `python -m training.pipeline` places a chain's outputs
# exactly where its jobs will write them. Outside a job; nothing is created.
print_paths() {
  load_node_profile >&2
  apply_defaults
  local name
  for name in SANA_CHECKPOINT_ROOT SANA_LOG_ROOT SANA_DATA_ROOT; do printf '%s=%s\n' "$name" "${!name}"; done
  printf 'SANA_PACKAGE_ROOT=%s\nSANA_PACKAGE_HASH=%s\n' "$PACKAGE_ROOT" "$(package_hash_of "$PACKAGE_ROOT")"
}

run_node() {
  local kind=$1
  shift
  local python package_root
  resolve_python "$kind"

  # Recomputed in every step, not inherited from the batch script: after a HyperPod node
  # replacement the rerun step may have a different first node.
  local head nproc
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
  nproc=$(nproc_per_node "$kind" "$python")

  # Training and bench take a YAML config (optional first argument); precompute, export
  # (its first argument is the run to export) and report have none.
  local config=""
  if [[ $kind != precompute && $kind != export && $kind != report ]]; then
    if [[ $# -gt 0 && $1 != -* ]]; then
      config=$1
      shift
    elif [[ $kind == trainium || $kind == precompile ]]; then
      # Trainium's own config: the GPU one does not fit a NeuronCore (training/perf/memory.py)
      config=$package_root/training/configs/trn-sana-600m-512.yaml
    else
      config=$package_root/training/configs/sana-600m-512.yaml
    fi
  fi
  local -a entry=(-m "$(entry_module "$kind")")
  [[ -n $config ]] && entry+=(--config "$config")
  case $kind in
    gpu | trainium) entry+=(--resume auto --output-dir "$SANA_RUN_DIR") ;;
    # The training job's config and world, traced a few steps: no checkpoint, no resume
    # (training/trainium.py --precompile); its run dir is scratch in the job's log dir.
    precompile) entry+=(--precompile --output-dir "$SANA_JOB_LOG_DIR/precompile-run") ;;
    # Given before the user's ARGS, so an explicit --out/--instance-type there wins.
    # --work-dir per user: bench's default, $TMPDIR/sana-bench, is shared by every user of the
    # node, and the first user's directory would refuse everyone else's run.
    bench) entry+=(--backend "$(bench_backend)" --out "$SANA_JOB_LOG_DIR/bench.json"
      --instance-type "${SANA_INSTANCE_TYPE:-$(instance_type)}"
      --work-dir "${TMPDIR:-/tmp}/sana-bench-$(id -un)") ;;
  esac
  entry+=("$@")

  # How the torchrun agents of the job form one world. GPU: c10d rendezvous (elastic; ranks
  # ordered by the store). Trainium: static ranks, as the Neuron training scripts launch them
  # (aws-neuron-samples / neuronx-distributed Slurm run scripts: --nnodes $SLURM_NTASKS
  # --node_rank $SLURM_NODEID --master_addr <first of scontrol show hostnames>,
  # NEURON_RT_ROOT_COMM_ID=<that address>:46820). Node rank 0 is the first host, rank 0 runs
  # on it, and the root-comm address is built from the SAME $head, so the three agree by
  # construction; c10d would order nodes by its own store and could put rank 0 elsewhere.
  local -a world=(--rdzv-backend=c10d --rdzv-endpoint="$head:$SANA_RDZV_PORT" --rdzv-id="$SLURM_JOB_ID")
  if single_process "$kind"; then
    # One process on a node it may share (no --exclusive): a rendezvous on its own free port
    # (torchrun --standalone), never $SANA_RDZV_PORT, which a training job there may hold.
    world=(--standalone)
  elif [[ $(accelerator_of "$kind") == neuron ]]; then
    local node_rank
    node_rank=$(static_node_rank "$head") || exit 1
    world=(--node-rank="$node_rank" --master-addr="$head" --master-port="$SANA_RDZV_PORT")
    local root_comm=$head:${SANA_NEURON_COMM_PORT:-46820}
    if [[ -n ${NEURON_RT_ROOT_COMM_ID:-} && $NEURON_RT_ROOT_COMM_ID != "$root_comm" ]]; then
      echo "launch.sh: NEURON_RT_ROOT_COMM_ID=$NEURON_RT_ROOT_COMM_ID from the environment replaced by $root_comm (rank 0's node); set SANA_NEURON_COMM_PORT to change the port"
    fi
    # Set explicitly: left unset, torch-xla derives MASTER_ADDR:62182 (pytorch/xla v2.9
    # torch_xla/_internal/neuron.py set_rt_root_comm_id), a port nothing reserves.
    export NEURON_RT_ROOT_COMM_ID=$root_comm
    echo "launch.sh: $(hostname -s): node_rank=$node_rank master=$head NEURON_RT_ROOT_COMM_ID=$NEURON_RT_ROOT_COMM_ID"
  fi
  export PYTHONPATH=$package_root${PYTHONPATH:+:$PYTHONPATH}

  # Every rank's stdout/stderr goes to its own file under ranks/<node>/; the console (and so
  # job.log) carries local rank 0 of each node only, or 64 ranks x N nodes would bury it.
  local node
  node=$(hostname -s)
  # precompile: the SAME torchrun world inside neuron_parallel_compile, on every node, so the
  # extracted graphs carry the real run's collectives and hashes (the tool wraps the whole
  # launch command: awsdocs-neuron v2.29.0 pytorch-neuron-parallel-compile.rst,
  # `neuron_parallel_compile torchrun --nproc_per_node=N <script>`). It ships in the env's bin.
  local -a wrap=()
  if [[ $kind == precompile ]]; then
    local tool=${SANA_PARALLEL_COMPILE:-$(dirname "$python")/neuron_parallel_compile}
    [[ -x $tool ]] || die "$(hostname): no neuron_parallel_compile at $tool; it comes with torch-neuronx (training/requirements-neuron.txt) in the Neuron env"
    wrap=("$tool")
  fi
  local nnodes=$SLURM_JOB_NUM_NODES
  if single_process "$kind"; then nnodes=1; fi
  echo "launch.sh: $node: ${wrap[*]:+${wrap[*]} }torchrun nnodes=$nnodes nproc_per_node=$nproc ${world[*]} -> ${entry[*]}"
  exec "${wrap[@]}" "$python" -m torch.distributed.run \
    --nnodes="$nnodes" \
    --nproc-per-node="$nproc" \
    "${world[@]}" \
    --max-restarts=0 \
    --log-dir="$SANA_JOB_LOG_DIR/ranks/$node" \
    --tee=3 \
    --local-ranks-filter=0 \
    "${entry[@]}"
}

main() {
  if [[ ${1:-} == paths ]]; then
    print_paths
    return 0
  fi
  [[ $# -ge 2 ]] || die "usage: launch.sh job|node|record KIND [CONFIG] [ARGS...], or launch.sh paths"
  local mode=$1
  shift
  case $1 in
    gpu | trainium | precompile | precompute | bench | export | report) ;;
    *) die "unknown job kind '$1'; use $KINDS_TEXT" ;;
  esac
  case $mode in
    job) run_job "$@" ;;
    node) run_node "$@" ;;
    record) run_record "$1" ;;
    *) die "unknown mode '$mode'; use job, node, record or paths" ;;
  esac
}

main "$@"
