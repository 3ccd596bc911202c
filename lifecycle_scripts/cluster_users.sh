#!/usr/bin/env bash
# Step "users": the cluster's POSIX group and users, the same on every node (every role runs
# this step), from platform-settings.json cluster_group / cluster_users / home_root:
#   - the group with its fixed GID; each user with its fixed UID and the group as PRIMARY
#     group (--no-user-group: a per-user private group would get whatever GID is free on
#     each node, and files on FSx would show different groups on different nodes);
#   - homes on FSx (<home_root>/<user>, created once, owned by the user, 0700), each with
#     one SSH key pair generated with it, its public key in the user's authorized_keys, so
#     the user can ssh between nodes (every node sees the same home).
# Slurm needs nothing more: without accounting, slurmctld authorizes a job by the UID munge
# carries, which is the same on every node because it is fixed here.
#
# Admins (cluster_admins / admin_group, cdk context clusterAdmins / clusterAdminGroup): the admin
# group with its fixed GID, whose members are exactly the admins (gpasswd -M: one removed from
# clusterAdmins leaves the group, and sudo, at the next run), and /etc/sudoers.d/sana-platform-admins:
# "%<group> ALL=(ALL:ALL) NOPASSWD: ALL" (sudoers(5): a "%" prefix names a group; NOPASSWD because
# cluster accounts have no password: people log in through Session Manager as themselves). Every
# sudo is logged with the user's name: sudo's syslog lines (auth.log, journal) and the logfile
# below, besides CloudTrail's StartSession of the IAM principal (runbooks/users.md). The file is
# checked with `visudo -c -f` before it is renamed into place: a broken sudoers.d file would stop
# sudo for everyone on the node.
#
# Modelled on HyperPod's add-users extension for OnInitComplete (awslabs/awsome-distributed-ai,
# 1.architectures/5.sagemaker-hyperpod/Extensions/add-users/: create_posix_users.sh runs on
# all nodes "so UIDs are consistent cluster-wide"; setup_ssh_keys.sh: "First node to run
# creates the keypair; subsequent nodes find it already there"). Differences: a conflict
# fails the node instead of being skipped (a job would otherwise run as the wrong person),
# and the first-node-wins part runs under flock on FSx, so concurrent nodes cannot race.
#
# The real account tools do the work (groupadd/useradd/usermod from Debian's passwd); under a
# test PLATFORM_ROOT they edit that root's /etc (useradd(8) --prefix / --root). Lookups read the
# local account files, which is where these tools write (users from a directory service are
# not the platform's). Ownership is set by number: the tools may not resolve our names yet.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX NODE_NAME CFG_CLUSTER_NAME CFG_CLUSTER_GROUP CFG_CLUSTER_GID CFG_CLUSTER_USERS \
  CFG_HOME_ROOT HOME_ROOT_DIR CFG_ADMIN_GROUP CFG_ADMIN_GID

passwd_file="${PLATFORM_ROOT}/etc/passwd"
group_file="${PLATFORM_ROOT}/etc/group"
lock_timeout=${LIFECYCLE_USERS_LOCK_TIMEOUT_S:-300}
# Under a test root: groupadd/useradd --prefix; usermod --root (chroot), because usermod
# --prefix does not resolve --gid inside the prefix (Debian 12's passwd 4.13: "group '2000'
# does not exist").
prefix_args=() root_args=()
if [[ -n $PLATFORM_ROOT ]]; then prefix_args=(--prefix "$PLATFORM_ROOT") root_args=(--root "$PLATFORM_ROOT"); fi
[[ -r $passwd_file && -r $group_file ]] || die "cannot read $passwd_file and $group_file (the node's account files)"

# field FILE MATCH_FIELD VALUE OUT_FIELD: OUT_FIELD of the first entry whose MATCH_FIELD is VALUE.
field() {
  awk -F: -v k="$2" -v v="$3" -v o="$4" '$k == v { print $o; exit }' "$1"
}

