#!/usr/bin/env bash
# Step "ready": is this node usable for a Sana job? FSx writable, the accelerator driver
# answers (nvidia-smi / neuron-ls, where installed), the backend env imports torch (and
# torch_xla + torch_neuronx on trn) plus the training package. Any of these failing fails the
# node: it could not train.
#
# Slurm is NOT checked here: HyperPod may start this node's daemon before, during or after the
# lifecycle ("OnInitComplete and lifecycle scripts can run before or in parallel with Slurm
# service startup", awslabs/awsome-distributed-ai 1.architectures/5.sagemaker-hyperpod/
# Extensions/detect-node/README.md), and a node failed for that would be replaced by one that
# fails the same way. Instead this step
#   1. writes the node's status file as PENDING (what passed here, plus the WARN lines);
#   2. installs sana-node-ready.service, a oneshot unit WantedBy= and After= this node's Slurm
#      daemon (slurmctld on the controller, slurmd elsewhere: HyperPod's login nodes run a
#      configless slurmd too, tools/devops-agent/docs/hyperpod-mental-model.md). systemd.unit(5):
#      WantedBy= makes starting the daemon start the unit as well, After= runs it once the
#      daemon's start job has finished. So the check runs whenever HyperPod starts the daemon,
#      now or in an hour, and again after every restart or reboot;
#   3. starts it now (--no-block) if the daemon is already up or starting: a start job queued
#      before the unit was enabled would not pull it in.
# Unlike the imds step's boot-time unit (a wants link is enough for the next boot), this one
# must take effect in the running systemd: `systemctl daemon-reload` ("reload all unit files,
# and recreate the entire dependency tree", systemctl(1)) and `systemctl enable`, for the
# platform's own unit only; no unit HyperPod owns is started, stopped or restarted.
# The unit runs slurm_ready.sh (copied to $STATE_DIR/lifecycle with the other scripts), which
# writes the final READY line.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
# shellcheck source=SCRIPTDIR/status.sh
source "$(dirname "${BASH_SOURCE[0]}")/status.sh"
step_init
require_vars FSX NODE_NAME NODE_ROLE NODE_GROUP NODE_IP CFG_PACKAGE_HASH LIFECYCLE_DIR

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
    check_env "${ENV_NEURON_DIR:?}" torch torch_xla torch_neuronx
    ;;
esac

UNIT=sana-node-ready.service
case $NODE_ROLE in
  controller) daemon=slurmctld ;;
  *) daemon=slurmd ;;
esac

# ready_warn CAUSE: a WARN line for this step (the late check may not run: say so in the file).
ready_warn() {
  log "WARNING: $*"
  printf 'ready\t%s\n' "$*" >>"$WARNINGS_FILE"
}

# What the late check needs: the scripts (node-local: FSx may be slow or remounting when the
# daemon starts), the settings and identity (already in $STATE_DIR) and what passed here.
install_late_check() {
  local incoming dest="$STATE_DIR/lifecycle"
  incoming=$(mktemp -d "$STATE_DIR/.lifecycle.XXXXXX")
  cp "$LIFECYCLE_DIR"/*.sh "$LIFECYCLE_DIR"/*.py "$incoming/"
  chmod 0755 "$incoming"
  rm -rf "$dest"
  mv -T "$incoming" "$dest"
  {
    printf 'READY_DETAILS=%q\n' "${details[*]}"
    printf 'SLURM_DAEMON=%q\n' "$daemon"
    # The clock the late check measures the wait for Slurm from.
    printf 'LIFECYCLE_DONE_AT=%q\n' "$(date +%s)"
  } | write_atomically "$STATE_DIR/ready.env" 0644
  local unit_dir="${PLATFORM_ROOT}/etc/systemd/system"
  mkdir -p "$unit_dir"
  # Paths in the unit are the node's, without the test prefix. TimeoutStartSec: a oneshot's
  # start job is bounded by DefaultTimeoutStartSec (90 s, systemd-system.conf(5)); the check
  # has its own bounds (LIFECYCLE_SLURM_WAIT_S, the slurmdbd and pyxis waits).
  cat <<UNITFILE | write_atomically "$unit_dir/$UNIT" 0644
# Written by the Sana platform lifecycle (lifecycle_scripts/readiness.sh).
[Unit]
Description=Sana platform: record this node READY once its Slurm daemon is up
After=$daemon.service

[Service]
Type=oneshot
ExecStart=/bin/bash ${dest#"$PLATFORM_ROOT"}/slurm_ready.sh
TimeoutStartSec=45min

[Install]
WantedBy=$daemon.service
UNITFILE
}

install_late_check
rm -f "$LATE_WARNINGS_FILE" # the late check of a previous boot; it runs again
record_node_status PENDING "${details[*]} slurm=waiting-for-$daemon"
out=""
if ! out=$(systemctl daemon-reload 2>&1 && systemctl enable "$UNIT" 2>&1); then
  ready_warn "cannot enable $UNIT ($(printf '%s' "$out" | tail -n 1)); READY will not be recorded: run \`bash $STATE_DIR/lifecycle/slurm_ready.sh\` as root once $daemon is up"
  record_node_status PENDING "${details[*]} slurm=waiting-for-$daemon"
fi
state=$(unit_state "$daemon" 2>/dev/null | head -n 1 || true)
case $state in
  active | activating | reloading)
    if out=$(systemctl start --no-block "$UNIT" 2>&1); then
      log "$daemon is ${state}: started $UNIT, which writes READY once $daemon is up"
    else
      ready_warn "$daemon is $state but \`systemctl start $UNIT\` failed ($(printf '%s' "$out" | tail -n 1))"
      record_node_status PENDING "${details[*]} slurm=waiting-for-$daemon"
    fi
    ;;
  *) log "$daemon is ${state:-not known here} (HyperPod starts it, not this script): $UNIT runs when it does" ;;
esac
log "status: $(head -n 1 "$(node_status_file)")"
