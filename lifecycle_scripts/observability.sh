#!/usr/bin/env bash
# Step "observability" (optional: each part that does not come up is one WARN line in the node's
# status file; the node is never failed for it): the metric exporters of this node, its
# discovery file for the collector, and on the controller the collector itself, which
# remote-writes with SigV4 to the platform's Amazon Managed Service for Prometheus workspace
# (stacks/observability.py). runbooks/observability.md lists what each part publishes.
#
#   part            where            port                  what
#   node exporter   every node       <node ip>:9100        prometheus/node_exporter (CPU, memory, disks, /fsx usage)
#                                                          + a textfile of EFA and Lustre counters
#                                                          (node_counters.py, every 15 s: sana-node-counters.timer)
#   DCGM exporter   gpu nodes        <node ip>:9400        NVIDIA's dcgm-exporter image under docker
#                                                          (HyperPod's AMI runs Docker and NVIDIA's container toolkit),
#                                                          with HyperPod's Slurm job mapping (/run/slurm/dcgm-job-mapping)
#   neuron-monitor  trn nodes        :8000                 the AMI's neuron-monitor piped into its neuron-monitor-
#                                                          prometheus.py (aws-neuronx-tools; the script has no address
#                                                          option, so it listens on every address of the node)
#   Slurm exporter  controller       <node ip>:9341        sckyzo/slurm_exporter (sinfo/squeue)
#   collector       controller       127.0.0.1:9090        Prometheus in agent mode: scrapes the files below and the
#                                                          Slurm exporter, remote-writes (SigV4)
# Versions, archives and their sha256 are pinned in agent_releases.py (one table with the deploy
# host's build step, stacks/agent_releases.py). Every listener is on the node's cluster-subnet
# address (or loopback): the cluster security group admits only its own members
# (stacks/network.py), so nothing is reachable from beyond it.
#
# Where the agents come from:
#   public cluster   the release archives from GitHub, each checked against its sha256 (the
#                    recorded pin, else the release's own checksum file) and its binary against the
#                    pinned version; the DCGM exporter image from nvcr.io.
#   private cluster  (privateNetwork: no route to github.com or nvcr.io; nothing here tries them)
#                    the archives from the bundle `make wheelhouse` fetched on the deploy host and the
#                    cluster stack uploaded to s3://<lifecycle bucket>/<observability.agents.prefix>,
#                    through the S3 gateway endpoint, each checked against agents.lock, whose own
#                    sha256 the deployed package names; the DCGM exporter from this account's ECR
#                    (observability.dcgm_exporter_repository; `make mirror-dcgm-image` puts it there).
#                    A missing artefact is ONE warn line naming it and the fix.
#
# Discovery, on FSx (observability_config.py): this node writes <fsx>/observability/nodes/<node>.json
# (root's); training jobs write <fsx>/observability/targets/<job>-<node>-<port>.json
# (training/observability/prometheus.py) into a directory of the cluster group, sticky.
#
# Why release binaries and not the images AWS's observability sample pulls from HyperPod's ECR
# registry (awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/Extensions/
# observability/README.md: the execution role then needs ECR pull rights on an AWS account's
# registry, and the images' versions are opaque tags): pinned upstream versions, checked by sha256
# and by the version the binary reports, and no ECR permission on another account's registry.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars FSX NODE_ROLE NODE_NAME NODE_IP CFG_OBSERVABILITY CFG_CLUSTER_GID CFG_REGION CFG_CLUSTER_NAME

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
PINS=$HERE/agent_releases.py
PRIVATE=${CFG_PRIVATE_NETWORK:-false}
MAKE_FIX="run \`make wheelhouse\` on the deploy host (it fetches the agents with the wheels) and redeploy the cluster stack"

work=""
cleanup() { if [[ -n $work ]]; then rm -rf "$work"; fi; }
trap cleanup EXIT

# last_line TEXT: the last non-empty line (a tool's cause, for a one-line warning).
last_line() { printf '%s' "$1" | grep -v '^[[:space:]]*$' | tail -n 1; }

