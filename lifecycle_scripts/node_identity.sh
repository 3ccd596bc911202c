#!/usr/bin/env bash
# Step "identity": which node am I? HyperPod's resource config lists every instance
# group with its instances' CustomerIpAddress; this node finds itself by its own
# addresses, and the settings' `groups` map turns its group into a role
# (controller | login | gpu | trn). Result: $STATE_DIR/node.env.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars CFG_GROUPS_JSON

resource_config="${SAGEMAKER_RESOURCE_CONFIG_PATH:-${PLATFORM_ROOT}/opt/ml/config/resource_config.json}"
addresses=$(node_addresses) || die "cannot list this node's IP addresses (hostname -I failed)"
log "addresses: ${addresses:-none}; resource config: $resource_config"

if ! result=$(python3 - "$resource_config" "$CFG_GROUPS_JSON" "$addresses" <<'PY'
import json, re, shlex, sys

path, groups_json, addresses = sys.argv[1], sys.argv[2], sys.argv[3].split()
roles = json.loads(groups_json)

def fail(msg):
    print(msg)
    sys.exit(1)

try:
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
except OSError as e:
    fail(f"cannot read the HyperPod resource config {path} ({e.strerror})")
except ValueError as e:
    fail(f"the HyperPod resource config {path} is not valid JSON ({e})")
groups = config.get("InstanceGroups") if isinstance(config, dict) else None
if not isinstance(groups, list):
    fail(f"the HyperPod resource config {path} has no InstanceGroups list")

for group in groups:
    for instance in group.get("Instances") or []:
        ip = instance.get("CustomerIpAddress")
        if ip not in addresses:
            continue
        name = str(group.get("Name", ""))
        if name not in roles:
            fail(f"instance group '{name}' has no role in platform-settings.json groups "
                 f"(known: {', '.join(sorted(roles)) or 'none'}); the stack and the cluster disagree")
        instance_name = str(instance.get("InstanceName") or ip)
        # The instance name becomes a file name on FSx (the status file).
        instance_name = re.sub(r"[^A-Za-z0-9._-]", "_", instance_name).lstrip(".") or ip
        for key, value in (("NODE_GROUP", name), ("NODE_ROLE", roles[name]),
                           ("NODE_NAME", instance_name), ("NODE_IP", ip)):
            print(f"export {key}={shlex.quote(value)}")
        sys.exit(0)

known = sorted(str(i.get("CustomerIpAddress")) for g in groups for i in g.get("Instances") or [])
fail(f"none of this node's addresses ({' '.join(addresses) or 'none'}) is a CustomerIpAddress "
     f"in {path} (it lists {len(known)}: {' '.join(known[:8])}{' ...' if len(known) > 8 else ''})")
PY
); then
  die "$result"
fi

mkdir -p "$STATE_DIR"
printf '%s\n' "$result" | write_atomically "$STATE_DIR/node.env" 0644
# shellcheck source=/dev/null
source "$STATE_DIR/node.env"
log "this node is $NODE_NAME ($NODE_IP) in group $NODE_GROUP: role $NODE_ROLE"
