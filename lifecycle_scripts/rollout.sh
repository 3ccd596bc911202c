#!/usr/bin/env bash
# Roll a running cluster onto a new package: HyperPod runs lifecycle scripts on NEW nodes
# only ("The UpdateCluster API only runs the lifecycle scripts for new instance groups",
# https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-lifecycle-best-practices-slurm-slurm-update-cluster-lifecycle.html),
# so after `cdk deploy` has uploaded a new content-hashed prefix, this moves the nodes that
# are already running onto it. FSx is shared, so one run per accelerator kind covers the
# whole cluster (training/slurm/rollout.sbatch submits it; runbooks/rollout.md).
#
#   rollout.sh <package hash | s3://<lifecycle bucket>/lifecycle/<hash>/>
#
# Only THIS cluster's lifecycle bucket, only under lifecycle/, only a 16-hex-digit hash: root
# installs what it fetches (pip runs as root, and `current` changes the code every later job
# runs), so the prefix is checked against platform-settings.json's lifecycle_bucket, and the
# fetched files must hash to the name of the prefix (lifecycle_scripts/package_hash.py, the
# function the cluster stack names the upload with, run from the package that is current now).
# A prefix anyone could write to, or one whose content was changed after `cdk deploy`, is
# refused before anything is installed.
#
# As root, on a node provisioned by on_init_complete.sh (it reads that node's settings.env and
# node.env). Steps, each converging, so a re-run (or a run after a failure) is safe:
#   1. fetch   the prefix into $FSX/platform/<hash> (training/ and lifecycle/, as the package
#              step lays it out), through a temp dir renamed into place: a hash dir is always
#              complete. An installed hash is never fetched again.
#   2. env     this node's backend env for the new requirements (python_env.sh KIND prepare:
#              built once per cluster under the env lock, or found ready; envs are keyed by a
#              hash of their requirements, so unchanged requirements build nothing).
#   3. flip    once the env of EVERY accelerator kind the cluster has is ready for <hash>: the
#              env links and platform/current, under a lock, each with an atomic rename. Until
#              then current stays on the old package (a GPU env never runs with a package
#              whose Neuron env is missing, and the other way round).
# Nothing is deleted: a running job keeps the package and env directories it resolved when it
# started (training/slurm/launch.sh resolves them once per job).
#
# S3 is read with boto3 from this node's platform env (pinned in training/requirements-*.txt,
# the client the training package uses, and the one the tests run against the loopback S3),
# with the node's execution role: s3:ListBucket and s3:GetObject on lifecycle/* (stacks/cluster.py,
# ExecutionRole). AWS_ENDPOINT_URL_S3 / AWS_DEFAULT_REGION are honoured as boto3 documents.
#
# Output: log lines, then ONE last line: "[rollout] ROLLED OUT ...", "[rollout] PENDING ..."
# (exit 0) or "[rollout] FAILED: <cause>" (exit 1). Everything it writes lies in root-only
# directories ($FSX/platform, $FSX/envs; rollout.sbatch's output in /fsx/logs/root/).
#
# Environment: PLATFORM_ROOT (tests), ROLLOUT_PYTHON (a python with boto3; default the env of
# this node's role), LIFECYCLE_ENV_LOCK_TIMEOUT_S, ROLLOUT_LOCK_TIMEOUT_S (default 600).
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi
set -euo pipefail
umask 022
LIFECYCLE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LIFECYCLE_DIR PLATFORM_ROOT="${PLATFORM_ROOT:-}"
export STEP_NAME=rollout
# shellcheck source=SCRIPTDIR/common.sh
source "$LIFECYCLE_DIR/common.sh"

# fail CAUSE: the one FAILED line (stdout, like every other line of this script), exit 1.
fail() {
  log "FAILED: $*"
  exit 1
}

