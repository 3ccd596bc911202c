#!/usr/bin/env bash
# Step "accounts" (controller only, and only with slurmAccounting=true): one Slurm account
# named after the cluster group, and an association (user, account) for every cluster user,
# so the accounting database knows who the platform's users are.
#
# Why: with an accounting database, Slurm's limits, fair-share and `sreport` work per
# association, and once AccountingStorageEnforce includes "associations" slurmctld refuses
# a job from a user with no association ("Invalid account or account/partition
# combination", slurm.conf(5) AccountingStorageEnforce; slurm.schedmd.com/accounting.html,
# "Database Configuration": "users must be added to the database ... before they can run
# jobs"). HyperPod writes the AccountingStorage* lines when the cluster has an
# AccountingDatabase (docs.aws.amazon.com/sagemaker/latest/dg/
# sagemaker-hyperpod-external-accounting-db-slurm.html); which Enforce flags it sets is
# HyperPod's choice, so the associations are created either way.
#
# sacctmgr(1): -i commits immediately; names are stored in lower case ("The contents of
# Slurm's database are maintained in lower case"); `show account` / `show assoc ... format=`
# with -n -P print one '|'-separated line per record and nothing for none. Every add is asked
# first, so a re-run (reboot, rollout) adds nothing and prints no error.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init
require_vars CFG_CLUSTER_GROUP CFG_SLURM_ACCOUNTING

if [[ $CFG_SLURM_ACCOUNTING != true ]]; then
  log "Slurm accounting is off (slurmAccounting=false): no associations to create"
  exit 0
fi
# HyperPod installs Slurm under /opt/slurm (see system.sh slurm_ping).
PATH="$PATH:/opt/slurm/bin"
has_tool sacctmgr \
  || die "sacctmgr is not installed on the controller although slurmAccounting=true; HyperPod installs it with Slurm under /opt/slurm/bin"

# sacctmgr talks to slurmdbd, which can come up after slurmctld: wait for it with a bound.
wait_s=${LIFECYCLE_SLURM_WAIT_S:-300} poll_s=${LIFECYCLE_SLURM_POLL_S:-5}
deadline=$((SECONDS + wait_s))
until out=$(sacctmgr -n -P show cluster format=cluster 2>&1); do
  remaining=$((deadline - SECONDS))
  ((remaining > 0)) \
    || die "slurmdbd does not answer sacctmgr after ${wait_s}s ($(printf '%s\n' "$out" | tail -n 1)); check the AccountingDatabase endpoint and secret, and \`journalctl -u slurmdbd\` on this node"
  log "waiting for slurmdbd (sacctmgr: $(printf '%s\n' "$out" | tail -n 1); ${remaining}s left)"
  sleep $((remaining < poll_s ? remaining : poll_s))
done

account=${CFG_CLUSTER_GROUP,,}
if [[ -z $(sacctmgr -n -P show account where name="$account" format=account) ]]; then
  sacctmgr -i add account name="$account" description="Sana platform cluster users" organization="$account" >/dev/null
  log "added Slurm account $account"
fi

read -r -a specs <<<"${CFG_CLUSTER_USERS:-}"
added=() present=()
for spec in "${specs[@]}"; do
  user=${spec%%:*}
  user=${user,,}
  if [[ -n $(sacctmgr -n -P show assoc where user="$user" account="$account" format=user) ]]; then
    present+=("$user")
    continue
  fi
  sacctmgr -i add user name="$user" account="$account" defaultaccount="$account" >/dev/null
  added+=("$user")
done
log "account $account: added ${added[*]:-nobody}; already there: ${present[*]:-nobody}"
