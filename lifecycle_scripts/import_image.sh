#!/usr/bin/env bash
# Import a training image into the cluster's image store, by digest. Root only: the store is
# root-owned (container_runtime.sh), so what a job runs from it is what root imported, and no
# user can put another image under its name (training/slurm/launch.sh, container mode).
#
#   sudo bash /fsx/platform/current/lifecycle/import_image.sh <registry>/<repo>:<tag>
#   sudo bash /fsx/platform/current/lifecycle/import_image.sh <registry>/<repo>@sha256:<digest>
#
# on a node with enroot (login or worker; run by the platform team, runbooks/containers.md).
#   1. digest   a tag is resolved to its manifest digest with ECR's BatchGetImage (the node role
#               may pull: stacks/images.py); the platform's tags are immutable, so the tag's
#               index below stays true.
#   2. import   enroot, as root, with private runtime, cache and credential directories under
#               this node's state dir (never the users' shared scratch: enroot trusts a cached
#               layer without checking it again, NVIDIA/enroot src/docker.sh
#               docker::_download_extract), importing the DIGEST: enroot's reference grammar
#               takes `docker://REGISTRY#IMAGE:TAG` with ':' allowed in TAG and asks the registry
#               for /v2/<IMAGE>/manifests/<TAG> (src/docker.sh docker::import, docker::_download),
#               and a digest there is a manifest reference of the Registry HTTP API V2. The ECR
#               login (GetAuthorizationToken) goes into that private credentials file only.
#   3. store    <fsx>/images/sha256-<digest>.sqsh (temp file in the store + rename: complete or
#               absent) and, for a tag, <fsx>/images/by-tag/<registry>/<repo>/<tag> holding
#               "sha256:<digest>", written without following links (safe_fs.py).
# An image already in the store is not imported again. On a private cluster (privateNetwork) the
# only registry is this account's ECR, reached through the VPC's ECR endpoints (stacks/endpoints.py):
# any other is refused in one line before anything is pulled.
#
# Output: log lines, then ONE last line "[import-image] IMPORTED ..." (exit 0) or
# "[import-image] FAILED: <cause>" (exit 1).
# Environment: PLATFORM_ROOT (tests), IMPORT_PYTHON (a python with boto3; default the GPU env),
# AWS_ENDPOINT_URL_ECR (boto3's own, for tests).
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi
set -euo pipefail
umask 022
LIFECYCLE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LIFECYCLE_DIR PLATFORM_ROOT="${PLATFORM_ROOT:-}"
export STEP_NAME=import-image
# shellcheck source=SCRIPTDIR/common.sh
source "$LIFECYCLE_DIR/common.sh"

fail() {
  log "FAILED: $*"
  exit 1
}
# safe_fs's refusal is this script's failure (common.sh die -> stderr when run alone).
die() { fail "$*"; }

