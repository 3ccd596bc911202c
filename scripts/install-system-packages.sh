#!/usr/bin/env bash
# Installs the Debian packages the tests drive for real: Slurm daemons + munge
# (job-script tests), MariaDB + slurmdbd (Slurm accounting: the fixture runs slurmdbd on a
# private MariaDB and the tests read jobs back with sacct), gcc (the Slurm fixture compiles a
# small SPANK plugin standing in for HyperPod's --auto-resume option) and shellcheck; and what
# the image test builds and runs a training image with (tests/containers): mmdebstrap (the
# Debian minbase base image), buildah + podman (the builders, chroot isolation) and
# squashfs-tools (mksquashfs/unsquashfs with enroot's options); iptables + iproute2: the IMDS
# test (tests/lifecycle/test_imds_block.py) installs the lifecycle's real iptables rules inside
# network namespaces of its own (`ip netns`); systemd (the lifecycle tests enable the platform's
# unit with the real `systemctl --root`), make and curl (the containers step builds and downloads
# its stand-in release files over file://); sudo, for its visudo (the lifecycle checks the admins'
# sudoers entry with it, tests/lifecycle/test_lifecycle_users.py); Prometheus, its node exporter
# and Alertmanager (tests/observability: a real Prometheus scrapes a training run and receives the
# collector's remote writes, promtool tests the alert rules and dashboard queries, amtool the alert
# manager configuration; tests/lifecycle reads the EFA/Lustre textfile through the node exporter).
# These are test-only: `make synth/audit/deploy` need none of them. Skips apt entirely when all are
# present.
set -euo pipefail

readonly PACKAGES=(slurm-wlm munge mariadb-server slurmdbd gcc make shellcheck mmdebstrap buildah podman squashfs-tools
  iptables iproute2 systemd curl sudo prometheus prometheus-node-exporter prometheus-alertmanager)

all_present() {
  local tool
  for tool in slurmctld slurmd munged mariadbd mariadb-install-db slurmdbd sacct shellcheck cc \
    mmdebstrap buildah podman mksquashfs unsquashfs iptables ip6tables iptables-restore ip make systemctl curl visudo \
    prometheus promtool prometheus-node-exporter amtool; do
    command -v "$tool" >/dev/null || return 1
  done
}

install_packages() {
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "install-system-packages: installing ${PACKAGES[*]}"
  $sudo apt-get update -qq
  # mariadb-server's postinst starts the system MariaDB where an init system runs; the tests
  # use their own instance (own datadir, socket and port), never that one.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

if all_present; then
  echo "install-system-packages: ${PACKAGES[*]} already installed"
else
  install_packages || { echo "install-system-packages: apt-get install ${PACKAGES[*]} failed" >&2; exit 1; }
fi
