#!/usr/bin/env bash
# Step "env-gpu" / "env-neuron": the backend's Python environment on FSx, built ONCE per
# cluster however many nodes boot at the same time.
#
#   python_env.sh gpu|neuron [build|use|prepare]
#
# build (gpu/trn nodes): build the env if no node has, wait for it otherwise, verify it.
# prepare (rollout.sh): the same for the package being rolled out, but leave the link alone:
# rollout.sh flips the env links and platform/current together once every env is ready. With
# PYTHON_ENV_TARGET_FILE set, the env's directory name is written there.
# use (login node): only make sure this node has the base Python the env links to (a venv's
# bin/python points at the node-local interpreter), and check the env if it is ready yet.
#
# The env lives at <envs.KIND>-<key> with <envs.KIND> (the path in the profile) a symlink to
# it. <key> hashes the requirements file, the pip index and the base Python, so a package
# with new requirements builds a new env beside the old one (running jobs keep theirs) and
# an unchanged one is never rebuilt.
#
# Once per cluster: every node takes an flock on FSx (cluster-wide on Lustre) with a
# timeout; the first builds, the others block, then find the ready marker and only verify.
# The marker is written after pip AND the import check succeed, so a failed or killed
# build is never marked ready (and the next node to get the lock removes its leftovers).
#
# Private cluster (CFG_PRIVATE_NETWORK, privateNetwork=true): no index is reachable; the env is
# installed from the cluster's wheelhouse (wheelhouse.sh), with exactly the Python it was built for.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars FSX CFG_PACKAGE_HASH NODE_NAME

kind=${1:-}
case $kind in
  gpu)
    link=${ENV_GPU_DIR:?}
    imports=(torch)
    index_args=()
    ;;
  neuron)
    link=${ENV_NEURON_DIR:?}
    # torch_neuronx too: a torch-xla without Neuron's plugin would train on the CPU device.
    imports=(torch torch_xla torch_neuronx)
    # torch-neuronx, neuronx-cc and libneuronxla exist only on Neuron's repository
    # (settings neuron_pip_index: the one place its URL is configured).
    index_args=()
    if [[ -n ${CFG_NEURON_PIP_INDEX:-} ]]; then index_args=(--extra-index-url "$CFG_NEURON_PIP_INDEX"); fi
    ;;
  *) die "usage: python_env.sh gpu|neuron (got '$kind')" ;;
esac

mode=${2:-build}
[[ $mode =~ ^(build|use|prepare)$ ]] || die "usage: python_env.sh gpu|neuron [build|use|prepare] (got '$mode')"
# build/use: the env of the package the cluster serves (platform/current, which only a rollout
# moves), not this node's own: a node booted from a newer prefix must not bring its requirements
# in. prepare: the package being rolled out (rollout.sh sets CFG_PACKAGE_HASH).
package=$CFG_PACKAGE_HASH
if [[ $mode != prepare ]]; then
  package=$(readlink "$FSX/platform/current") || die "no $FSX/platform/current; the package step sets it"
fi
requirements="$FSX/platform/$package/training/requirements-$kind.txt"
lock_timeout=${LIFECYCLE_ENV_LOCK_TIMEOUT_S:-3600}
# The training pins need Python >= 3.11 (numpy 2.4, diffusers 0.42 and transformers 5.2x
# publish nothing for 3.10, the python3 of Ubuntu 22.04 AMIs). The oldest that works is tried
# first: Neuron's compiler/runtime wheels follow new Python releases late.
min_python=${LIFECYCLE_MIN_PYTHON:-3.11}
[[ -r $requirements ]] || die "no $requirements in package $package; the training package must ship it"
private=${CFG_PRIVATE_NETWORK:-false}
if [[ $private == true ]]; then
  # shellcheck source=SCRIPTDIR/wheelhouse.sh
  source "$(dirname "${BASH_SOURCE[0]}")/wheelhouse.sh"
  wheelhouse_settings "$kind" "$package"
  # The wheels are for that Python only (cp311 ABI tags): no other interpreter will do.
  min_python=$wheelhouse_python
fi

# python_version EXE: "3.11" (fails if EXE does not run).
python_version() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# pick_base_python: sets base_python to the first interpreter >= min_python.
pick_base_python() {
  local exe version
  for exe in "python$min_python" python3.11 python3.12 python3; do
    command -v "$exe" >/dev/null 2>&1 || continue
    version=$(python_version "$exe") || continue
    if [[ $private == true && $version != "$min_python" ]]; then continue; fi
    if [[ $(printf '%s\n' "$min_python" "$version" | sort -V | head -n 1) == "$min_python" ]]; then
      base_python=$exe
      return 0
    fi
  done
  return 1
}

if ! pick_base_python; then
  [[ $private != true ]] \
    || die "no python$min_python on this node, the Python the $kind wheelhouse is built for, and apt-get cannot reach the Ubuntu archive without internet egress (privateNetwork): use an AMI that has it, or build the wheelhouse for this node's Python (python -m stacks.wheelhouse build --python 3.N) and redeploy"
  log "no Python >= $min_python here (python3 is $(python_version python3 || echo missing)); installing python$min_python"
  apt_install "python$min_python" "python$min_python-venv" \
    || die "no Python >= $min_python on this node (python3 is $(python_version python3 || echo missing)) and apt-get install python$min_python python$min_python-venv failed; the training requirements need it"
  pick_base_python || die "python$min_python is still missing after apt-get install"
fi
log "base Python: $(command -v "$base_python") ($(python_version "$base_python"))"

