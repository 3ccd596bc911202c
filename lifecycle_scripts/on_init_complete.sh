#!/usr/bin/env bash
# HyperPod runs this on every node, as root, when the cluster is created and again on every
# replacement node: LifeCycleConfig.OnInitComplete, i.e. HyperPod's *Extended* lifecycle mode.
#
# What HyperPod has done before this script starts (Extended mode):
#   - "OnInitComplete: ... This script runs on the node after the AMI-based initialization is
#     complete" (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ClusterLifeCycleConfig.html).
#     The AWS::SageMaker::Cluster resource schema (ClusterLifeCycleConfig): "When provided with
#     SourceS3Uri and OnInitComplete, uses Extended mode" (OnCreate would be Customer Managed
#     mode, where the scripts must write slurm.conf and start Slurm themselves).
#   - The AMI-based initialization configures Slurm from the API (Orchestrator.Slurm and each
#     group's SlurmConfig; "API-driven Slurm configuration",
#     https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-ref.html) and sets up
#     Slurm and Docker: "HyperPod sets up Slurm and Docker automatically, then runs your
#     extension script" (awslabs/awsome-distributed-ai,
#     1.architectures/5.sagemaker-hyperpod/Extensions/observability/README.md, "Option A:
#     OnInitComplete"; the combined entry point there is Extensions/run_extensions.sh).
#   - It mounts FSx for Lustre from the group's InstanceStorageConfigs and writes
#     /opt/ml/config/resource_config.json (Extensions/detect-node/README.md: written "before
#     any lifecycle scripts run").
#
# So this script OWNS NOTHING OF SLURM's configuration from the API: no step writes slurm.conf,
# gres.conf or cgroup.conf, and none starts, stops or restarts slurmctld/slurmd/munge (HyperPod
# owns them and keeps slurm.conf in sync as groups scale, SlurmConfigStrategy=Managed). A Slurm
# setting we need goes through the API (the cluster stack's SlurmConfig). The one exception is
# the SPANK plugin list: the containers step registers pyxis in the controller's plugstack.conf
# (the API has no field for it; AWS's reference lifecycle does the same, see
# container_runtime.sh), from which configless nodes receive it.
#
# What makes a node unusable for training fails it: no FSx, no package, no env, a broken
# accelerator. What is optional degrades to a WARN line in the node's status file: the
# container runtime (step containers) and, on the controller, the accounting associations.
# What depends on Slurm's timing never runs here: the daemons may start before, during or
# after this script ("OnInitComplete and lifecycle scripts can run before or in parallel with
# Slurm service startup", Extensions/detect-node/README.md; "during scale-up ... slurmd may not
# be started yet", Extensions/observability/setup_observability.sh). The last step installs a
# oneshot unit, sana-node-ready.service, started by systemd after this node's Slurm daemon
# (WantedBy= + After=, systemd.unit(5)); it checks that part of Slurm, adds the accounting
# associations (controller), checks pyxis (container nodes) and writes the READY line.
#
# Steps (one small script per concern; see runbooks/node-boot.md):
#   all roles   settings -> identity -> imds -> fsx -> dirs -> users -> package -> sync -> profile -> ... -> ready
#               (imds: only root and system services reach the instance metadata service;
#               sync: sana-settings.timer applies the users of each rolled-out package here)
#   gpu         ... -> env-gpu (build /fsx/envs/gpu once per cluster) -> containers -> ready
#   trn         ... -> env-neuron (build /fsx/envs/neuron once per cluster) -> containers -> ready
#   login       ... -> env-gpu (only the base Python the GPU env links to) -> containers -> ready
#   gpu, trn    ... -> containers -> ssh (SSH only for users with a job on the node) -> ready
#   controller  ... -> containers (register pyxis for the configless nodes) -> ready
#   (containers: enroot + pyxis installed where missing and configured; optional: WARN, never FAILED)
#   all roles   ... -> containers -> observability (exporters; the controller's collector; optional: WARN)
#   later, after slurmd/slurmctld started: sana-node-ready.service (slurm_ready.sh) -> READY
#
# Every line goes to stdout (HyperPod ships it to CloudWatch) and to
# /var/log/provision/provisioning.log. A failure ends with ONE line
#   <time> [on_init_complete] FAILED step=<step>: <cause>
# and, after a bounded wait for the log shipping (below), a non-zero exit, which fails the
# node's creation (observability/README.md: "Cluster creation with OnInitComplete will fail
# if the script exits non-zero"). Safe to re-run: every step converges to the same state.
#
# Environment (tests set these; production leaves them unset):
#   PLATFORM_ROOT                   prefix for every root-filesystem path (empty on a node)
#   SAGEMAKER_RESOURCE_CONFIG_PATH  HyperPod's resource config (default /opt/ml/config/resource_config.json)
#   LIFECYCLE_FSX_WAIT_S            how long to wait for the FSx mount (default 300)
#   LIFECYCLE_ENV_LOCK_TIMEOUT_S    how long to wait for another node's env build (default 3600)
#   LIFECYCLE_MIN_PYTHON            oldest Python the envs may be built with (default 3.11)
#   LIFECYCLE_SLURM_WAIT_S          how long the late check waits for this node's Slurm part (default 300)
#   LIFECYCLE_NVME_WAIT_S           how long the containers step waits for dlami-nvme.service (default 120)
#   LIFECYCLE_ENROOT_RELEASE_URL    where the enroot .debs are downloaded from (default: NVIDIA's GitHub release)
#   LIFECYCLE_PYXIS_SOURCE_URL      the pyxis source tarball (default: NVIDIA's GitHub tag archive)
#   LIFECYCLE_PYXIS_PREFIX          where pyxis is installed and registered from (default /usr/local)
#   LIFECYCLE_PYXIS_WAIT_S          how long the late check waits for the controller's pyxis line (default 300)
#   LIFECYCLE_FAILURE_LOG_WAIT_S    seconds to wait after a failure so the log reaches CloudWatch (default 60)
#   LIFECYCLE_AGENT_RELEASES        a JSON file replacing the observability agents' pins (where their release
#                                   archives are and their sha256; default: agent_releases.py's, on GitHub)