[[ $# -eq 1 && -n $1 ]] || fail "usage: import_image.sh <registry>/<repo>:<tag> | <registry>/<repo>@sha256:<digest>"
[[ $(id -u) == 0 ]] || fail "must run as root (the image store is root's): sudo bash $0 $1"
for env_file in "$STATE_DIR/settings.env" "$STATE_DIR/node.env"; do
  [[ -r $env_file ]] || fail "no $env_file: run this on a cluster node provisioned by on_init_complete.sh"
  # shellcheck source=/dev/null
  source "$env_file"
done
command -v enroot >/dev/null 2>&1 || fail "enroot is not installed on this node; import on a login or worker node"

image=$1
if [[ $image =~ ^([^/@:#]+)/([a-z0-9._/-]+)@sha256:([0-9a-f]{64})$ ]]; then
  registry=${BASH_REMATCH[1]} repo=${BASH_REMATCH[2]} tag="" digest=${BASH_REMATCH[3]}
elif [[ $image =~ ^([^/@:#]+)/([a-z0-9._/-]+):([A-Za-z0-9_][A-Za-z0-9._-]{0,127})$ ]]; then
  registry=${BASH_REMATCH[1]} repo=${BASH_REMATCH[2]} tag=${BASH_REMATCH[3]} digest=""
else
  fail "'$image' is not <registry>/<repo>:<tag> or <registry>/<repo>@sha256:<digest>"
fi
if [[ ${CFG_PRIVATE_NETWORK:-false} == true && $registry != "${CFG_IMAGE_REGISTRY:-}" ]]; then
  fail "'$registry' is not this cluster's registry ${CFG_IMAGE_REGISTRY:-}: a private cluster (privateNetwork) pulls only from its own ECR, through its VPC endpoints; push the image there (make push-image REGISTRY=${CFG_IMAGE_REGISTRY:-<account>.dkr.ecr.<region>.amazonaws.com})"
fi
[[ $registry =~ ^([0-9]{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com$ ]] \
  || fail "'$registry' is not an ECR registry (<account>.dkr.ecr.<region>.amazonaws.com); the platform imports its own images only"
account=${BASH_REMATCH[1]} region=${BASH_REMATCH[2]}
store=$FSX/images
[[ -d $store && ! -L $store && $(stat -c %u "$store") == 0 ]] \
  || fail "$store is not the root-owned image store; the containers step makes it (container_runtime.sh)"

work=$(mktemp -d "$STATE_DIR/import-image.XXXXXX")
# shellcheck disable=SC2064 # expand now: the trap removes this very directory
trap "rm -rf '$work'" EXIT
mkdir -m 0700 "$work/config" "$work/cache" "$work/data" "$work/run" "$work/tmp"

python=${IMPORT_PYTHON:-$ENV_GPU_DIR/bin/python}
[[ -x $python ]] || fail "no python with boto3 at $python (the GPU env); set IMPORT_PYTHON"
if ! out=$("$python" -I - "$account" "$region" "$repo" "$tag" "$digest" "$work/config/.credentials" "$registry" 2>&1 <<'PY'
import base64
import os
import sys

import boto3
from botocore.exceptions import BotoCoreError, ClientError

account, region, repo, tag, digest, creds, registry = sys.argv[1:8]
ecr = boto3.client("ecr", region_name=region)
image_id = {"imageTag": tag} if tag else {"imageDigest": f"sha256:{digest}"}
try:
    got = ecr.batch_get_image(registryId=account, repositoryName=repo, imageIds=[image_id])
    if not got.get("images"):
        why = (got.get("failures") or [{}])[0]
        sys.exit(f"{registry}/{repo} has no image {tag or 'sha256:' + digest} "
                 f"({why.get('failureCode', 'not found')}); push it first (make push-image)")
    resolved = got["images"][0]["imageId"]["imageDigest"]
    token = ecr.get_authorization_token(registryIds=[account])["authorizationData"][0]["authorizationToken"]
except (ClientError, BotoCoreError) as e:
    sys.exit(f"cannot reach ECR for {registry}/{repo}: {e}")
user, _, password = base64.b64decode(token).decode().partition(":")
fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
with os.fdopen(fd, "w") as f:
    f.write(f"machine {registry} login {user} password {password}\n")
print(resolved)
PY
); then
  fail "$(printf '%s' "$out" | tail -n 1)"
fi
resolved=$(printf '%s' "$out" | tail -n 1)
[[ $resolved =~ ^sha256:([0-9a-f]{64})$ ]] || fail "ECR returned '$resolved' as the digest of $image"
[[ -z $digest || ${BASH_REMATCH[1]} == "$digest" ]] || fail "ECR names digest $resolved for $image"
digest=${BASH_REMATCH[1]}

dest=$store/sha256-$digest.sqsh
if [[ -f $dest ]]; then
  log "sha256:$digest is already in $store"
else
  incoming=$store/.incoming-$digest.$$.sqsh
  rm -f "$incoming"
  log "importing $registry/$repo@sha256:$digest into $dest"
  if ! out=$(ENROOT_CONFIG_PATH=$work/config ENROOT_CACHE_PATH=$work/cache ENROOT_DATA_PATH=$work/data \
    ENROOT_RUNTIME_PATH=$work/run ENROOT_TEMP_PATH=$work/tmp \
    enroot import --output "$incoming" "docker://$registry#$repo:sha256:$digest" 2>&1); then
    rm -f "$incoming"
    fail "enroot import of $registry/$repo@sha256:$digest failed: $(printf '%s' "$out" | tail -n 1)"
  fi
  chmod 0644 "$incoming"
  mv -f "$incoming" "$dest"
fi
if [[ -n $tag ]]; then
  rel=by-tag
  safe_fs dir "$FSX" 0:0 0755 images/by-tag
  IFS=/ read -r -a parts <<<"$registry/$repo"
  for part in "${parts[@]}"; do
    rel=$rel/$part
    safe_fs dir "$FSX" 0:0 0755 "images/$rel"
  done
  printf 'sha256:%s\n' "$digest" | safe_fs write "$FSX" 0644 "images/$rel/$tag"
fi
log "IMPORTED $image -> $dest${tag:+ (tag index images/by-tag/$registry/$repo/$tag)}"
