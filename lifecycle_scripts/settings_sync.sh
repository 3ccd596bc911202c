#!/usr/bin/env bash
# sana-settings.service (started by sana-settings.timer, settings_timer.sh): apply the node
# settings of the package the cluster serves, once per package, on this node.
#
# Runs from $FSX/platform/current/lifecycle/ (the unit names that path), resolved once at start,
# so the settings and the scripts that apply them come from the same package even if a rollout
# moves `current` meanwhile. When that package is the one this node applied last
# ($STATE_DIR/settings-applied) it exits at once and prints nothing. Otherwise, as root:
#   settings  platform-settings.json of that package -> $STATE_DIR/settings.env (settings.sh)
#   dirs      the new users' private directories on FSx (shared_dirs.sh)
#   users     group, users, admins and the admins' sudoers entry (cluster_users.sh)
#   accounts  on the controller: the Slurm account and one association per user (slurm_accounts.sh)
# the same scripts, with the same checks, as the boot. Users are only ever added: one removed
# from clusterUsers keeps their account and home (runbooks/users.md); admins removed from
# clusterAdmins lose the admin group, so sudo, at once.
#
# Result, one line in $FSX/logs/provision/<node>.settings (root-owned, like the status file):
#   <time> APPLIED node=<n> role=<r> package=<hash> users=<names> admins=<names>
#   <time> FAILED node=<n> role=<r> package=<hash> step=<step> cause=<cause>
# A failure exits 1 (the unit fails; `systemctl status sana-settings`) and leaves the package
# unapplied, so the next run of the timer tries again; the node keeps running its jobs.
#
# Environment: PLATFORM_ROOT (tests), LIFECYCLE_SLURM_WAIT_S (the controller's wait for slurmdbd).
set -euo pipefail
umask 022
LIFECYCLE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
export LIFECYCLE_DIR PLATFORM_ROOT="${PLATFORM_ROOT:-}"
export STEP_NAME=settings-sync
# shellcheck source=SCRIPTDIR/common.sh
source "$LIFECYCLE_DIR/common.sh"

package=$(basename "$(dirname "$LIFECYCLE_DIR")")
applied_file="$STATE_DIR/settings-applied"
for env_file in "$STATE_DIR/settings.env" "$STATE_DIR/node.env"; do
  [[ -r $env_file ]] || die "no $env_file: the lifecycle (on_init_complete.sh) has not run on this node"
  # shellcheck source=/dev/null
  source "$env_file"
done
[[ $(cat "$applied_file" 2>/dev/null) != "$package" ]] || exit 0

mkdir -p "$PROVISION_LOG_DIR"
exec > >(tee -a "$PROVISION_LOG_DIR/settings-sync.log") 2>&1
exec 6>>"$STATE_DIR/settings.lock"
flock -w 600 6 || die "timed out after 600s waiting for $STATE_DIR/settings.lock (another settings run)"
[[ $(cat "$applied_file" 2>/dev/null) != "$package" ]] || exit 0

# record VERDICT DETAILS: the node's settings line on FSx (never through a link).
record() {
  printf '%s %s node=%s role=%s package=%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$1" "$NODE_NAME" \
    "$NODE_ROLE" "$package" "$2" | safe_fs write "$FSX" 0644 "logs/provision/$NODE_NAME.settings"
}

# run NAME SCRIPT: one step script of the boot; its failure is the FAILED line and exit 1.
run() {
  local name=$1 script=$2 status=0 error_file cause
  error_file=$(mktemp "$STATE_DIR/.settings-error.XXXXXX")
  log "step $name: start"
  STEP_NAME=$name STEP_ERROR_FILE=$error_file bash "$LIFECYCLE_DIR/$script" || status=$?
  cause=$(tr '\n' ' ' <"$error_file")
  rm -f "$error_file"
  if ((status != 0)); then
    cause="${cause:-$script exited with status $status}"
    record FAILED "step=$name cause=${cause% }" || true
    log "FAILED step=$name: ${cause% } (package $package stays unapplied; the timer retries)"
    exit 1
  fi
}

log "applying the settings of package $package (was: $(cat "$applied_file" 2>/dev/null || echo none)) on $NODE_NAME"
run settings settings.sh
# shellcheck source=/dev/null
source "$STATE_DIR/settings.env"
run dirs shared_dirs.sh
run users cluster_users.sh
if [[ $NODE_ROLE == controller ]]; then
  run accounts slurm_accounts.sh
fi
users=$(tr ' ' '\n' <<<"$CFG_CLUSTER_USERS" | cut -d: -f1 | paste -sd, -)
admins=$(tr ' ' '\n' <<<"${CFG_CLUSTER_ADMINS:-}" | cut -d: -f1 | paste -sd, -)
record APPLIED "users=$users admins=${admins:-none}"
printf '%s\n' "$package" | write_atomically "$applied_file" 0644
log "APPLIED package $package: users $users, admins ${admins:-none}"
