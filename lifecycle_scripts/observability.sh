#!/usr/bin/env bash
# Step "observability" (optional: each part that does not come up is one WARN line in the node's
# status file; the node is never failed for it): the metric exporters of this node, its
# discovery file for the collector, and on the controller the collector itself, which
# remote-writes with SigV4 to the platform's Amazon Managed Service for Prometheus workspace
# (stacks/observability.py). runbooks/observability.md lists what each part publishes.
#
#   part            where            port                  what
#   node exporter   every node       <node ip>:9100        prometheus/node_exporter NODE_EXPORTER_VERSION (CPU, memory,
#                                                          disks, /fsx usage) + a textfile of EFA and Lustre counters
#                                                          (node_counters.py, every 15 s: sana-node-counters.timer)
#   DCGM exporter   gpu nodes        <node ip>:9400        NVIDIA's dcgm-exporter image DCGM_EXPORTER_IMAGE under docker
#                                                          (HyperPod's AMI runs Docker and NVIDIA's container toolkit),
#                                                          with HyperPod's Slurm job mapping (/run/slurm/dcgm-job-mapping)
#   neuron-monitor  trn nodes        :8000                 the AMI's neuron-monitor piped into its neuron-monitor-
#                                                          prometheus.py (aws-neuronx-tools; the script has no address
#                                                          option, so it listens on every address of the node)
#   Slurm exporter  controller       <node ip>:9341        sckyzo/slurm_exporter SLURM_EXPORTER_VERSION (sinfo/squeue)
#   collector       controller       127.0.0.1:9090        Prometheus PROMETHEUS_VERSION in agent mode: scrapes the
#                                                          files below and the Slurm exporter, remote-writes (SigV4)
# Every listener is on the node's cluster-subnet address (or loopback): the cluster security
# group admits only its own members (stacks/network.py), so nothing is reachable from beyond it.
#
# Discovery, on FSx (observability_config.py): this node writes <fsx>/observability/nodes/<node>.json
# (root's); training jobs write <fsx>/observability/targets/<job>-<node>-<port>.json
# (training/observability/prometheus.py) into a directory of the cluster group, sticky.
#
# Why release binaries and not the images AWS's observability sample pulls from HyperPod's ECR
# registry (awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/Extensions/
# observability/README.md: the execution role then needs ECR pull rights on an AWS account's
# registry, and the images' versions are opaque tags): pinned upstream versions, checked after
# download (the binary must report the pinned version), and no ECR permission on the nodes' role.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX NODE_ROLE NODE_NAME NODE_IP CFG_OBSERVABILITY CFG_CLUSTER_GID CFG_REGION CFG_CLUSTER_NAME

NODE_EXPORTER_VERSION=1.9.1
PROMETHEUS_VERSION=2.53.4
SLURM_EXPORTER_VERSION=1.6.1
DCGM_EXPORTER_IMAGE=nvcr.io/nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04
NODE_EXPORTER_PORT=9100
DCGM_EXPORTER_PORT=9400
NEURON_EXPORTER_PORT=8000
SLURM_EXPORTER_PORT=9341
COLLECTOR_ADDRESS=127.0.0.1:9090

AGENT_DIR=${PLATFORM_ROOT}/opt/sana-observability
STATE=${PLATFORM_ROOT}/var/lib/sana-observability
UNITS=${PLATFORM_ROOT}/etc/systemd/system
NEURON_TOOLS=${PLATFORM_ROOT}/opt/aws/neuron/bin
HERE=$(dirname "${BASH_SOURCE[0]}")

work=""
cleanup() { if [[ -n $work ]]; then rm -rf "$work"; fi; }
trap cleanup EXIT

