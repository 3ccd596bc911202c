#!/usr/bin/env bash
# Step "sync": install sana-settings.timer, which keeps this node's accounts in line with the
# package the cluster serves ($FSX/platform/current, moved only by a rollout).
#
# Why a timer: HyperPod runs lifecycle scripts only on nodes it creates ("The UpdateCluster API
# only runs the lifecycle scripts for new instance groups",
# https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-lifecycle-best-practices-slurm-slurm-update-cluster-lifecycle.html),
# and a rollout job runs on one node per accelerator partition, while users and admins live in
# every node's own /etc/passwd, /etc/group and /etc/sudoers.d (the controller's Slurm
# associations too). So every node applies the settings of `current` itself: the timer starts
# sana-settings.service ~30 s after this step and every 2 minutes after that
# (systemd.timer(5): OnActiveSec= "relative to the moment the timer unit itself is activated",
# OnUnitActiveSec= "relative to when the unit the timer unit is activating was last activated");
# the service runs settings_sync.sh from the current package, which does nothing while the
# package it last applied is still current. A new user therefore reaches every running node
# within minutes of the rollout that made their settings current (runbooks/users.md).
#
# As for sana-node-ready.service (readiness.sh), the new units must take effect in the running
# systemd: daemon-reload, enable (WantedBy=timers.target: started at every boot) and start of
# the platform's own timer; no unit HyperPod owns is touched.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX CFG_FSX_MOUNT CFG_PACKAGE_HASH NODE_NAME

SERVICE=sana-settings.service
TIMER=sana-settings.timer
unit_dir="${PLATFORM_ROOT}/etc/systemd/system"
mkdir -p "$unit_dir"

# The node's own path of the current package's script (no test prefix): a rollout that moves
# `current` moves the code the service runs with it.
cat <<UNITFILE | write_atomically "$unit_dir/$SERVICE" 0644
# Written by the Sana platform lifecycle (lifecycle_scripts/settings_timer.sh).
[Unit]
Description=Sana platform: apply the users and admins of the current package on this node
After=remote-fs.target

[Service]
Type=oneshot
ExecStart=/bin/bash $CFG_FSX_MOUNT/platform/current/lifecycle/settings_sync.sh
TimeoutStartSec=15min
UNITFILE
cat <<UNITFILE | write_atomically "$unit_dir/$TIMER" 0644
# Written by the Sana platform lifecycle (lifecycle_scripts/settings_timer.sh).
[Unit]
Description=Sana platform: apply the settings of each rolled-out package on this node

[Timer]
OnActiveSec=30s
OnUnitActiveSec=2min

[Install]
WantedBy=timers.target
UNITFILE

# The boot's users step applied this node's own settings; when they are the current package's,
# there is nothing left for the first run to do.
serving=$(readlink "$FSX/platform/current" 2>/dev/null || true)
if [[ $serving == "$CFG_PACKAGE_HASH" ]]; then
  printf '%s\n' "$serving" | write_atomically "$STATE_DIR/settings-applied" 0644
fi

out=""
out=$(systemctl daemon-reload 2>&1 && systemctl enable "$TIMER" 2>&1 && systemctl start "$TIMER" 2>&1) \
  || die "cannot enable and start $TIMER ($(printf '%s' "$out" | tail -n 1)); users added later would not reach this node"
log "$TIMER started: this node applies the settings of $CFG_FSX_MOUNT/platform/current within 2 minutes of each rollout (applied now: ${serving:-none})"
