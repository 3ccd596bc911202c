# shellcheck shell=bash
# Sourced by python_env.sh on a private cluster (privateNetwork: no route to PyPI or Neuron's
# repository). The env's wheels come from the wheelhouse `make wheelhouse` built and the cluster
# stack uploaded to s3://<lifecycle bucket>/wheelhouse/<kind>-<key>/ (stacks/wheelhouse.py,
# stacks/wheelhouse_upload.py), named with its lock's sha256 and Python in platform-settings.json.
# It is fetched once per cluster, by the node that builds the env (under the env's build lock), to
# <fsx>/wheelhouse/<kind>-<key>/ (root's, renamed into place: complete or absent), checked against
# the lock the deployed package names (wheelhouse.py check: ONE line naming every missing or altered
# wheel), and installed with pip --no-index --require-hashes: exactly the locked files, nothing else.

# wheelhouse_settings KIND [PACKAGE]: sets wheelhouse_prefix, wheelhouse_lock_sha256, wheelhouse_python
# from the platform-settings.json of the package the env is for ($FSX/platform/<PACKAGE>/lifecycle/,
# default this node's CFG_PACKAGE_HASH; python_env.sh passes the package `current` serves, or the one
# being rolled out): a rollout of new requirements names its own wheelhouse.
# shellcheck disable=SC2034 # wheelhouse_python is read by python_env.sh
wheelhouse_settings() {
  local kind=$1 package=${2:-$CFG_PACKAGE_HASH}
  local settings="$FSX/platform/$package/lifecycle/platform-settings.json" out
  out=$(python3 - "$settings" "$kind" 2>&1 <<'PY'
import json, re, sys

path, kind = sys.argv[1:3]
try:
    with open(path, encoding="utf-8") as f:
        entry = json.load(f).get("wheelhouses", {}).get(kind)
except (OSError, ValueError, AttributeError) as e:
    sys.exit(f"cannot read the wheelhouses of {path}: {e}")
if not entry:
    sys.exit(f"privateNetwork is on but {path} names no {kind} wheelhouse: build it (make wheelhouse) and "
             "redeploy the cluster stack")
prefix, lock, python = (str(entry.get(k, "")) for k in ("prefix", "lock_sha256", "python"))
if not (re.fullmatch(rf"wheelhouse/{kind}-[0-9a-f]{{16}}/", prefix) and re.fullmatch(r"[0-9a-f]{64}", lock)
        and re.fullmatch(r"3\.[0-9]{1,2}", python)):
    sys.exit(f"{path}: wheelhouses.{kind} must be {{prefix, lock_sha256, python}} as the cluster stack writes them, "
             f"got {entry!r}")
print(prefix, lock, python)
PY
) || die "$out"
  read -r wheelhouse_prefix wheelhouse_lock_sha256 wheelhouse_python <<<"$out"
}

# wheelhouse_fetch: sets wheelhouse_dir, the checked wheelhouse on FSx (downloaded if absent).
wheelhouse_fetch() {
  require_vars FSX CFG_LIFECYCLE_BUCKET CFG_REGION
  local store="$FSX/wheelhouse" source out incoming=""
  wheelhouse_dir="$store/$(basename "$wheelhouse_prefix")"
  source="s3://$CFG_LIFECYCLE_BUCKET/$wheelhouse_prefix"
  if [[ ! -d $wheelhouse_dir ]]; then
    # Root's, never through a link (safe_fs.py); a download killed half-way (a node lost) left an
    # incoming directory, removed here under the env's build lock, which the caller holds.
    safe_fs dir "$FSX" 0:0 0755 wheelhouse
    rm -rf "$store/.incoming-$(basename "$wheelhouse_prefix")".*
    incoming=$(mktemp -d "$store/.incoming-$(basename "$wheelhouse_prefix").XXXXXX")
    log "downloading the wheelhouse $source to $wheelhouse_dir"
    if ! out=$(s3_download_prefix "$source" "$incoming" "$CFG_REGION" 2>&1); then
      rm -rf "$incoming"
      die "cannot download the wheelhouse $source: $(printf '%s' "$out" | tail -n 1)"
    fi
    if ! out=$(python3 "$COMMON_DIR/wheelhouse.py" check "$incoming" --lock-sha256 "$wheelhouse_lock_sha256" 2>&1); then
      rm -rf "$incoming"
      die "${out//$incoming/$source}"
    fi
    chmod 0755 "$incoming"
    mv -T "$incoming" "$wheelhouse_dir" || die "cannot move the wheelhouse into $wheelhouse_dir"
  else
    # Fetched by an earlier build: checked again, it is what pip is about to trust.
    out=$(python3 "$COMMON_DIR/wheelhouse.py" check "$wheelhouse_dir" --lock-sha256 "$wheelhouse_lock_sha256" 2>&1) \
      || die "$out (or, for a copy changed on FSx since it was fetched: remove $wheelhouse_dir to fetch it again)"
  fi
  log "${out//$incoming/$wheelhouse_dir}"
}

# wheelhouse_pip_args: pip's arguments for an install from the checked wheelhouse only.
wheelhouse_pip_args() {
  printf '%s\n' --no-index --find-links "$wheelhouse_dir" --require-hashes --only-binary=:all: \
    -r "$wheelhouse_dir/requirements.lock"
}
