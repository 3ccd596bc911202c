#!/usr/bin/env bash
# Step "settings": read platform-settings.json (written by the cluster stack next to
# on_init_complete.sh) and validate it once, into $STATE_DIR/settings.env for the other steps.
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

# Cluster users (cdk context clusterUsers / clusterGroup; the stack validates them at synth,
# this is the node's own check before useradd sees them). Names: what Debian's useradd
# accepts by default (NAME_REGEX, useradd(8)), at most 32 characters. IDs: regular accounts
# (login.defs(5) UID_MAX 60000; 60000-65535 are reserved, 65534 is nobody) from 2000: below
# are the node's own (ubuntu at 1000, ssm-user, which the SSM agent creates with the next
# free id; stacks/config.py POSIX_ID_MIN says why and cites the sources).
NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")

def posix_id(key, value):
    if not isinstance(value, int) or isinstance(value, bool) or not 2000 <= value <= 59999:
        fail(f"key '{key}' must be an integer in 2000..59999 (regular accounts above the node's own), got {value!r}")
    return value

def posix_name(key, value):
    if not isinstance(value, str) or not NAME.fullmatch(value):
        fail(f"key '{key}' must be a POSIX user/group name ([a-z_][a-z0-9_-]*, at most 32), got {value!r}")
    return value

group = get("cluster_group", dict)
group_name = posix_name("cluster_group.name", group.get("name"))
group_gid = posix_id("cluster_group.gid", group.get("gid"))
users = s.get("cluster_users")
if not isinstance(users, list) or not users:
    fail(f"key 'cluster_users' must be a non-empty list of {{name, uid}}, got {users!r}")
seen_names, seen_uids, user_specs = set(), set(), []
for i, user in enumerate(users):
    if not isinstance(user, dict):
        fail(f"cluster_users[{i}] must be an object {{name, uid}}, got {user!r}")
    name = posix_name(f"cluster_users[{i}].name", user.get("name"))
    uid = posix_id(f"cluster_users[{i}].uid", user.get("uid"))
    if name in seen_names:
        fail(f"cluster_users[{i}]: user name '{name}' appears twice")
    if uid in seen_uids:
        fail(f"cluster_users[{i}]: UID {uid} appears twice")
    seen_names.add(name)
    seen_uids.add(uid)
    user_specs.append(f"{name}:{uid}")
# Admins (cdk context clusterAdmins / clusterAdminGroup): cluster users who may sudo, as members
# of a group of their own (cluster_users.sh writes its sudoers entry).
admin_group = get("admin_group", dict)
admin_group_name = posix_name("admin_group.name", admin_group.get("name"))
admin_gid = posix_id("admin_group.gid", admin_group.get("gid"))
if admin_gid == group_gid or admin_group_name == group_name:
    fail("key 'admin_group' must differ from cluster_group in name and gid")
if admin_gid in seen_uids or admin_group_name in seen_names:
    fail(f"key 'admin_group' ({admin_group_name}:{admin_gid}) has a cluster user's name or uid")
admins = s.get("cluster_admins")
if not isinstance(admins, list):
    fail(f"key 'cluster_admins' must be a list of cluster_users names, got {admins!r}")
uid_of = dict(spec.split(":") for spec in user_specs)
admin_specs = []
for i, name in enumerate(admins):
    if not isinstance(name, str) or name not in uid_of:
        fail(f"cluster_admins[{i}] = {name!r} is not a cluster_users name")
    if f"{name}:{uid_of[name]}" in admin_specs:
        fail(f"cluster_admins[{i}]: '{name}' appears twice")
    admin_specs.append(f"{name}:{uid_of[name]}")
home_root = abspath("home_root", get("home_root"))
if not home_root.startswith(fsx_mount.rstrip("/") + "/"):
    # Homes must be shared: the per-user SSH key pair is generated once, on FSx.
    fail(f"key 'home_root' must be under fsx_mount {fsx_mount}, got {home_root!r}")
lifecycle_bucket = get("lifecycle_bucket")
if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", lifecycle_bucket):
    fail(f"key 'lifecycle_bucket' is not an S3 bucket name, got {lifecycle_bucket!r}")
accounting = s.get("slurm_accounting")
if not isinstance(accounting, bool):
    fail(f"key 'slurm_accounting' must be true or false, got {accounting!r}")
container_runtime = s.get("container_runtime")
if not isinstance(container_runtime, bool):
    fail(f"key 'container_runtime' must be true or false, got {container_runtime!r}")
# privateNetwork (stacks/network.py): this account's ECR is the only registry, and the envs come
# from the wheelhouses the cluster stack uploaded (stacks/wheelhouse.py: prefix, lock sha256, Python;
# python_env.sh reads them from the package it builds for, wheelhouse.sh).
private_network = s.get("private_network")
if not isinstance(private_network, bool):
    fail(f"key 'private_network' must be true or false, got {private_network!r}")
image_registry = get("image_registry")
if image_registry and not re.fullmatch(r"[0-9]{12}\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com(\.cn)?", image_registry):
    fail(f"key 'image_registry' is not an ECR registry (<account>.dkr.ecr.<region>.amazonaws.com), got {image_registry!r}")
if private_network and not image_registry:
    fail("key 'image_registry' is empty but private_network is true: a private cluster pulls only from its own ECR")
wheelhouses = s.get("wheelhouses")
if not isinstance(wheelhouses, dict):
    fail(f"key 'wheelhouses' must be an object (env kind -> wheelhouse), got {wheelhouses!r}")