# agents_lock: private cluster only; fetches agents.lock of the bundle the package names, once, and
# checks it against the sha256 platform-settings.json gives. Returns 1 (one warn line, the first
# time) when the bundle cannot be used: every archive comes from it.
agents_lock_state=""
agents_lock() {
  local source out
  case $agents_lock_state in ok) return 0 ;; failed) return 1 ;; esac
  agents_lock_state=failed
  if [[ -z ${CFG_AGENTS_PREFIX:-} ]]; then
    warn "agent releases: platform-settings.json names no observability.agents bundle and a private cluster cannot reach github.com: $MAKE_FIX; no exporter or collector from this node"
    return 1
  fi
  source="s3://$CFG_LIFECYCLE_BUCKET/${CFG_AGENTS_PREFIX}agents.lock"
  if ! out=$(s3_download_object "$source" "$work/agents.lock" "$CFG_REGION" 2>&1); then
    warn "agent releases: cannot fetch $source ($(last_line "$out")): $MAKE_FIX; no exporter or collector from this node"
    return 1
  fi
  if ! out=$(python3 "$PINS" lock "$work/agents.lock" --lock-sha256 "$CFG_AGENTS_LOCK_SHA256" 2>&1); then
    warn "agent releases: ${out//$work\/agents.lock/$source}: $MAKE_FIX; no exporter or collector from this node"
    return 1
  fi
  agents_lock_state=ok
  log "agent releases: $source ($out)"
}

