#!/usr/bin/env bash
# Step "imds": only root and the node's system services may reach the EC2 instance metadata
# service (IMDS), so no cluster user, job or container can take the node's credentials (the
# execution role: the platform's buckets and key, stacks/cluster.py ExecutionRole).
#
# AWS documents exactly this control: "Limit access to the Instance Metadata Service"
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-limiting-access.html)
# uses iptables' owner module on OUTPUT, a deny rule `--match owner --uid-owner <user> --jump
# REJECT`, or, "easier to manage from a security perspective", allow rules that name who may
# reach 169.254.169.254; and it names the IPv6 endpoint [fd00:ec2::254] next to it. This step
# uses allow rules, for IPv4 and IPv6, in a chain of its own:
#
#   OUTPUT   -d 169.254.169.254/32 -j SANA-IMDS        (inserted first; ip6tables: fd00:ec2::254/128)
#   SANA-IMDS  -m owner --uid-owner 0 -j RETURN        root: HyperPod's agents, SSM, this lifecycle
#              -m owner --uid-owner <uid> -j RETURN    each IMDS_SERVICE_ACCOUNTS account present
#              -j REJECT                               everyone else: refused at once, no timeout
#
# Containers included: pyxis/enroot containers share the host's network namespace and run as
# the submitting user (a user namespace maps "root" inside to that UID outside), and the owner
# match tests the socket's UID as the host kernel sees it (iptables-extensions(8), "owner":
# "the effective UID of the process that created the socket", a kernel UID).
# Docker containers sit behind a bridge and reach IMDS through FORWARD, not OUTPUT; only root
# (and the docker group, i.e. root) can start one, and cluster users are in neither.
#
# Non-root accounts that may keep IMDS (IMDS_SERVICE_ACCOUNTS, when the node has them):
#   slurm    SlurmUser of HyperPod's Slurm daemons (awslabs/awsome-distributed-ai,
#            1.architectures/5.sagemaker-hyperpod/LifecycleScripts/base-config/setup_rds_accounting.sh
#            writes SlurmUser=slurm); HyperPod's own Slurm integration runs inside them.
#   cwagent  the CloudWatch agent's account when its config runs it as non-root.
# Neither is a cluster user (stacks/config.py RESERVED_NAMES refuses both names), and no user can
# act as either.
#
# Persistence: netfilter rules do not survive a reboot (HyperPod reboots faulty nodes under
# nodeRecovery=Automatic without running the lifecycle again), so the rules are written into
# a root-only script on the node's own disk, /usr/local/sbin/sana-imds-block, run now and by a
# oneshot unit at every boot before the network comes up, ordered as Debian's
# netfilter-persistent.service orders its rules (DefaultDependencies=no, Before=network-pre.target).
# The unit is enabled by its wants link, as `systemctl enable` makes it (systemd.unit(5),
# "[Install]"): the lifecycle never calls systemctl to change units. Re-running converges: the
# chain is declared in one iptables-restore transaction (a declared chain is flushed and
# refilled atomically), and the OUTPUT jump is added only when `iptables -C` does not find it.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init

readonly IMDS_V4=169.254.169.254/32 IMDS_V6=fd00:ec2::254/128 CHAIN=SANA-IMDS
readonly IMDS_SERVICE_ACCOUNTS=(slurm cwagent)
APPLY=${PLATFORM_ROOT}/usr/local/sbin/sana-imds-block
UNIT_DIR=${PLATFORM_ROOT}/etc/systemd/system
UNIT=sana-imds-block.service

{ command -v iptables && command -v iptables-restore; } >/dev/null 2>&1 \
  || die "iptables is not installed on this node; it is part of every Ubuntu server image (the HyperPod AMI's base): without it any user could take the node's credentials from the instance metadata service"

# The UIDs that keep IMDS: root, and each service account this node has (its local passwd).
allowed=(0)
for account in "${IMDS_SERVICE_ACCOUNTS[@]}"; do
  uid=$(awk -F: -v n="$account" '$1 == n { print $3; exit }' "${PLATFORM_ROOT}/etc/passwd")
  [[ -n $uid ]] && allowed+=("$uid")
done

# IPv6: ip6tables too, unless the kernel has no IPv6 at all (then there is no IPv6 endpoint).
families=(iptables)
if command -v ip6tables >/dev/null 2>&1 && command -v ip6tables-restore >/dev/null 2>&1; then
  families+=(ip6tables)
elif [[ -e /proc/net/if_inet6 ]]; then
  die "IPv6 is enabled on this node but ip6tables is not installed; the IMDS IPv6 endpoint [fd00:ec2::254] would stay open to every user"
else
  log "WARNING: no IPv6 on this node and no ip6tables: only the IPv4 endpoint is blocked"
fi

render_apply() {
  local family dst uid
  echo '#!/bin/bash'
  echo '# Written by the Sana platform lifecycle (lifecycle_scripts/imds_block.sh): only root and'
  echo '# the listed system accounts may reach the EC2 instance metadata service. Run at boot by'
  echo "# $UNIT; safe to run again (converges)."
  echo 'set -euo pipefail'
  for family in "${families[@]}"; do
    dst=$IMDS_V4
    [[ $family == ip6tables ]] && dst=$IMDS_V6
    echo "$family-restore --wait 30 --noflush <<'RULES'"
    echo '*filter'
    echo ":$CHAIN - [0:0]"
    for uid in "${allowed[@]}"; do echo "-A $CHAIN -m owner --uid-owner $uid -j RETURN"; done
    echo "-A $CHAIN -j REJECT"
    echo 'COMMIT'
    echo 'RULES'
    echo "$family --wait 30 -C OUTPUT -d $dst -j $CHAIN 2>/dev/null || $family --wait 30 -I OUTPUT 1 -d $dst -j $CHAIN"
  done
}

render_unit() {
  cat <<EOF
# Written by the Sana platform lifecycle (lifecycle_scripts/imds_block.sh).
[Unit]
Description=Sana platform: only root and system services may reach the EC2 instance metadata service
DefaultDependencies=no
Before=network-pre.target
Wants=network-pre.target
After=local-fs.target systemd-modules-load.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=${APPLY#"$PLATFORM_ROOT"}

[Install]
WantedBy=multi-user.target
EOF
}

mkdir -p "$(dirname "$APPLY")" "$UNIT_DIR/multi-user.target.wants"
render_apply | write_atomically "$APPLY" 0700
render_unit | write_atomically "$UNIT_DIR/$UNIT" 0644
ln -sfn "../$UNIT" "$UNIT_DIR/multi-user.target.wants/$UNIT"

if ! out=$(bash "$APPLY" 2>&1); then
  die "installing the IMDS rules failed: $(printf '%s' "$out" | tail -n 1)"
fi
# Read back what the kernel now has: the REJECT must be the chain's last rule.
for family in "${families[@]}"; do
  rules=$("$family" --wait 30 -S "$CHAIN" 2>&1) || die "$family -S $CHAIN failed: $rules"
  [[ $(printf '%s\n' "$rules" | tail -n 1) == "-A $CHAIN -j REJECT"* ]] \
    || die "$family chain $CHAIN does not end in REJECT after installing it: $(printf '%s' "$rules" | tr '\n' ' ')"
done
log "IMDS (${families[*]}) reachable only by uid ${allowed[*]}; rules in ${APPLY#"$PLATFORM_ROOT"}, reapplied at boot by $UNIT"