for kind in ("gpu", "neuron"):
    entry = wheelhouses.get(kind, {})
    if not isinstance(entry, dict):
        fail(f"wheelhouses['{kind}'] must be an object, got {entry!r}")
    prefix, lock, python = entry.get("prefix", ""), entry.get("lock_sha256", ""), entry.get("python", "")
    if entry and not (re.fullmatch(rf"wheelhouse/{kind}-[0-9a-f]{{16}}/", str(prefix))
                      and re.fullmatch(r"[0-9a-f]{64}", str(lock)) and re.fullmatch(r"3\.[0-9]{1,2}", str(python))):
        fail(f"wheelhouses['{kind}'] must be {{prefix: wheelhouse/{kind}-<16 hex>/, lock_sha256: <64 hex>, "
             f"python: 3.N}}, got {entry!r}")
unknown = set(wheelhouses) - {"gpu", "neuron"}
if unknown:
    fail(f"wheelhouses has unknown env kinds {sorted(unknown)}; the node envs are gpu and neuron")

# Optional (older settings files have none): the observability step's switch (a node setting) and
# the workspace its collector remote-writes to (stacks/observability.py; a deploy-time value, so
# top-level and outside the package hash: lifecycle_scripts/package_hash.py ENVIRONMENT_KEYS).
observability = s.get("observability", {})
if not isinstance(observability, dict) or not isinstance(observability.get("enabled", False), bool):
    fail(f"key 'observability' must be {{enabled: true|false}}, got {observability!r}")
# A private cluster's observability step installs its agents from the bundle the cluster stack
# uploaded beside the wheelhouses (stacks/agent_releases.py) and pulls the DCGM exporter from this
# account's ECR (stacks/images.py MIRRORED_IMAGES); both absent on a public cluster.
agents = observability.get("agents", {})
if not isinstance(agents, dict) or (agents and not (
        re.fullmatch(r"wheelhouse/agents-[0-9a-f]{16}/", str(agents.get("prefix", "")))
        and re.fullmatch(r"[0-9a-f]{64}", str(agents.get("lock_sha256", ""))))):
    fail(f"observability.agents must be {{prefix: wheelhouse/agents-<16 hex>/, lock_sha256: <64 hex>}}, got {agents!r}")
dcgm_repository = observability.get("dcgm_exporter_repository", "")
if not isinstance(dcgm_repository, str) or (dcgm_repository and not re.fullmatch(r"[a-z0-9][a-z0-9._/-]*", dcgm_repository)):
    fail(f"observability.dcgm_exporter_repository must be an ECR repository name, got {dcgm_repository!r}")
remote_write = s.get("remote_write_url", "")
if not isinstance(remote_write, str) or (remote_write and not re.fullmatch(r"https://[^\s'\"]+", remote_write)):
    fail(f"key 'remote_write_url' must be empty or an https URL, got {remote_write!r}")

values = {
    "CFG_PROJECT": get("project"),
    "CFG_CLUSTER_NAME": get("cluster_name"),
    "CFG_REGION": region,
    "CFG_DATA_BUCKET": get("data_bucket"),
    "CFG_ARTEFACTS_BUCKET": get("artefacts_bucket"),
    "CFG_PACKAGE_HASH": package_hash,
    "CFG_LIFECYCLE_BUCKET": lifecycle_bucket,
    "CFG_NEURON_PIP_INDEX": get("neuron_pip_index"),
    "CFG_RDZV_PORT": str(port),
    "CFG_FSX_MOUNT": fsx_mount,
    "CFG_GROUPS_JSON": json.dumps(groups, sort_keys=True),
    "CFG_CLUSTER_GROUP": group_name,
    "CFG_CLUSTER_GID": str(group_gid),
    "CFG_CLUSTER_USERS": " ".join(user_specs),
    "CFG_CLUSTER_ADMINS": " ".join(admin_specs),
    "CFG_ADMIN_GROUP": admin_group_name,
    "CFG_ADMIN_GID": str(admin_gid),
    "CFG_HOME_ROOT": home_root,
    "CFG_SLURM_ACCOUNTING": "true" if accounting else "false",
    "CFG_CONTAINER_RUNTIME": "true" if container_runtime else "false",
    "CFG_PRIVATE_NETWORK": "true" if private_network else "false",
    "CFG_IMAGE_REGISTRY": image_registry,
    "CFG_OBSERVABILITY": "true" if observability.get("enabled", False) else "false",
    "CFG_REMOTE_WRITE_URL": remote_write,
    "CFG_AGENTS_PREFIX": agents.get("prefix", ""),
    "CFG_AGENTS_LOCK_SHA256": agents.get("lock_sha256", ""),
    "CFG_DCGM_EXPORTER_REPOSITORY": dcgm_repository,
    # Paths as this node sees them (PLATFORM_ROOT + the cluster path).
    "FSX": root + fsx_mount,
    "ENV_GPU_DIR": root + env_gpu,
    "ENV_NEURON_DIR": root + env_neuron,
    "HOME_ROOT_DIR": root + home_root,
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
log "cluster group $CFG_CLUSTER_GROUP ($CFG_CLUSTER_GID), users: $CFG_CLUSTER_USERS; homes under $CFG_HOME_ROOT"
log "admin group $CFG_ADMIN_GROUP ($CFG_ADMIN_GID), admins (sudo): ${CFG_CLUSTER_ADMINS:-none}"
if [[ $CFG_PRIVATE_NETWORK == true ]]; then
  log "private network: images only from $CFG_IMAGE_REGISTRY, envs from the wheelhouses under s3://$CFG_LIFECYCLE_BUCKET/wheelhouse/"
fi