# run_tool CMD ARGS...: a real account tool; its own message becomes the one-line cause.
run_tool() {
  local out
  out=$("$@" 2>&1) || die "$1 failed for ${*: -1}: $(printf '%s' "$out" | tail -n 1)"
}

# ensure_group NAME GID SETTING CONTEXT_KEY: the group with its fixed GID, or one line on a conflict.
ensure_group() {
  local name=$1 gid=$2 setting=$3 key=$4 have_gid have_name
  have_gid=$(field "$group_file" 1 "$name" 3)
  have_name=$(field "$group_file" 3 "$gid" 1)
  if [[ -n $have_gid && $have_gid != "$gid" ]]; then
    die "group '$name' exists on this node with GID $have_gid, but $setting gives $gid; change $key (cdk context) to a name and GID free on the AMI, and redeploy"
  fi
  if [[ -n $have_name && $have_name != "$name" ]]; then
    die "GID $gid of ${setting//_/ } '$name' is already used by group '$have_name' on this node; pick another GID in $key (cdk context) and redeploy"
  fi
  if [[ -n $have_gid ]]; then
    log "group $name ($gid) already exists"
  else
    run_tool groupadd "${prefix_args[@]}" --gid "$gid" "$name"
    log "created group $name ($gid)"
  fi
}

# ensure_account NAME UID: the local account, or one line on a conflict.
ensure_account() {
  local name=$1 uid=$2 gid=$CFG_CLUSTER_GID home="$CFG_HOME_ROOT/$1" have_uid have_name
  have_uid=$(field "$passwd_file" 1 "$name" 3)
  have_name=$(field "$passwd_file" 3 "$uid" 1)
  if [[ -n $have_uid && $have_uid != "$uid" ]]; then
    die "user '$name' exists on this node with UID $have_uid, but cluster_users gives $uid; give the user another name or its UID in clusterUsers (cdk context) and redeploy"
  fi
  if [[ -n $have_name && $have_name != "$name" ]]; then
    die "UID $uid of cluster user '$name' is already used by '$have_name' on this node; pick another UID in clusterUsers (cdk context) and redeploy"
  fi
  if [[ -z $have_uid ]]; then
    run_tool useradd "${prefix_args[@]}" --uid "$uid" --gid "$gid" --no-user-group \
      --home-dir "$home" --no-create-home --shell /bin/bash "$name"
    log "created user $name ($uid) in group $CFG_CLUSTER_GROUP, home $home"
    return 0
  fi
  # Same name and UID: converge the primary group and the home, leave everything else alone.
  if [[ $(field "$passwd_file" 1 "$name" 4) != "$gid" || $(field "$passwd_file" 1 "$name" 6) != "$home" ]]; then
    run_tool usermod "${root_args[@]}" --gid "$gid" --home "$home" "$name"
    log "user $name ($uid): primary group set to $gid, home to $home"
  else
    log "user $name ($uid) already exists"
  fi
}

# ensure_home NAME UID: home and SSH key pair on FSx, once per cluster, under a per-user
# flock (cluster-wide on Lustre with the flock mount option; the fsx step checks it). The
# whole home (.ssh/, the key pair, authorized_keys) is built aside by root and renamed into
# place: a home that exists is complete, and root never works inside a home its user
# already controls (a user's symlink there must not make a root chown or write follow it).
ensure_home() {
  local name=$1 uid=$2 gid=$CFG_CLUSTER_GID
  local home="$HOME_ROOT_DIR/$name" lock="$HOME_ROOT_DIR/.locks/$name.lock"
  exec 8>>"$lock"
  flock -w "$lock_timeout" 8 \
    || die "timed out after ${lock_timeout}s waiting for $lock (another node is setting up $name's home)"
  if [[ -e $home || -L $home ]]; then
    [[ -f $home/.ssh/id_ed25519 ]] \
      || log "WARNING: $home exists without .ssh/id_ed25519 (not made by this platform); left as it is"
    log "home $home already exists"
    exec 8>&-
    return 0
  fi
  local incoming="$HOME_ROOT_DIR/.$name.incoming.$NODE_NAME.$$"
  rm -rf "$incoming"
  mkdir -m 0700 "$incoming" "$incoming/.ssh"
  ssh-keygen -q -t ed25519 -N "" -C "$name@$CFG_CLUSTER_NAME" -f "$incoming/.ssh/id_ed25519" >/dev/null
  cp "$incoming/.ssh/id_ed25519.pub" "$incoming/.ssh/authorized_keys"
  chmod 0600 "$incoming/.ssh/authorized_keys"
  chown -R "$uid:$gid" "$incoming"
  mv -T "$incoming" "$home"
  log "created home $home ($uid:$gid, 0700) with SSH key pair .ssh/id_ed25519 (public key in .ssh/authorized_keys) for $name"
  exec 8>&-
}