# Started as `sh on_init_complete.sh`? Re-run under bash before anything bash-only.
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi
set -euo pipefail

LIFECYCLE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LIFECYCLE_DIR PLATFORM_ROOT="${PLATFORM_ROOT:-}"
# shellcheck source=SCRIPTDIR/common.sh
source "$LIFECYCLE_DIR/common.sh"

# run_step NAME SCRIPT [ARGS...]: run one step script (with bash: S3 keeps no execute bits);
# on failure print the one FAILED line, record it in the node status file, exit 1. What the
# step warns about (common.sh warn) is kept for the status file's WARN lines.
run_step() {
  run_step_script required "$@"
}

# run_optional_step NAME SCRIPT [ARGS...]: the same for a part the node works without: a
# failure becomes one WARN line (status file, log) and the next step runs.
run_optional_step() {
  run_step_script optional "$@"
}

# run_step_script required|optional NAME SCRIPT [ARGS...]: both of the above.
run_step_script() {
  local kind=$1 name=$2 script=$3 started=$SECONDS status=0
  shift 3
  local error_file="$STATE_DIR/step-error" output_file="$STATE_DIR/step-output" warn_file="$STATE_DIR/step-warnings"
  : >"$error_file"
  : >"$warn_file"
  log "step $name: start"
  STEP_NAME=$name STEP_ERROR_FILE=$error_file STEP_WARN_FILE=$warn_file bash "$LIFECYCLE_DIR/$script" "$@" 2>&1 \
    | tee "$output_file" || status=$?
  local cause
  if ((status != 0)); then
    local last_output
    cause=$(tr '\n' ' ' <"$error_file")
    if [[ -z $cause || $cause == "command failed"* ]]; then
      # Not a failure the step anticipated: add what the command itself said last.
      last_output=$(grep -Ev '^[0-9]{4}-[0-9-]+T[0-9:]+Z \[' "$output_file" | tail -n 1 || true)
      cause="${cause:-exited with status $status}${last_output:+ -> $last_output}"
    fi
    [[ $kind == optional ]] || fail "$name" "$cause"
    printf '%s\n' "${cause% }" >>"$warn_file"
  fi
  while IFS= read -r cause; do
    printf '%s\t%s\n' "$name" "$cause" >>"$WARNINGS_FILE"
  done <"$warn_file"
  if ((status != 0)); then
    log "WARN step=$name: $(tail -n 1 "$warn_file") (optional: the node goes on without it)"
  else
    log "step $name: done in $((SECONDS - started))s"
  fi
}