[[ $# -eq 1 && -n $1 ]] || fail "usage: rollout.sh <package hash | s3://<lifecycle bucket>/lifecycle/<hash>/>"
for env_file in "$STATE_DIR/settings.env" "$STATE_DIR/node.env"; do
  [[ -r $env_file ]] || fail "no $env_file: this node was not provisioned by on_init_complete.sh; run the rollout on a cluster node (sbatch training/slurm/rollout.sbatch)"
  # shellcheck source=/dev/null
  source "$env_file"
done
[[ $(id -u) == 0 ]] || fail "must run as root (it writes $FSX/platform and $FSX/envs): sudo sbatch ... rollout.sbatch"

# The argument: a bare hash or the full prefix, which must be this cluster's lifecycle bucket.
arg=$1 bucket=$CFG_LIFECYCLE_BUCKET
if [[ $arg == s3://* ]]; then
  [[ $arg =~ ^s3://([^/]+)/lifecycle/([0-9a-f]{16})/?$ && ${BASH_REMATCH[1]} == "$bucket" ]] \
    || fail "'$arg' is not this cluster's lifecycle prefix s3://$bucket/lifecycle/<hash>/; the rollout installs only packages \`cdk deploy\` uploaded there (the cluster stack's LifecycleUri output)"
  hash=${BASH_REMATCH[2]}
else
  [[ $arg =~ ^[0-9a-f]{16}$ ]] \
    || fail "'$arg' is neither a package hash (16 hex digits, the end of the cluster stack's LifecycleUri output) nor an s3:// prefix"
  hash=$arg
fi
prefix="lifecycle/$hash/"
uri="s3://$bucket/$prefix"
platform="$FSX/platform"
dest="$platform/$hash"
state="$platform/.rollout"
mkdir -p "$state" "$platform/.locks"
old=$(readlink "$platform/current" 2>/dev/null || echo none)
log "rolling out $uri on $NODE_NAME (role $NODE_ROLE); current package: $old"

# The kinds of env this cluster needs: one per accelerator role its groups have.
mapfile -t kinds < <(python3 -c 'import json, sys
roles = set(json.loads(sys.argv[1]).values())
print("\n".join(k for r, k in (("gpu", "gpu"), ("trn", "neuron")) if r in roles))' "$CFG_GROUPS_JSON")
# Envs are built on their accelerator's nodes; elsewhere the rollout only fetches and flips.
case $NODE_ROLE in
  gpu) own_kind=gpu own_env=$ENV_GPU_DIR ;;
  trn) own_kind=neuron own_env=$ENV_NEURON_DIR ;;
  *) own_kind="" own_env=$ENV_GPU_DIR ;;
esac

# ---- 1. fetch
fetch() {
  local python=${ROLLOUT_PYTHON:-$own_env/bin/python} incoming out
  [[ -x $python ]] || fail "no python with boto3 at $python (the platform env of this node); set ROLLOUT_PYTHON"
  incoming=$(mktemp -d "$platform/.incoming-$hash.XXXXXX")
  # shellcheck disable=SC2064 # expand now: the trap must remove this very directory
  trap "rm -rf '$incoming'" EXIT
  if ! out=$("$python" -I - "$bucket" "$prefix" "$incoming" "$CFG_REGION" "$LIFECYCLE_DIR/package_hash.py" 2>&1 <<'PY'
import os
import runpy
import sys
from pathlib import PurePosixPath

import boto3
from botocore.exceptions import BotoCoreError, ClientError

bucket, prefix, dest, region, hash_module = sys.argv[1:6]
excluded = runpy.run_path(hash_module)["excluded"]
uri = f"s3://{bucket}/{prefix}"
s3 = boto3.client("s3", region_name=os.environ.get("AWS_DEFAULT_REGION") or region)
count = 0
try:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel or rel.endswith("/"):
                continue
            parts = rel.split("/")
            if any(p in ("", ".", "..") for p in parts):
                sys.exit(f"{uri} holds an unsafe key {obj['Key']!r}; it was not uploaded by the cluster stack")
            if excluded(PurePosixPath(*parts)):
                # The stack never uploads these, and the hash leaves them out: installing one
                # would install code no hash vouches for.
                sys.exit(f"{uri} holds {obj['Key']!r}, a name the cluster stack never uploads "
                         "(caches, tests, hidden files); it was not uploaded by `cdk deploy`")
            # The stack's layout: training/... is the package, everything else the lifecycle scripts.
            local = os.path.join(dest, *parts) if parts[0] == "training" else os.path.join(dest, "lifecycle", *parts)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            s3.download_file(bucket, obj["Key"], local)
            count += 1
except ClientError as e:
    err = e.response.get("Error", {})
    sys.exit(f"cannot read {uri}: {err.get('Code')}: {err.get('Message')}")
except BotoCoreError as e:
    sys.exit(f"cannot read {uri}: {e}")
if count == 0:
    sys.exit(f"{uri} holds no objects: no package was uploaded under that hash; `cdk deploy` uploads "
             f"it (list the hashes with: aws s3 ls s3://{bucket}/{prefix.rsplit('/', 2)[0]}/)")
print(count)
PY
  ); then
    fail "$(printf '%s' "$out" | tail -n 1)"
  fi
  [[ -f $incoming/training/__init__.py ]] || fail "$uri has no training/__init__.py: not a package uploaded by the cluster stack"
  local settings_hash
  settings_hash=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["package_hash"])' \
    "$incoming/lifecycle/platform-settings.json" 2>/dev/null) \
    || fail "$uri has no readable platform-settings.json: not a package uploaded by the cluster stack"
  [[ $settings_hash == "$hash" ]] || fail "$uri holds the package of hash $settings_hash, not $hash; name the prefix cdk deploy uploaded"
  local content_hash
  content_hash=$(python3 "$LIFECYCLE_DIR/package_hash.py" "$incoming/lifecycle" "$incoming/training") \
    || fail "cannot hash the package fetched from $uri"
  [[ $content_hash == "$hash" ]] \
    || fail "$uri holds files whose content hash is $content_hash, not $hash: changed after \`cdk deploy\` uploaded them; nothing was installed"
  chmod -R u+rwX,go+rX,go-w "$incoming"
  if mv -T "$incoming" "$dest" 2>/dev/null; then
    log "fetched $(printf '%s' "$out" | tail -n 1) objects into $dest"
  else
    [[ -d $dest ]] || fail "cannot move the fetched package into $dest"
    log "package $hash was installed by another node meanwhile"
  fi
  rm -rf "$incoming"
  trap - EXIT
}

if [[ -d $dest ]]; then
  log "package $hash is already at $dest"
else
  fetch
fi

# ---- 2. env
if [[ -n $own_kind ]]; then
  error_file=$(mktemp "$state/.error.XXXXXX")
  status=0
  CFG_PACKAGE_HASH=$hash STEP_NAME="env-$own_kind" STEP_ERROR_FILE=$error_file \
    PYTHON_ENV_TARGET_FILE="$state/$hash.$own_kind" bash "$LIFECYCLE_DIR/python_env.sh" "$own_kind" prepare || status=$?
  cause=$(tr '\n' ' ' <"$error_file")
  rm -f "$error_file"
  ((status == 0)) || fail "env-$own_kind: ${cause:-python_env.sh exited with status $status}"
fi

# ---- 3. flip
exec 7>>"$platform/.locks/rollout.lock"
flock -w "${ROLLOUT_LOCK_TIMEOUT_S:-600}" 7 || fail "timed out waiting for $platform/.locks/rollout.lock (another rollout is flipping)"
missing=()
for kind in "${kinds[@]}"; do
  [[ -s $state/$hash.$kind ]] || missing+=("$kind")
done
if ((${#missing[@]})); then
  partitions=${missing[*]}
  log "PENDING $hash: current stays $old until the ${partitions// / and } env is ready for it; run the rollout on a ${partitions//neuron/trn} node too (runbooks/rollout.md)"
  exit 0
fi
flipped=()
for kind in "${kinds[@]}"; do
  link=$ENV_GPU_DIR
  [[ $kind == gpu ]] || link=$ENV_NEURON_DIR
  target=$(cat "$state/$hash.$kind")
  if [[ $(readlink "$link" 2>/dev/null) != "$target" ]]; then
    point_link "$link" "$target"
  fi
  flipped+=("$(basename "$link")->$target")
done
if [[ $old != "$hash" ]]; then
  point_link "$platform/current" "$hash"
fi
log "ROLLED OUT $hash: current -> $hash (was $old), ${flipped[*]:-no envs}; old directories kept"
