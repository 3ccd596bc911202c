#!/usr/bin/env bash
# Late check "accounts" (slurm_ready.sh on the controller, once slurmctld is up): one Slurm
# account named after the cluster group, and an association (user, account) for every cluster
# user, wherever this cluster has an accounting database. Optional: a failure is a WARN line in
# the controller's status file.
#
# Why: with an accounting database, Slurm's limits, fair-share and `sreport` work per
# association, and once AccountingStorageEnforce includes "associations" slurmctld refuses
# a job from a user with no association ("Invalid account or account/partition
# combination", slurm.conf(5) AccountingStorageEnforce; slurm.schedmd.com/accounting.html,
# "Database Configuration": "users must be added to the database ... before they can run
# jobs"). AWS's add-users extension registers every user for the same reason
# (awslabs/awsome-distributed-ai 1.architectures/5.sagemaker-hyperpod/Extensions/add-users/
# setup_slurm_accounts.sh, "so they can submit jobs").
#
# Which clusters: not only slurmAccounting=true. "By default, SageMaker HyperPod deploys
# MariaDB on your cluster's controller instance, so accounting works with no database for you
# to manage" (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-external-accounting-db-slurm.html);
# slurmAccounting=true only moves it to Aurora. So the running slurmctld says: `scontrol show
# config` prints AccountingStorageType (slurm.conf(5)); accounting_storage/slurmdbd means a
# database to register with, accounting_storage/none means nothing to do.
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
require_vars CFG_CLUSTER_GROUP

# HyperPod installs Slurm under /opt/slurm (see system.sh slurm_ping).
PATH="$PATH:/opt/slurm/bin"
config=$(scontrol show config 2>&1) \
  || die "scontrol show config failed on the controller ($(printf '%s' "$config" | tail -n 1)); cannot tell whether accounting is configured"
storage=$(awk -F= '$1 ~ /^AccountingStorageType *$/ { gsub(/ /, "", $2); print $2 }' <<<"$config")
enforce=$(awk -F= '$1 ~ /^AccountingStorageEnforce *$/ { gsub(/ /, "", $2); print $2 }' <<<"$config")
if [[ $storage != accounting_storage/slurmdbd ]]; then
  log "no accounting database (AccountingStorageType=${storage:-unset}): no associations to create"
  exit 0
fi
log "accounting database configured (AccountingStorageType=$storage, AccountingStorageEnforce=${enforce:-none})"
has_tool sacctmgr \
  || die "sacctmgr is not installed on the controller although AccountingStorageType=$storage; HyperPod installs it with Slurm under /opt/slurm/bin"

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