# fail STEP CAUSE: the node status file on FSx (once it is usable), the one FAILED line, then
# a bounded wait before exiting non-zero. HyperPod ships this script's output to CloudWatch
# asynchronously and a failed node is torn down; its own sample entry point syncs and sleeps
# 60 s "to make sure logs are uploaded" before exiting with an error (awslabs/awsome-distributed-ai,
# 1.architectures/5.sagemaker-hyperpod/Extensions/run_extensions.sh, run_feature). The wait
# prints nothing, so the FAILED line stays the last line of the log.
fail() {
  local step=$1 cause=${2% }
  if [[ -n ${FSX:-} && -n ${NODE_NAME:-} && -d $FSX/logs/provision ]]; then
    # In a subshell: write_node_status's own refusal (a link or a user-writable directory in
    # the way, e.g. before the dirs step fixed an old layout) must not replace this failure.
    (write_node_status "$(printf '%s FAILED node=%s group=%s role=%s ip=%s step=%s cause=%s\n' \
      "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$NODE_NAME" "${NODE_GROUP:-}" "${NODE_ROLE:-}" \
      "${NODE_IP:-}" "$step" "$cause")") >/dev/null 2>&1 || true
  fi
  log "FAILED step=$step: $cause"
  local wait_s=${LIFECYCLE_FAILURE_LOG_WAIT_S:-60}
  [[ $wait_s =~ ^[0-9]+$ ]] || wait_s=60
  sync || true
  sleep "$wait_s"
  exit 1
}

# load ENV_FILE: the variables a step worked out (quoted with shlex.quote by the step).
load() {
  # shellcheck source=/dev/null
  source "$1"
}

main() {
  local started=$SECONDS
  log "provisioning node from $LIFECYCLE_DIR (PLATFORM_ROOT='${PLATFORM_ROOT}')"
  : >"$WARNINGS_FILE"
  run_step settings settings.sh
  load "$STATE_DIR/settings.env"
  run_step identity node_identity.sh
  load "$STATE_DIR/node.env"
  # First thing after knowing the node: from here on only root reaches the node's credentials.
  run_step imds imds_block.sh
  run_step fsx fsx_mount.sh
  run_step dirs shared_dirs.sh
  run_step users cluster_users.sh
  run_step package install_package.sh
  run_step sync settings_timer.sh
  run_step profile node_profile.sh
  case $NODE_ROLE in
    gpu) run_step env-gpu python_env.sh gpu build ;;
    trn) run_step env-neuron python_env.sh neuron build ;;
    # Researchers run the package's entrypoints on the login node with the GPU env.
    login) run_step env-gpu python_env.sh gpu use ;;
  esac
  # Container jobs (srun --container-image) start on workers and are submitted from the login
  # node; the controller registers pyxis for them (configless nodes get plugstack.conf from it).
  run_optional_step containers container_runtime.sh
  # Metrics: exporters on every node, the collector on the controller (optional: WARN lines).
  run_optional_step observability observability.sh
  # Compute nodes: SSH only for users with a job there (pam_slurm_adopt).
  case $NODE_ROLE in
    gpu | trn) run_step ssh ssh_access.sh ;;
  esac
  run_step ready readiness.sh
  local warnings
  warnings=$(cut -f1 "$WARNINGS_FILE" | sort -u | paste -sd, -)
  log "DONE node=$NODE_NAME role=$NODE_ROLE in $((SECONDS - started))s, warnings: ${warnings:-none}; sana-node-ready.service writes READY once Slurm is up here"
}

mkdir -p "$PROVISION_LOG_DIR" "$STATE_DIR"
main "$@" 2>&1 | tee -a "$PROVISION_LOG"