# release_binary NAME VERSION URL [EXTRA...]: download a release tarball, check its binary reports
# VERSION, install it (and the archive's EXTRA binaries) under $AGENT_DIR/bin. Returns 1 (after a
# warn line) when any of that fails.
release_binary() {
  local name=$1 version=$2 url=$3 bin reported extra
  shift 3
  bin=$AGENT_DIR/bin/$name
  if [[ -x $bin ]] && "$bin" --version 2>&1 | grep -q "version $version "; then
    log "$name $version is installed"
    return 0
  fi
  [[ -n $work ]] || work=$(mktemp -d "${PLATFORM_ROOT}/tmp/sana-observability.XXXXXX")
  if ! curl -fsSL --retry 5 --retry-delay 5 --connect-timeout 30 -o "$work/$name.tar.gz" "$url" 2>"$work/curl.err"; then
    warn "$name $version: cannot download $url ($(tail -n 1 "$work/curl.err"))"
    return 1
  fi
  mkdir -p "$work/$name"
  if ! tar -xzf "$work/$name.tar.gz" -C "$work/$name" --strip-components=1 2>/dev/null || [[ ! -f $work/$name/$name ]]; then
    warn "$name $version: $url is not a release archive holding $name"
    return 1
  fi
  reported=$("$work/$name/$name" --version 2>&1 | head -n 1 || true)
  if [[ $reported != *"version $version "* ]]; then
    warn "$name: $url holds '${reported:-a binary that does not run here}', not version $version"
    return 1
  fi
  install -D -m 0755 "$work/$name/$name" "$bin"
  for extra; do install -D -m 0755 "$work/$name/$extra" "$AGENT_DIR/bin/$extra"; done
  log "$name $version installed ($reported)"
}

# unit NAME DESCRIPTION EXECSTART [AFTER] [EXECSTARTPRE]: write sana-NAME.service (Type=exec: a
# start fails when the program cannot be executed), enable it and (re)start it. Returns 1 after a
# warn line.
unit() {
  local name=$1 description=$2 exec_start=$3 after=${4:-network-online.target} pre=${5:-} path out
  path=$UNITS/sana-$name.service
  printf '%s\n' "[Unit]" "Description=$description (Sana platform observability)" \
    "Wants=network-online.target" "After=$after" "" "[Service]" "Type=exec" \
    ${pre:+"ExecStartPre=$pre"} "ExecStart=$exec_start" \
    "Restart=always" "RestartSec=10" "" "[Install]" "WantedBy=multi-user.target" | write_atomically "$path" 0644 \
    || { warn "$description: cannot write $path"; return 1; }
  if ! out=$(systemctl daemon-reload 2>&1 && systemctl enable "sana-$name.service" 2>&1 \
    && systemctl restart "sana-$name.service" 2>&1); then
    warn "$description: sana-$name.service did not start ($(printf '%s' "$out" | tail -n 1))"
    return 1
  fi
  log "$description: sana-$name.service running"
}

node_exporter() {
  local arch
  arch=$(dpkg --print-architecture)
  release_binary node_exporter "$NODE_EXPORTER_VERSION" \
    "${LIFECYCLE_NODE_EXPORTER_URL:-https://github.com/prometheus/node_exporter/releases/download/v$NODE_EXPORTER_VERSION}/node_exporter-$NODE_EXPORTER_VERSION.linux-$arch.tar.gz" \
    || return 1
  # (called as `if node_exporter`: errexit is off in here, so every command is checked)
  if ! { mkdir -p "$STATE/textfile" && install -D -m 0755 "$HERE/node_counters.py" "$AGENT_DIR/bin/node_counters.py" \
    && python3 "$AGENT_DIR/bin/node_counters.py" --out "$STATE/textfile/sana-node-counters.prom" --root "${PLATFORM_ROOT:-/}" \
    && printf '%s\n' "[Unit]" "Description=EFA and Lustre counters for the node exporter (Sana platform observability)" \
      "" "[Service]" "Type=oneshot" \
      "ExecStart=/usr/bin/python3 /opt/sana-observability/bin/node_counters.py --out /var/lib/sana-observability/textfile/sana-node-counters.prom" \
      | write_atomically "$UNITS/sana-node-counters.service" 0644 \
    && printf '%s\n' "[Unit]" "Description=EFA and Lustre counters every 15 s" "" "[Timer]" "OnBootSec=15s" \
      "OnUnitActiveSec=15s" "AccuracySec=1s" "" "[Install]" "WantedBy=timers.target" \
      | write_atomically "$UNITS/sana-node-counters.timer" 0644 \
    && systemctl enable sana-node-counters.timer >/dev/null 2>&1; }; then
    warn "node counters: the EFA and Lustre textfile (sana-node-counters.timer) is not set up; those counters are missing"
  fi
  unit node-exporter "node exporter $NODE_EXPORTER_VERSION" \
    "/opt/sana-observability/bin/node_exporter --web.listen-address=$NODE_IP:$NODE_EXPORTER_PORT --collector.textfile.directory=/var/lib/sana-observability/textfile"
}

