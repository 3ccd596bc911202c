#!/usr/bin/env bash
# Late part "ssh" (gpu, trn; run by slurm_ready.sh once this node's slurmd is up): with
# pam_slurm_adopt in sshd's PAM stack (ssh_access.sh), a session is adopted into the job's
# extern step, which exists only with PrologFlags=Contain
# (https://slurm.schedmd.com/pam_slurm_adopt.html, "Slurm Configuration"). Without it the module
# refuses every cluster user (fails closed): a WARN line, never a failed node.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init

module=$(cat "$STATE_DIR/ssh-module" 2>/dev/null || true)
if [[ -z $module ]]; then
  log "no pam_slurm_adopt on this node (the ssh step warned): PrologFlags not checked"
  exit 0
fi
PATH="$PATH:/opt/slurm/bin"
config=$(scontrol show config 2>&1) || die "scontrol show config failed: ${config%%$'\n'*}"
flags=$(printf '%s\n' "$config" | awk -F'= *' '/^PrologFlags/ { print $2 }')
if [[ ,${flags// /}, != *,[Cc]ontain,* ]]; then
  warn "Slurm's PrologFlags (${flags:-unset}) lack Contain: pam_slurm_adopt finds no extern step and refuses every cluster user's SSH to this node (it fails closed); srun --jobid <id> --overlap --pty bash reaches a job's node"
else
  log "PrologFlags ${flags}: pam_slurm_adopt adopts SSH sessions into the user's job"
fi