key=$({
  cat "$requirements"
  printf 'index=%s\n' "${CFG_NEURON_PIP_INDEX:-}"
  "$base_python" -c 'import sys; print(sys.version)'
  echo "recipe=1" # bump when the build recipe below changes
  # Only on a private cluster, so the key of every online env stays what it was.
  if [[ $private == true ]]; then printf 'wheelhouse=%s\n' "$wheelhouse_lock_sha256"; fi
} | sha256sum | cut -c1-12)
target="$link-$key"
marker="$target/.sana-env-ready"
lock="$(dirname "$link")/.locks/$(basename "$link").lock"

is_ready() {
  [[ -f $marker ]]
}

# An env is only ever marked ready here, after pip and the import check; on any failure the
# EXIT trap removes the half-built env.
build_env() {
  log "building env $target from $requirements${index_args[*]:+ (${index_args[*]})}"
  rm -rf "$target"
  trap 'rm -rf "$target"' EXIT
  if ! "$base_python" -m venv "$target"; then
    # Ubuntu ships venv's ensurepip in a separate package (python3.X-venv).
    local venv_package
    venv_package="python$(python_version "$base_python")-venv"
    log "$base_python cannot create a venv; installing $venv_package"
    apt_install "$venv_package" || die "$base_python cannot create a venv and apt-get install $venv_package failed"
    rm -rf "$target"
    "$base_python" -m venv "$target" || die "$base_python -m venv $target failed"
  fi
  local status=0
  # --no-cache-dir: the wheels (GBs for torch + CUDA) would only fill the root volume twice.
  # --retries 10: HyperPod's host agent restarts systemd-resolved while lifecycle scripts run
  # (awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/LifecycleScripts/
  # base-config/on_create.sh sleeps 30 s for it); pip retries name resolution errors with
  # backoff, which rides that out without a blind sleep.
  local -a source_args=("${index_args[@]}" -r "$requirements")
  local what="-r $requirements"
  if [[ $private == true ]]; then
    wheelhouse_fetch
    mapfile -t source_args < <(wheelhouse_pip_args)
    what="from the wheelhouse $wheelhouse_dir"
  fi
  "$target/bin/python" -m pip install --no-input --disable-pip-version-check --no-cache-dir --retries 10 \
    "${source_args[@]}" || status=$?
  ((status == 0)) || die "pip install $what failed (exit $status); the pip output above in the provisioning log says which requirement"
  # The package on FSx (platform/current) is importable from the env without PYTHONPATH.
  local site
  site=$("$target/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$FSX/platform/current" >"$site/sana-platform.pth"
  check_imports "$target" || die "the new env $target cannot import ${imports[*]}: $import_error"
  printf 'key=%s built_by=%s at=%s requirements=%s\n' "$key" "$NODE_NAME" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$requirements" | write_atomically "$marker" 0644
  trap - EXIT
  log "env $target built and marked ready"
}

import_error=""
check_imports() {
  local env=$1 code
  code="import $(IFS=,; echo "${imports[*]}")"
  # -I: neither the working directory nor PYTHONPATH can satisfy the import instead of the env.
  import_error=$("$env/bin/python" -I -c "$code" 2>&1 | tail -n 1) && return 0
  return 1
}

if [[ $mode == use ]]; then
  if is_ready && check_imports "$link"; then
    log "env $link imports ${imports[*]}"
  else
    log "env $link is not ready yet; the first $kind node to boot builds it (this node has its base Python)"
  fi
  exit 0
fi

# build_once: the env at $target, built by whichever node takes the lock first. Returns with
# the lock still held (fd 9) so the caller can flip the link before another node looks.
build_once() {
  exec 9>>"$lock"
  log "waiting up to ${lock_timeout}s for the build lock $lock"
  flock -w "$lock_timeout" 9 \
    || die "timed out after ${lock_timeout}s waiting for $lock: another node is still building $target (see that node's provisioning log; LIFECYCLE_ENV_LOCK_TIMEOUT_S sets the wait)"
  if is_ready; then
    log "env $target was built by $(sed -n 's/.*built_by=\([^ ]*\).*/\1/p' "$marker")"
  else
    build_env
  fi
}

if [[ $mode == prepare ]]; then
  if is_ready; then
    log "env $target is already built and ready"
  else
    build_once
    exec 9>&-
  fi
  check_imports "$target" || die "env $target (ready marker present) cannot import ${imports[*]}: $import_error"
  if [[ -n ${PYTHON_ENV_TARGET_FILE:-} ]]; then
    basename "$target" | write_atomically "$PYTHON_ENV_TARGET_FILE" 0644
  fi
  log "env $target imports ${imports[*]}; $link is flipped by the rollout"
  exit 0
fi

if is_ready && [[ $(readlink "$link" 2>/dev/null) == "$(basename "$target")" ]]; then
  log "env $link -> $(basename "$target") is already built and ready"
elif [[ -L $link && -f $link/.sana-env-ready ]]; then
  # The cluster's env (another node built it; this node's key differs, e.g. by its base Python):
  # only a rollout moves the link, and a node that cannot use it must not move it under the
  # others' jobs.
  check_imports "$link" \
    || die "env $link -> $(readlink "$link") is the cluster's (ready) but cannot import ${imports[*]} on this node: $import_error; its base Python is not the one the env was built with: replace the node with the cluster's AMI, or roll out a package (the rollout rebuilds the envs)"
  log "env $link -> $(readlink "$link") stays: ready and imports ${imports[*]} here; only a rollout moves it"
else
  build_once
  point_link "$link" "$(basename "$target")"
  exec 9>&- # release the lock; verification below needs no lock
fi

check_imports "$link" || die "env $link (ready marker present) cannot import ${imports[*]}: $import_error"
log "env $link -> $(basename "$target") imports ${imports[*]}"