# ensure_admins: the admin group's members are exactly the admins, and its sudoers entry.
ensure_admins() {
  local members sudoers_dir="${PLATFORM_ROOT}/etc/sudoers.d" file tmp out
  members=$(tr ' ' '\n' <<<"${CFG_CLUSTER_ADMINS:-}" | cut -d: -f1 | paste -sd, -)
  # gpasswd --root chroots (like usermod above) so it finds the members in that root's passwd.
  local gpasswd_root=()
  if [[ -n $PLATFORM_ROOT ]]; then gpasswd_root=(--root "$PLATFORM_ROOT"); fi
  run_tool gpasswd "${gpasswd_root[@]}" --members "$members" "$CFG_ADMIN_GROUP"
  log "admin group $CFG_ADMIN_GROUP ($CFG_ADMIN_GID) members: ${members:-none}"
  file="$sudoers_dir/sana-platform-admins"
  mkdir -p "$sudoers_dir"
  tmp=$(mktemp "$sudoers_dir/.sana-platform-admins.XXXXXX")
  cat >"$tmp" <<SUDOERS
# Written by the Sana platform lifecycle (lifecycle_scripts/cluster_users.sh) from the cdk context
# clusterAdminGroup ($CFG_ADMIN_GROUP) and clusterAdmins (its members): they may run any command as
# root. Every command is logged with the user's name (syslog, and the log file below).
Defaults:%$CFG_ADMIN_GROUP logfile=/var/log/sana-admin-sudo.log
%$CFG_ADMIN_GROUP ALL=(ALL:ALL) NOPASSWD: ALL
SUDOERS
  chmod 0440 "$tmp"
  if has_visudo; then
    out=$(visudo -c -f "$tmp" 2>&1) || { rm -f "$tmp"; die "visudo rejects the admin sudoers entry: $(printf '%s' "$out" | tail -n 1)"; }
  else
    log "WARNING: visudo is not installed (no sudo on this node): $file is written but not checked"
  fi
  mv -f "$tmp" "$file"
  log "sudoers entry $file: members of $CFG_ADMIN_GROUP may sudo"
}

has_visudo() {
  PATH="$PATH:/usr/sbin:/sbin" command -v visudo >/dev/null 2>&1
}

ensure_group "$CFG_CLUSTER_GROUP" "$CFG_CLUSTER_GID" cluster_group clusterGroup
ensure_group "$CFG_ADMIN_GROUP" "$CFG_ADMIN_GID" admin_group clusterAdminGroup
read -r -a specs <<<"$CFG_CLUSTER_USERS"
for spec in "${specs[@]}"; do
  ensure_account "${spec%%:*}" "${spec##*:}"
done
for spec in "${specs[@]}"; do
  ensure_home "${spec%%:*}" "${spec##*:}"
done
ensure_admins
log "cluster users ready: ${specs[*]} (group $CFG_CLUSTER_GROUP $CFG_CLUSTER_GID, homes under $CFG_HOME_ROOT)"
