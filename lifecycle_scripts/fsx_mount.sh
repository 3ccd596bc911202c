#!/usr/bin/env bash
# Step "fsx": wait for the FSx for Lustre file system at the settings' fsx_mount.
# HyperPod mounts it itself (the cluster's InstanceStorageConfigs FsxLustreConfig), so
# this step only waits, with a bound, and proves root can write there.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars FSX NODE_NAME

wait_s=${LIFECYCLE_FSX_WAIT_S:-300}
poll_s=${LIFECYCLE_FSX_POLL_S:-5}
deadline=$((SECONDS + wait_s))

# findmnt lists every file system mounted at the point, the first mounted first. With
# x-systemd.automount (AWS's own mount_fsx.sh mounts FSx with it: awslabs/awsome-distributed-ai
# 1.architectures/5.sagemaker-hyperpod/LifecycleScripts/base-config/mount_fsx.sh) that is
# systemd's autofs line, and the lustre line only once something has touched the directory.
# So: every line is read, and an autofs-only mount is touched (as that script does, `ls`) and
# asked again.
until info=$(mount_info "$FSX" 2>/dev/null) && lustre=$(awk '$1 == "lustre" { print; exit }' <<<"$info" | grep .); do
  remaining=$((deadline - SECONDS))
  types=$(awk '{ print $1 }' <<<"${info:-}" | paste -sd+ -)
  if ((remaining <= 0)); then
    [[ -z $types ]] \
      || die "$FSX is a $types mount, expected lustre (FSx for Lustre) after ${wait_s}s; HyperPod mounts FSx for Lustre from the instance group's InstanceStorageConfigs (FsxLustreConfig)"
    die "$FSX is not mounted after ${wait_s}s; HyperPod mounts FSx for Lustre from the instance group's InstanceStorageConfigs (FsxLustreConfig): check the group has it and the file system is AVAILABLE"
  fi
  if [[ $types == autofs ]]; then
    log "$FSX is an automount point not mounted yet: touching it (${remaining}s left)"
    ls "$FSX" >/dev/null 2>&1 || true
  else
    log "waiting for $FSX to be mounted (${types:-nothing there}; ${remaining}s left)"
  fi
  sleep $((remaining < poll_s ? remaining : poll_s))
done

read -r fstype options <<<"$lustre"
log "$FSX is mounted: $fstype ${options:-} (findmnt lists: $(awk '{ print $1 }' <<<"$info" | paste -sd' ' -))"
# The env build lock (python_env.sh) relies on cluster-wide flock, which Lustre gives only
# with the `flock` mount option (mount.lustre(8); FSx's own mount guide uses -o flock).
case ",${options:-}," in
  *,localflock,* | *,noflock,*)
    log "WARNING: $FSX is mounted without cluster-wide flock ($options); nodes cannot coordinate the env build" ;;
esac

probe="$FSX/.write-test.$NODE_NAME.$$"
if ! err=$( { printf 'ok\n' >"$probe" && rm -f "$probe"; } 2>&1); then
  die "$FSX is mounted but root cannot write to it: ${err:-write failed}"
fi
log "$FSX is writable"
