#!/usr/bin/env bash
# Step "ready": is this node ready for a Sana job? FSx writable, the accelerator driver
# answers (nvidia-smi / neuron-ls, where installed), the backend env imports torch (and
# torch_xla + torch_neuronx on trn) plus the training package, and this node's part of Slurm is up (slurmctld
# on the controller, slurmd on gpu/trn nodes, the controller reachable from the login node).
# On success it writes this node's one-line status file on FSx
# ($FSX/logs/provision/<instance>.status); on_init_complete.sh writes a FAILED one when any
# step fails.
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

# check_slurm: HyperPod (Extended mode) configures and starts this node's part of Slurm; we
# only wait for it, with a bound: "OnInitComplete and lifecycle scripts can run before or in
# parallel with Slurm service startup" (awslabs/awsome-distributed-ai,
# 1.architectures/5.sagemaker-hyperpod/Extensions/detect-node/README.md). What "up" means per
# role follows HyperPod's own scripts:
#   controller  slurmctld active (Extensions/observability/install_slurm_exporter.sh checks
#               `systemctl is-active --quiet slurmctld`)
#   gpu, trn    slurmd active (LifecycleScripts/base-config/start_slurm.sh enables slurmd on
#               compute nodes)
#   login       the controller answers `scontrol ping`: a login node only submits, and
#               slurmd does not stay up there ("slurmd won't run because slurm.conf does not
#               contain login nodes", start_slurm.sh: the Customer Managed sample; Extended
#               mode's login nodes are assumed alike), so its readiness is the client's.
check_slurm() {
  local what label hint out state
  local -a probe
  case $NODE_ROLE in
    controller) what="slurmctld is not active on this node" probe=(unit_state slurmctld)
      label="systemctl is-active slurmctld" hint="see \`journalctl -u slurmctld\` on this node" ;;
    login) what="slurmctld does not answer from this login node" probe=(slurm_ping)
      label="scontrol ping" hint="see the controller's status file and \`journalctl -u slurmctld\` there" ;;
    *) what="slurmd is not active on this node" probe=(unit_state slurmd)
      label="systemctl is-active slurmd" hint="see \`journalctl -u slurmd\` on this node" ;;
  esac
  local wait_s=${LIFECYCLE_SLURM_WAIT_S:-300} poll_s=${LIFECYCLE_SLURM_POLL_S:-5}
  local deadline=$((SECONDS + wait_s)) remaining
  until out=$("${probe[@]}" 2>&1); do
    state=$(printf '%s\n' "$out" | head -n 1)
    remaining=$((deadline - SECONDS))
    if ((remaining <= 0)); then
      die "$what after ${wait_s}s ($label: ${state:-no answer}); HyperPod starts Slurm in Extended mode (the group's SlurmConfig), not this script: $hint"
    fi
    log "waiting for Slurm ($label: ${state:-no answer}; ${remaining}s left)"
    sleep $((remaining < poll_s ? remaining : poll_s))
  done
  log "Slurm is up here ($label: $(printf '%s\n' "$out" | head -n 1))"
  case $NODE_ROLE in
    controller) details+=("slurm=slurmctld") ;;
    login) details+=("slurm=slurmctld-reachable") ;;
    *) details+=("slurm=slurmd") ;;
  esac
}

check_fsx_writable
case $NODE_ROLE in
  gpu)
    check_accelerator nvidia-smi gpu_list gpu
    check_env "${ENV_GPU_DIR:?}" torch
    ;;
  trn)
    check_accelerator neuron-ls neuron_list neuron
    check_env "${ENV_NEURON_DIR:?}" torch torch_xla torch_neuronx
    ;;
esac
check_slurm

status=$(printf '%s READY node=%s group=%s role=%s ip=%s package=%s %s\n' \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$NODE_NAME" "$NODE_GROUP" "$NODE_ROLE" "$NODE_IP" \
  "$CFG_PACKAGE_HASH" "${details[*]}")
write_node_status "$status"
log "status: $status"