# read_pin NAME: sets version, url, checksums_url, asset, sha256 ("-": none recorded) and members
# (the archive paths of its binaries) from agent_releases.py. Returns 1 after one warn line.
read_pin() {
  local line spec
  if ! line=$(python3 "$PINS" spec "$1" 2>&1) || ! read -r -a spec <<<"$line" || ((${#spec[@]} < 6)); then
    warn "$1: no pinned release ($(last_line "$line"))"
    return 1
  fi
  version=${spec[0]} url=${spec[1]} checksums_url=${spec[2]} asset=${spec[3]} sha256=${spec[4]}
  members=("${spec[@]:5}")
}

# fetch_archive NAME: the pinned release archive of NAME (read_pin's values) at $archive, its sha256
# checked (private: against the agents lock; public: the recorded pin, else the release's checksum
# file). Returns 1 after one warn line.
fetch_archive() {
  local name=$1 source out check=()
  archive=$work/$asset
  if [[ $PRIVATE == true ]]; then
    agents_lock || return 1
    source="s3://$CFG_LIFECYCLE_BUCKET/$CFG_AGENTS_PREFIX$asset"
    if ! out=$(s3_download_object "$source" "$archive" "$CFG_REGION" 2>&1); then
      warn "$name $version: cannot fetch $source ($(last_line "$out")): $MAKE_FIX"
      return 1
    fi
    check=(--lock "$work/agents.lock" --lock-sha256 "$CFG_AGENTS_LOCK_SHA256")
  else
    source=$url
    if ! out=$(curl -fsSL --retry 5 --retry-delay 5 --connect-timeout 30 -o "$archive" "$url" 2>&1); then
      warn "$name $version: cannot download $url ($(last_line "$out"))"
      return 1
    fi
    if [[ $sha256 == - ]]; then
      # No sha256 recorded in the pins: the project's own checksum file of the same release.
      if ! out=$(curl -fsSL --retry 5 --retry-delay 5 --connect-timeout 30 -o "$work/$name.checksums" "$checksums_url" 2>&1); then
        warn "$name $version: cannot download the release's checksum file $checksums_url ($(last_line "$out")); not installed"
        return 1
      fi
      check=(--checksums "$work/$name.checksums")
    fi
  fi
  if ! out=$(python3 "$PINS" verify "$name" "$archive" "${check[@]}" 2>&1); then
    warn "$(last_line "$out") (from $source); not installed"
    return 1
  fi
  log "$out (from $source)"
}

# release_binary NAME: install the pinned release of NAME under $AGENT_DIR/bin (every binary the pins
# name), after its sha256 and the version its binary reports. Returns 1 (after a warn line) when any
# of that fails.
release_binary() {
  local name=$1 bin reported member version url checksums_url asset sha256 archive out members=()
  read_pin "$name" || return 1
  bin=$AGENT_DIR/bin/$name
  if [[ -x $bin ]] && "$bin" --version 2>&1 | grep -q "version $version "; then
    log "$name $version is installed"
    return 0
  fi
  fetch_archive "$name" || return 1
  mkdir -p "$work/$name"
  if ! out=$(tar -xzf "$archive" -C "$work/$name" "${members[@]}" 2>&1); then
    warn "$name $version: $asset does not hold ${members[*]} ($(last_line "$out"))"
    return 1
  fi
  reported=$("$work/$name/${members[0]}" --version 2>&1 | head -n 1 || true)
  if [[ $reported != *"version $version "* ]]; then
    warn "$name: $asset holds '${reported:-a binary that does not run here}', not version $version"
    return 1
  fi
  for member in "${members[@]}"; do install -D -m 0755 "$work/$name/$member" "$AGENT_DIR/bin/${member##*/}"; done
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

# pinned_version NAME: the version agent_releases.py pins.
pinned_version() { python3 "$PINS" spec "$1" | cut -d' ' -f1; }

node_exporter() {
  release_binary node_exporter || return 1
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
  unit node-exporter "node exporter $(pinned_version node_exporter)" \
    "/opt/sana-observability/bin/node_exporter --web.listen-address=$NODE_IP:$NODE_EXPORTER_PORT --collector.textfile.directory=/var/lib/sana-observability/textfile"
}

dcgm_exporter() {
  local out image password fix="" docker=(docker)
  if ! out=$(nvidia-smi --list-gpus 2>&1); then
    warn "DCGM exporter: the NVIDIA driver does not answer ($(printf '%s' "$out" | head -n 1)); no GPU metrics from this node"
    return 1
  fi
  if [[ $PRIVATE == true ]]; then
    # nvcr.io is out of reach: the mirror in this account's ECR, through the ECR endpoints, with a
    # login token kept in this run's own docker config (nothing stays in root's).
    if [[ -z ${CFG_DCGM_EXPORTER_REPOSITORY:-} ]]; then
      warn "DCGM exporter: platform-settings.json names no observability.dcgm_exporter_repository and a private cluster cannot reach nvcr.io: redeploy the cluster stack; no GPU metrics from this node"
      return 1
    fi
    image=$(python3 "$PINS" dcgm-image --registry "$CFG_IMAGE_REGISTRY" --repository "$CFG_DCGM_EXPORTER_REPOSITORY")
    fix=": a private cluster pulls it from this account's ECR only; copy it there from a machine that reaches nvcr.io (make mirror-dcgm-image REGISTRY=$CFG_IMAGE_REGISTRY)"
    docker=(docker --config "$work/docker")
    mkdir -m 0700 "$work/docker"
    if ! password=$(aws ecr get-login-password --region "$CFG_REGION" 2>"$work/ecr.err"); then
      warn "DCGM exporter: aws ecr get-login-password failed ($(last_line "$(cat "$work/ecr.err")")); no GPU metrics from this node"
      return 1
    fi
    if ! out=$(printf '%s' "$password" | "${docker[@]}" login --username AWS --password-stdin "$CFG_IMAGE_REGISTRY" 2>&1); then
      warn "DCGM exporter: docker login $CFG_IMAGE_REGISTRY failed ($(last_line "$out")); no GPU metrics from this node"
      return 1
    fi
  else
    image=$(python3 "$PINS" dcgm-image)
  fi
  if ! out=$("${docker[@]}" pull --quiet "$image" 2>&1); then
    warn "DCGM exporter: docker pull $image failed ($(last_line "$out"))$fix"
    return 1
  fi
  # HyperPod's AMI maps Slurm jobs to GPUs here (prolog.d/700_dcgm_job_map_register.sh, per the
  # sample's README): dcgm-exporter then labels each GPU's series with hpc_job.
  mkdir -p "${PLATFORM_ROOT}/run/slurm/dcgm-job-mapping"
  unit dcgm-exporter "DCGM exporter" \
    "/usr/bin/docker run --rm --name sana-dcgm-exporter --gpus all --cap-add SYS_ADMIN -p $NODE_IP:$DCGM_EXPORTER_PORT:9400 -v /run/slurm/dcgm-job-mapping:/run/slurm/dcgm-job-mapping:ro $image dcgm-exporter --hpc-job-mapping-dir /run/slurm/dcgm-job-mapping" \
    docker.service "-/usr/bin/docker rm -f sana-dcgm-exporter"
}

neuron_exporter() {
  local python=${ENV_NEURON_DIR:-}/bin/python
  if [[ ! -x $NEURON_TOOLS/neuron-monitor || ! -f $NEURON_TOOLS/neuron-monitor-prometheus.py ]]; then
    warn "neuron-monitor: /opt/aws/neuron/bin/neuron-monitor or neuron-monitor-prometheus.py is missing (aws-neuronx-tools, which the HyperPod Trainium AMI ships; nothing installs it from Neuron's apt repository, out of reach on a private cluster): use an AMI that has it; no NeuronCore metrics from this node"
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
  release_binary slurm_exporter || return 1
  unit slurm-exporter "Slurm exporter $(pinned_version slurm_exporter)" \
    "/usr/bin/env PATH=/opt/slurm/bin:/usr/bin:/bin /opt/sana-observability/bin/slurm_exporter --web.listen-address=$NODE_IP:$SLURM_EXPORTER_PORT"
}

collector() {
  local config=${PLATFORM_ROOT}/etc/sana-observability/collector.yml out
  if [[ -z ${CFG_REMOTE_WRITE_URL:-} ]]; then
    warn "collector: platform-settings.json names no workspace (remote_write_url); nothing leaves the cluster"
    return 1
  fi
  release_binary prometheus || return 1
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
  unit collector "collector (Prometheus $(pinned_version prometheus), agent mode)" \
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
work=$(mktemp -d "${PLATFORM_ROOT}/tmp/sana-observability.XXXXXX")
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
