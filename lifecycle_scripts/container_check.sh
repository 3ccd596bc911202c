#!/usr/bin/env bash
# Late check "containers" (slurm_ready.sh, once this node's slurmd is up; gpu, trn and login
# nodes): is pyxis loaded by srun here? Any "no" is one line, which slurm_ready.sh turns into a
# WARN line in the status file; container jobs then fail on this node, nothing else does.
#
# Which plugstack.conf counts: the one in the config this node's Slurm uses. HyperPod runs
# slurmd configless on compute and login nodes ("slurmd pulls slurm.conf (and cgroup.conf,
# gres.conf, plugstack.conf) from the controller at boot and caches them in
# /var/spool/slurmd/conf-cache/"; "There is no slurm.conf on disk under /opt/slurm/etc/ on
# compute or login", awslabs/awsome-distributed-ai 1.architectures/5.sagemaker-hyperpod/
# tools/devops-agent/docs/hyperpod-mental-model.md). So: <SlurmdSpoolDir>/conf-cache, else
# /opt/slurm/etc (a node with a local config). The controller's containers step registers pyxis
# there and runs `scontrol reconfigure`, which sends the new file to running slurmds; a node
# whose slurmd fetched its config before that gets it within moments, so the registration is
# waited for (LIFECYCLE_PYXIS_WAIT_S, default 300 s).
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=SCRIPTDIR/system.sh
source "$(dirname "${BASH_SOURCE[0]}")/system.sh"
step_init

conf_dir=""
for dir in "${PLATFORM_ROOT}/var/spool/slurmd/conf-cache" "${PLATFORM_ROOT}/opt/slurm/etc"; do
  if [[ -f $dir/slurm.conf ]]; then conf_dir=$dir; break; fi
done
[[ -n $conf_dir ]] \
  || die "no Slurm config on this node (neither /var/spool/slurmd/conf-cache/slurm.conf, configless, nor /opt/slurm/etc/slurm.conf): slurmd has not fetched it from the controller"
plugstack="$conf_dir/plugstack.conf"

# registered_pyxis: the spank_pyxis.so path plugstack.conf (or a file it includes) registers.
# plugstack.conf(5): "required|optional PLUGIN [ARGS]" lines and "include GLOB" lines; configless
# ships only the includes named without a path, next to slurm.conf (Slurm configless_slurm.html,
# "Limitations"), which is where a bare name is looked for here.
registered_pyxis() {
  [[ -r $plugstack ]] || return 1
  local pattern='^[[:space:]]*(required|optional)[[:space:]]+[^[:space:]]*spank_pyxis\.so'
  local files=("$plugstack") inc
  while read -r inc; do
    if [[ $inc == */* ]]; then
      # shellcheck disable=SC2206 # an include is a glob (plugstack.conf(5))
      files+=(${PLATFORM_ROOT}$inc)
    else
      files+=("$conf_dir/$inc")
    fi
  done < <(sed -n 's/^[[:space:]]*include[[:space:]]\+\([^[:space:]]*\).*/\1/p' "$plugstack")
  grep -hsE "$pattern" "${files[@]}" | head -n 1 | awk '{ print $2 }' | grep .
}

wait_s=${LIFECYCLE_PYXIS_WAIT_S:-300} poll_s=${LIFECYCLE_SLURM_POLL_S:-5}
deadline=$((SECONDS + wait_s))
until plugin=$(registered_pyxis); do
  remaining=$((deadline - SECONDS))
  if ((remaining <= 0)); then
    die "pyxis is not registered in $plugstack (the config this node's Slurm uses) after ${wait_s}s; the controller's containers step registers it: see the controller's status file"
  fi
  log "waiting for pyxis in $plugstack (${remaining}s left)"
  sleep $((remaining < poll_s ? remaining : poll_s))
done
[[ $plugin != /* || -f ${PLATFORM_ROOT}$plugin ]] \
  || die "$plugstack registers $plugin, which is not on this node; the containers step installs it (see this node's provisioning log)"
# HyperPod installs Slurm under /opt/slurm (see system.sh slurm_ping), not on PATH here.
if ! help=$(PATH="$PATH:/opt/slurm/bin" srun --help 2>&1); then
  die "srun --help failed on this node: $(printf '%s' "$help" | tail -n 1)"
fi
grep -q -- '--container-image' <<<"$help" \
  || die "srun --help does not list --container-image: srun does not load $plugin (registered in $plugstack); check that it was built for this node's Slurm"
log "pyxis $plugin registered in $plugstack and loaded by srun (--container-image)"
