#!/usr/bin/env bash
# Installs the Debian packages the tests drive for real: Slurm daemons + munge
# (job-script tests), gcc (the Slurm fixture compiles a small SPANK plugin standing in for
# HyperPod's --auto-resume option) and shellcheck. Skips apt entirely when all are present.
set -euo pipefail

readonly PACKAGES=(slurm-wlm munge gcc shellcheck)

all_present() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v munged >/dev/null && command -v shellcheck >/dev/null \
    && command -v cc >/dev/null
}

install_packages() {
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "install-system-packages: installing ${PACKAGES[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

if all_present; then
  echo "install-system-packages: ${PACKAGES[*]} already installed"
else
  install_packages || { echo "install-system-packages: apt-get install ${PACKAGES[*]} failed" >&2; exit 1; }
fi