dcgm_exporter() {
  local out
  if ! out=$(nvidia-smi --list-gpus 2>&1); then
    warn "DCGM exporter: the NVIDIA driver does not answer ($(printf '%s' "$out" | head -n 1)); no GPU metrics from this node"
    return 1
  fi
  if ! out=$(docker pull --quiet "$DCGM_EXPORTER_IMAGE" 2>&1); then
    warn "DCGM exporter: docker pull $DCGM_EXPORTER_IMAGE failed ($(printf '%s' "$out" | tail -n 1))"
    return 1
  fi
  # HyperPod's AMI maps Slurm jobs to GPUs here (prolog.d/700_dcgm_job_map_register.sh, per the
  # sample's README): dcgm-exporter then labels each GPU's series with hpc_job.
  mkdir -p "${PLATFORM_ROOT}/run/slurm/dcgm-job-mapping"
  unit dcgm-exporter "DCGM exporter" \
    "/usr/bin/docker run --rm --name sana-dcgm-exporter --gpus all --cap-add SYS_ADMIN -p $NODE_IP:$DCGM_EXPORTER_PORT:9400 -v /run/slurm/dcgm-job-mapping:/run/slurm/dcgm-job-mapping:ro $DCGM_EXPORTER_IMAGE dcgm-exporter --hpc-job-mapping-dir /run/slurm/dcgm-job-mapping" \
    docker.service "-/usr/bin/docker rm -f sana-dcgm-exporter"
}

neuron_exporter() {
  local python=${ENV_NEURON_DIR:-}/bin/python
  if [[ ! -x $NEURON_TOOLS/neuron-monitor || ! -f $NEURON_TOOLS/neuron-monitor-prometheus.py ]]; then
    warn "neuron-monitor: /opt/aws/neuron/bin/neuron-monitor or neuron-monitor-prometheus.py is missing (aws-neuronx-tools); no NeuronCore metrics from this node"
    return 1
  fi
  # The Neuron env has prometheus-client, which the script imports (training/requirements-neuron.txt).
  if [[ ! -x $python ]] || ! "$python" -c "import prometheus_client" >/dev/null 2>&1; then
    warn "neuron-monitor: ${python} cannot import prometheus_client; no NeuronCore metrics from this node"
    return 1
  fi
  unit neuron-monitor "neuron-monitor" \
    "/bin/bash -o pipefail -c '/opt/aws/neuron/bin/neuron-monitor | ${python#"$PLATFORM_ROOT"} /opt/aws/neuron/bin/neuron-monitor-prometheus.py --port $NEURON_EXPORTER_PORT'"
}

slurm_exporter() {
  local arch
  arch=$(dpkg --print-architecture)
  release_binary slurm_exporter "$SLURM_EXPORTER_VERSION" \
    "${LIFECYCLE_SLURM_EXPORTER_URL:-https://github.com/sckyzo/slurm_exporter/releases/download/v$SLURM_EXPORTER_VERSION}/slurm_exporter-$SLURM_EXPORTER_VERSION.linux-$arch.tar.gz" \
    || return 1
  unit slurm-exporter "Slurm exporter $SLURM_EXPORTER_VERSION" \
    "/usr/bin/env PATH=/opt/slurm/bin:/usr/bin:/bin /opt/sana-observability/bin/slurm_exporter --web.listen-address=$NODE_IP:$SLURM_EXPORTER_PORT"
}

