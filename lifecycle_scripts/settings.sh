#!/usr/bin/env bash
# Step "settings": read platform-settings.json (written by the cluster stack next to
# on_create.sh) and validate it once, into $STATE_DIR/settings.env for the other steps.
#
# JSON is parsed with the AMI's python3 (present on every HyperPod AMI; jq is not), and
# written out with shlex.quote, so the file is safe to source whatever the values hold.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init

settings_file="${LIFECYCLE_DIR:?}/platform-settings.json"
out="$STATE_DIR/settings.env"
log "reading $settings_file"

if ! result=$(python3 - "$settings_file" "$PLATFORM_ROOT" <<'PY'
import json, re, shlex, sys

path, root = sys.argv[1], sys.argv[2]
ROLES = {"controller", "login", "gpu", "trn"}

def fail(msg):
    print(f"{path}: {msg}; the cluster stack writes this file (redeploy the stack to regenerate it)")
    sys.exit(1)

try:
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
except OSError as e:
    fail(f"cannot read it ({e.strerror})")
except ValueError as e:
    fail(f"not valid JSON ({e})")
if not isinstance(s, dict):
    fail("top level is not an object")

def get(key, kind=str):
    if key not in s:
        fail(f"key '{key}' is missing")
    value = s[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        fail(f"key '{key}' must be a {kind.__name__}, got {value!r}")
    if "\n" in str(value):
        fail(f"key '{key}' must be one line")
    return value

def abspath(key, value):
    if not value.startswith("/") or "/../" in value + "/":
        fail(f"key '{key}' must be an absolute path, got {value!r}")
    return value.rstrip("/") or "/"

groups = get("groups", dict)
for name, role in groups.items():
    if role not in ROLES:
        fail(f"groups['{name}'] = {role!r} is not one of {sorted(ROLES)}")
envs = get("envs", dict)
for kind in ("gpu", "neuron"):
    if not isinstance(envs.get(kind), str):
        fail(f"key 'envs.{kind}' is missing")
package_hash = get("package_hash")
if not re.fullmatch(r"[A-Za-z0-9._-]+", package_hash) or package_hash.startswith("."):
    fail(f"key 'package_hash' must be a plain directory name, got {package_hash!r}")
region = get("region")
if not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-[0-9]+", region):
    fail(f"key 'region' is not an AWS region name, got {region!r}")
port = get("rendezvous_port", int)
if not 1 <= port <= 65535:
    fail(f"key 'rendezvous_port' must be a TCP port, got {port}")
fsx_mount = abspath("fsx_mount", get("fsx_mount"))
env_gpu = abspath("envs.gpu", envs["gpu"])
env_neuron = abspath("envs.neuron", envs["neuron"])

values = {
    "CFG_PROJECT": get("project"),
    "CFG_CLUSTER_NAME": get("cluster_name"),
    "CFG_REGION": region,
    "CFG_DATA_BUCKET": get("data_bucket"),
    "CFG_ARTEFACTS_BUCKET": get("artefacts_bucket"),
    "CFG_PACKAGE_HASH": package_hash,
    "CFG_NEURON_PIP_INDEX": get("neuron_pip_index"),
    "CFG_RDZV_PORT": str(port),
    "CFG_FSX_MOUNT": fsx_mount,
    "CFG_GROUPS_JSON": json.dumps(groups, sort_keys=True),
    # Paths as this node sees them (PLATFORM_ROOT + the cluster path).
    "FSX": root + fsx_mount,
    "ENV_GPU_DIR": root + env_gpu,
    "ENV_NEURON_DIR": root + env_neuron,
}
for key, value in values.items():
    print(f"export {key}={shlex.quote(value)}")
PY
); then
  die "$result"
fi

mkdir -p "$STATE_DIR"
printf '%s\n' "$result" | write_atomically "$out" 0644
# shellcheck source=/dev/null
source "$out"
log "project=$CFG_PROJECT cluster=$CFG_CLUSTER_NAME package=$CFG_PACKAGE_HASH fsx=$CFG_FSX_MOUNT"
