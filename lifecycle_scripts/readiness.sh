#!/usr/bin/env bash
# Step "ready": is this node ready for a Sana job? FSx writable, the accelerator driver
# answers (nvidia-smi / neuron-ls, where installed), the backend env imports torch (and
# torch_xla on trn) plus the training package. On success it writes this node's one-line
# status file on FSx ($FSX/logs/provision/<instance>.status); on_create.sh writes a FAILED
# one when any step fails.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars FSX NODE_NAME NODE_ROLE NODE_GROUP NODE_IP CFG_PACKAGE_HASH

details=()

check_fsx_writable() {
  local probe="$FSX/logs/provision/.ready-probe.$NODE_NAME.$$"
  { printf 'ok\n' >"$probe" && rm -f "$probe"; } 2>/dev/null || die "$FSX/logs/provision is not writable"
  details+=("fsx=ok")
}

# check_accelerator TOOL LISTER LABEL: the driver must answer if its tool is installed.
check_accelerator() {
  local tool=$1 lister=$2 label=$3 out
  if ! has_tool "$tool"; then
    log "WARNING: $tool is not installed; cannot check the $label driver"
    details+=("$label=unchecked")
    return 0
  fi
  out=$("$lister" 2>&1) || die "$tool failed: $(printf '%s' "$out" | tail -n 1)"
  log "$tool: $(printf '%s\n' "$out" | head -n 1)"
  details+=("$label=ok")
}

# check_env LINK MODULE...: the env's python imports the modules and the training package.
check_env() {
  local env=$1 out
  shift
  [[ -x $env/bin/python ]] || die "no env at $env (the env step should have built it)"
  # -I: the package must come from FSx through the env's .pth, not from the working
  # directory (HyperPod runs this script next to its own copy of training/).
  out=$("$env/bin/python" -I -c "import $(IFS=,; echo "$*"), training; print(training.__file__)" 2>&1) \
    || die "$env/bin/python cannot import $* training: $(printf '%s' "$out" | tail -n 1)"
  log "$env imports $* and training ($out)"
  details+=("env=$env")
}

check_fsx_writable
case $NODE_ROLE in
  gpu)
    check_accelerator nvidia-smi gpu_list gpu
    check_env "${ENV_GPU_DIR:?}" torch
    ;;
  trn)
    check_accelerator neuron-ls neuron_list neuron
    check_env "${ENV_NEURON_DIR:?}" torch torch_xla
    ;;
esac

status_file=$(node_status_file)
printf '%s READY node=%s group=%s role=%s ip=%s package=%s %s\n' \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$NODE_NAME" "$NODE_GROUP" "$NODE_ROLE" "$NODE_IP" \
  "$CFG_PACKAGE_HASH" "${details[*]}" | write_atomically "$status_file" 0644
log "status: $(cat "$status_file")"