collector() {
  local arch config=${PLATFORM_ROOT}/etc/sana-observability/collector.yml out
  if [[ -z ${CFG_REMOTE_WRITE_URL:-} ]]; then
    warn "collector: platform-settings.json names no workspace (remote_write_url); nothing leaves the cluster"
    return 1
  fi
  arch=$(dpkg --print-architecture)
  release_binary prometheus "$PROMETHEUS_VERSION" \
    "${LIFECYCLE_PROMETHEUS_URL:-https://github.com/prometheus/prometheus/releases/download/v$PROMETHEUS_VERSION}/prometheus-$PROMETHEUS_VERSION.linux-$arch.tar.gz" \
    promtool || return 1
  mkdir -p "$(dirname "$config")" "$STATE/agent"
  # Paths inside the config are the node's, without the test prefix.
  if ! out=$(python3 "$HERE/observability_config.py" collector --fsx "${FSX#"$PLATFORM_ROOT"}" \
    --remote-write "$CFG_REMOTE_WRITE_URL" --region "$CFG_REGION" --cluster "$CFG_CLUSTER_NAME" \
    --slurm-exporter "$NODE_IP:$SLURM_EXPORTER_PORT" 2>&1); then
    warn "collector: cannot write its configuration ($out)"
    return 1
  fi
  printf '%s\n' "$out" | write_atomically "$config" 0644
  if ! out=$("$AGENT_DIR/bin/promtool" check config "$config" 2>&1); then
    warn "collector: promtool refuses $config ($(printf '%s' "$out" | grep -v '^ *$' | tail -n 1))"
    return 1
  fi
  # The workspace takes SigV4 from the node's execution role (instance metadata, root only:
  # imds_block.sh); the agent runs as root for that reason.
  unit collector "collector (Prometheus $PROMETHEUS_VERSION, agent mode)" \
    "/opt/sana-observability/bin/prometheus --enable-feature=agent --config.file=/etc/sana-observability/collector.yml --storage.agent.path=/var/lib/sana-observability/agent --web.listen-address=$COLLECTOR_ADDRESS"
}

# register EXPORTER=PORT...: this node's discovery file, root's, in a root-only directory.
register() {
  local out
  out=$(python3 "$HERE/observability_config.py" node-targets --node "$(hostname -s)" --role "$NODE_ROLE" \
    --address "$NODE_IP" "${@/#/--exporter=}") || { warn "discovery: cannot describe this node's exporters ($out)"; return 1; }
  printf '%s\n' "$out" | safe_fs write "$FSX" 0644 "observability/nodes/$NODE_NAME.json"
  log "discovery: $FSX/observability/nodes/$NODE_NAME.json lists $*"
}

if [[ $CFG_OBSERVABILITY != true ]]; then
  log "observability=false: no exporters, no collector"
  exit 0
fi
mkdir -p "${PLATFORM_ROOT}/tmp" "$UNITS"
safe_fs dir "$FSX" 0:0 0755 observability observability/nodes
# Jobs (cluster users, primary group the cluster group) write their own files; sticky: nobody
# removes another's.
safe_fs dir "$FSX" "0:$CFG_CLUSTER_GID" 1775 observability/targets
started=()
if node_exporter; then started+=("node=$NODE_EXPORTER_PORT"); fi
case $NODE_ROLE in
  gpu) if dcgm_exporter; then started+=("dcgm=$DCGM_EXPORTER_PORT"); fi ;;
  trn) if neuron_exporter; then started+=("neuron=$NEURON_EXPORTER_PORT"); fi ;;
  controller)
    slurm_exporter || true
    collector || true
    ;;
esac
if ((${#started[@]})); then register "${started[@]}"; fi
