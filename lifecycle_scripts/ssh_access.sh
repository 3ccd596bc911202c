#!/usr/bin/env bash
# Step "ssh" (compute nodes: gpu, trn): a cluster user reaches a compute node over SSH only
# while one of their own jobs runs there, through Slurm's pam_slurm_adopt
# (https://slurm.schedmd.com/pam_slurm_adopt.html: it "prevent[s] users from sshing into nodes that
# they do not have a running job on" and adopts the session into the job's "extern" step, so
# the job's limits and cleanup cover it). Root and the AMI's own accounts (ubuntu, ssm-user) are
# not cluster users and are left alone; jobs themselves need no SSH (launch.sh starts every task
# with srun).
#
# /etc/pam.d/sshd gets one managed block at the end of its account stack:
#   account [success=1 default=ignore] pam_succeed_if.so quiet user notingroup <cluster group>
#   account required pam_slurm_adopt.so action_adopt_failure=deny
# (pam_succeed_if(8): "user notingroup" skips the next module for anyone outside the cluster
# group). The module's own defaults deny a user with no job (action_no_jobs=deny); adoption
# failure is denied too, not allowed as by default.
#
# What it needs from Slurm: PrologFlags=Contain, which creates the extern step a session is
# adopted into (pam_slurm_adopt.html, "Slurm Configuration"). HyperPod writes slurm.conf
# (SlurmConfigStrategy=Managed) and the API's SlurmConfig has no field for PrologFlags, so this
# step cannot set it (and never edits slurm.conf, see on_init_complete.sh): without Contain the
# module finds no extern step and denies every cluster user, i.e. fails closed; the step says so
# in a WARN line (checked once Slurm is up: ssh_prolog_check.sh) and `srun --jobid <id> --overlap --pty bash` remains the way onto a job's node.
# Where the AMI lacks pam_slurm_adopt.so (HyperPod's samples build it from Slurm's source,
# awslabs/awsome-distributed-ai 1.architectures/5.sagemaker-hyperpod/LifecycleScripts/base-config/
# utils/pam_adopt_cgroup_wheel.sh), cluster users are denied SSH to compute nodes altogether
# (pam_succeed_if alone), with a log line (a secure default, not a degraded part: the AMI does
# not ship the module, so a WARN on every node would drown real warnings): never more access
# than with the module.
# Re-running replaces the block; PAM reads its files at every login, so sshd is not restarted.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars CFG_CLUSTER_GROUP

PAM_SSHD=${PLATFORM_ROOT}/etc/pam.d/sshd
readonly BEGIN="# BEGIN sana-platform: compute-node SSH only for users with a job here (lifecycle_scripts/ssh_access.sh)"
readonly END="# END sana-platform"
MODULE_DIRS=(/opt/slurm/lib/security /opt/slurm/lib64/security /lib/security /lib/x86_64-linux-gnu/security
  /usr/lib/x86_64-linux-gnu/security /lib/aarch64-linux-gnu/security /usr/lib64/security)

[[ -f $PAM_SSHD ]] || die "no $PAM_SSHD on this node: sshd's PAM stack is missing, so SSH access cannot be limited"

module=""
for dir in "${MODULE_DIRS[@]}"; do
  if [[ -f ${PLATFORM_ROOT}$dir/pam_slurm_adopt.so ]]; then
    module=$dir/pam_slurm_adopt.so
    break
  fi
done

block=("$BEGIN" "account [success=1 default=ignore] pam_succeed_if.so quiet user notingroup $CFG_CLUSTER_GROUP")
if [[ -n $module ]]; then
  block+=("account required $module action_adopt_failure=deny")
else
  # No module: the line above then only lets non-members through; members are refused here.
  block=("$BEGIN" "account required pam_succeed_if.so quiet user notingroup $CFG_CLUSTER_GROUP")
  log "pam_slurm_adopt.so is not installed on this node (looked in ${MODULE_DIRS[*]}): cluster users cannot SSH to this compute node at all; srun --jobid <id> --overlap --pty bash reaches a job's node"
fi
block+=("$END")

# The file without our block, then the block at the end (the account stack's last word).
current=$(awk -v b="$BEGIN" -v e="$END" '$0 == b { skip = 1 } !skip { print } $0 == e { skip = 0 }' "$PAM_SSHD")
{
  printf '%s\n' "$current"
  printf '%s\n' "${block[@]}"
} | write_atomically "$PAM_SSHD" 0644

# Whether Slurm's PrologFlags carry Contain needs slurmctld, which may still be starting now:
# the late check (slurm_ready.sh, once this node's slurmd is up) runs ssh_prolog_check.sh.
mkdir -p "$STATE_DIR"
printf '%s\n' "$module" >"$STATE_DIR/ssh-module"
log "sshd account stack: ${module:-no pam_slurm_adopt; cluster users refused}${module:+ for members of $CFG_CLUSTER_GROUP}"
