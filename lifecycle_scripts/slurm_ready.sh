#!/usr/bin/env bash
# The late readiness check: sana-node-ready.service runs this once HyperPod has started this
# node's Slurm daemon (the ready step installs the unit WantedBy= and After= the daemon, and
# starts it at once when the daemon is already up; see readiness.sh). It is the only part of
# provisioning that depends on Slurm, so a daemon that comes up late makes a node READY late,
# never FAILED.
#
#   1. this node's part of Slurm is up (bounded by LIFECYCLE_SLURM_WAIT_S, default 300 s):
#      controller  slurmctld active (Extensions/observability/install_slurm_exporter.sh checks
#                  `systemctl is-active --quiet slurmctld`)
#      gpu, trn    slurmd active
#      login       the controller answers `scontrol ping` (a login node submits jobs)
#   2. the optional parts that need Slurm, each a WARN line when they do not work:
#      controller  accounts: the cluster group's account and one association per cluster user
#                  wherever accounting is configured (slurm_accounts.sh)
#      gpu/trn/login containers: pyxis is in the config this node's Slurm uses and srun loads it
#                  (container_check.sh); skipped with containerRuntime=false
#      gpu/trn     ssh: Slurm's PrologFlags carry Contain, which pam_slurm_adopt needs
#                  (ssh_prolog_check.sh)
#   3. the status file: READY (with slurm_wait=<s>: how long after the lifecycle finished
#      Slurm was up here), the lifecycle's WARN lines and this check's.
# Not up within the bound: the status stays PENDING with the cause, and the unit fails (systemd
# shows it); the next start of the daemon runs the check again.
#
# Logs to /var/log/provision/node-ready.log and stdout (the journal). Reads what the lifecycle
# wrote to $STATE_DIR: settings.env, node.env, ready.env.
set -euo pipefail
LIFECYCLE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LIFECYCLE_DIR PLATFORM_ROOT="${PLATFORM_ROOT:-}"
STEP_NAME=node-ready
# shellcheck source=SCRIPTDIR/common.sh
source "$LIFECYCLE_DIR/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$LIFECYCLE_DIR/system.sh"
# shellcheck source=SCRIPTDIR/status.sh
source "$LIFECYCLE_DIR/status.sh"
step_init

for env_file in settings.env node.env ready.env; do
  [[ -r $STATE_DIR/$env_file ]] \
    || die "no $STATE_DIR/$env_file: the lifecycle (on_init_complete.sh) has not finished on this node"
  # shellcheck source=/dev/null
  source "$STATE_DIR/$env_file"
done
require_vars FSX NODE_NAME NODE_ROLE SLURM_DAEMON LIFECYCLE_DONE_AT CFG_CONTAINER_RUNTIME

case $NODE_ROLE in
  controller) probe=(unit_state slurmctld) label=slurmctld what="slurmctld is not active on this node" ;;
  login) probe=(slurm_ping) label=slurmctld-reachable what="slurmctld does not answer from this login node" ;;
  *) probe=(unit_state slurmd) label=slurmd what="slurmd is not active on this node" ;;
esac

# run_part NAME SCRIPT: one optional check; what it warns about, or its failure, becomes a
# "<NAME>\t<cause>" line of the late WARN lines.
run_part() {
  local name=$1 script=$2 status=0 line
  local err warns
  err=$(mktemp "$STATE_DIR/.late-error.XXXXXX")
  warns=$(mktemp "$STATE_DIR/.late-warn.XXXXXX")
  STEP_NAME=$name STEP_ERROR_FILE=$err STEP_WARN_FILE=$warns bash "$LIFECYCLE_DIR/$script" || status=$?
  if ((status != 0)); then
    line=$(tr '\n' ' ' <"$err")
    printf '%s\n' "${line:-$script exited with status $status}" >>"$warns"
  fi
  while IFS= read -r line; do
    printf '%s\t%s\n' "$name" "${line% }" >>"$late_warnings"
  done <"$warns"
  rm -f "$err" "$warns"
}

main() {
  local wait_s=${LIFECYCLE_SLURM_WAIT_S:-300} poll_s=${LIFECYCLE_SLURM_POLL_S:-5}
  local deadline=$((SECONDS + wait_s)) out state remaining
  log "checking this node's part of Slurm ($label), up to ${wait_s}s"
  until out=$("${probe[@]}" 2>&1); do
    state=$(printf '%s\n' "$out" | head -n 1)
    remaining=$((deadline - SECONDS))
    if ((remaining <= 0)); then
      local cause="$what ${wait_s}s after $SLURM_DAEMON.service started (${state:-no answer}); HyperPod runs the daemon (the group's SlurmConfig): see \`journalctl -u $SLURM_DAEMON\`"
      record_node_status PENDING "${READY_DETAILS:-} slurm=waiting-for-$SLURM_DAEMON cause=$cause"
      log "PENDING: $cause"
      return 1
    fi
    log "waiting for Slurm (${state:-no answer}; ${remaining}s left)"
    sleep $((remaining < poll_s ? remaining : poll_s))
  done
  local waited=$(($(date +%s) - LIFECYCLE_DONE_AT))
  ((waited >= 0)) || waited=0
  log "Slurm is up here ($(printf '%s\n' "$out" | head -n 1)), ${waited}s after the lifecycle finished"

  late_warnings=$(mktemp "$STATE_DIR/.late-warnings.XXXXXX")
  case $NODE_ROLE in
    controller) run_part accounts slurm_accounts.sh ;;
    *)
      if [[ $CFG_CONTAINER_RUNTIME != true ]]; then
        log "containerRuntime=false: pyxis not checked"
      elif grep -q "^containers"$'\t' "$WARNINGS_FILE" 2>/dev/null; then
        log "the containers step warned during the lifecycle (status file): pyxis not checked again"
      else
        run_part containers container_check.sh
      fi
      if [[ $NODE_ROLE != login ]]; then run_part ssh ssh_prolog_check.sh; fi
      ;;
  esac
  mv -f "$late_warnings" "$LATE_WARNINGS_FILE"
  record_node_status READY "${READY_DETAILS:-} slurm=$label slurm_wait=${waited}s"
  local warned
  warned=$(cat "$WARNINGS_FILE" "$LATE_WARNINGS_FILE" 2>/dev/null | cut -f1 | sort -u | paste -sd, -)
  log "READY node=$NODE_NAME role=$NODE_ROLE, warnings: ${warned:-none}; status: $(head -n 1 "$(node_status_file)")"
}

mkdir -p "$PROVISION_LOG_DIR"
main "$@" 2>&1 | tee -a "$PROVISION_LOG_DIR/node-ready.log"
