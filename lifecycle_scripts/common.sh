# shellcheck shell=bash
# Helpers every lifecycle step sources: where things live, one-line logging, and failing
# with one line that on_init_complete.sh turns into "FAILED step=<name>: <cause>".
#
# Everything on the node's root filesystem is under PLATFORM_ROOT (empty on a real node),
# so the tests run these scripts for real inside a temporary directory.

PLATFORM_ROOT="${PLATFORM_ROOT:-}"
COMMON_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034 # used by the scripts that source this file
{
PROVISION_LOG_DIR="${PLATFORM_ROOT}/var/log/provision"
PROVISION_LOG="${PROVISION_LOG_DIR}/provisioning.log"
# What this node learnt about itself (settings.env, node.env); kept for debugging.
STATE_DIR="${PLATFORM_ROOT}/var/lib/sana-platform"
PROFILE_PATH="${PLATFORM_ROOT}/etc/profile.d/sana-platform.sh"
# The WARN lines of this node's status file ("<part>\t<cause>"): the lifecycle's, and the late
# check's (sana-node-ready.service, slurm_ready.sh).
WARNINGS_FILE="${STATE_DIR}/warnings"
LATE_WARNINGS_FILE="${STATE_DIR}/late-warnings"
}

# The [tag] of this script's log lines: the step name on_init_complete.sh gives it, else the
# script's own name (a step run alone).
STEP_NAME=${STEP_NAME:-$(basename "$0" .sh)}

# log MESSAGE...: one timestamped line on stdout; on_init_complete.sh tees its stdout into
# PROVISION_LOG, and HyperPod ships stdout to CloudWatch.
log() {
  printf '%s [%s] %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$STEP_NAME" "$*"
}

# die CAUSE...: stop this step. The cause is handed to on_init_complete.sh (STEP_ERROR_FILE),
# which prints the single FAILED line; run alone, a step prints it on stderr.
die() {
  if [[ -n ${STEP_ERROR_FILE:-} ]]; then
    printf '%s\n' "$*" >"$STEP_ERROR_FILE"
  else
    printf 'ERROR: %s\n' "$*" >&2
  fi
  exit 1
}

# warn CAUSE...: something optional does not work on this node (a container runtime, an
# accounting association). The step goes on; on_init_complete.sh (or the late check) puts
# one "WARN part=<step> cause=<CAUSE>" line in the node's status file. Never fails the node.
warn() {
  log "WARNING: $*"
  if [[ -n ${STEP_WARN_FILE:-} ]]; then printf '%s\n' "$*" >>"$STEP_WARN_FILE"; fi
}

# An unexpected failure (set -e) still names its cause: the command, status and line.
on_unexpected_error() {
  local status=$1 command=$2 where=$3
  if [[ -n ${STEP_ERROR_FILE:-} && ! -s $STEP_ERROR_FILE ]]; then
    printf 'command failed with status %s at %s: %s\n' "$status" "$where" "$command" >"$STEP_ERROR_FILE"
  fi
}

# step_init: called at the top of every step script (after set -euo pipefail).
step_init() {
  set -o errtrace
  trap 'on_unexpected_error $? "$BASH_COMMAND" "${BASH_SOURCE[0]##*/}:$LINENO"' ERR
}

# require_vars NAME...: the variables on_init_complete.sh exports from the settings and the
# node identity; a step run without them is a bug, not a node problem.
require_vars() {
  local name
  for name in "$@"; do
    [[ -n ${!name:-} ]] || die "internal: $name is not set (run this step through on_init_complete.sh)"
  done
}

# write_atomically PATH MODE: stdin -> PATH via a temp file in the same directory and
# rename, so a reader (or a node that dies half-way) never sees a partial file.
write_atomically() {
  local path=$1 mode=$2 tmp
  tmp=$(mktemp "${path}.XXXXXX")
  cat >"$tmp"
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$path"
}

# point_link LINK TARGET: make LINK a symlink to TARGET atomically (ln -sfn alone is an
# unlink + symlink, which a concurrent reader can see as "missing").
point_link() {
  local link=$1 target=$2 tmp
  if [[ -e $link && ! -L $link ]]; then
    die "$link exists and is not a symlink; move it away so the platform can manage it"
  fi
  # Unique across nodes: identical AMIs booting together can run this with the same PID.
  tmp="$(dirname "$link")/.$(basename "$link").${NODE_NAME:-$HOSTNAME}.$$.tmp"
  ln -sfn "$target" "$tmp"
  mv -T "$tmp" "$link"
}

# node_status_file: the one-line status an operator lists on FSx (`cat /fsx/logs/provision/*.status`).
node_status_file() {
  printf '%s/logs/provision/%s.status\n' "$FSX" "$NODE_NAME"
}

# safe_fs dir|userdir|write ARGS...: root's file operations on FSx that never follow a path a
# cluster user controls (lifecycle_scripts/safe_fs.py: openat + O_NOFOLLOW, fchown/fchmod on
# descriptors). Its one-line refusal ("... is a symlink ...") becomes this step's cause.
safe_fs() {
  local out
  out=$(python3 "$COMMON_DIR/safe_fs.py" "$@" 2>&1) || die "$out"
}

# write_node_status LINE: the node's status file, written whole by root into the root-only
# logs/provision (never through a link; refused in a directory others can write).
write_node_status() {
  printf '%s\n' "$1" | safe_fs write "$FSX" 0644 "logs/provision/$NODE_NAME.status"
}
