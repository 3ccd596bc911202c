# shellcheck shell=bash
# Thin wrappers, one per command that only works on a real HyperPod node. Each is the one
# command line and nothing else: the tests put small stand-ins for these commands first on
# PATH (tests/lifecycle/lifecycle_cluster.py says what each stand-in stands for).

# This node's IPv4 addresses, space separated (HyperPod's resource config names a node
# only by its CustomerIpAddress, so the node finds its group through these).
node_addresses() {
  hostname -I
}

# "FSTYPE OPTIONS" of each file system mounted exactly at $1, one line each, the first mounted
# first (an automount's autofs line before the file system it mounts); fails when nothing is.
mount_info() {
  findmnt --noheadings --output FSTYPE,OPTIONS --mountpoint "$1"
}

# Does the NVIDIA driver answer? One line per GPU.
gpu_list() {
  nvidia-smi --list-gpus
}

# Does the Neuron driver answer? The Neuron tools live in /opt/aws/neuron/bin on the
# HyperPod Trainium AMI, which is not on a lifecycle script's PATH.
neuron_list() {
  PATH="$PATH:/opt/aws/neuron/bin" neuron-ls
}

# has_tool NAME: is NAME installed (looking where the AMI puts the Neuron tools too)?
has_tool() {
  PATH="$PATH:/opt/aws/neuron/bin" command -v "$1" >/dev/null 2>&1
}

# unit_state UNIT: the systemd unit's state on stdout (active, activating, inactive, failed,
# ...); exit status 0 only when it is active (systemctl(1), is-active). Only ever asked:
# the lifecycle never starts, stops or restarts a unit HyperPod owns (the Slurm daemons).
unit_state() {
  systemctl is-active "$1"
}

# slurm_ping: does slurmctld answer this node's Slurm client? `scontrol ping` prints
# "Slurmctld(primary) at <host> is UP|DOWN" and exits non-zero when it is down. HyperPod
# installs Slurm under /opt/slurm (LifecycleScripts/base-config/start_slurm.sh edits
# /opt/slurm/etc/slurm.conf), which may not be on a lifecycle script's PATH.
slurm_ping() {
  PATH="$PATH:/opt/slurm/bin" scontrol ping
}

# apt_install PACKAGE...: install Debian packages (only used when the AMI lacks one).
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300 update \
    && DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends "$@"
}

# s3_download_prefix S3_PREFIX DIR REGION: every object under the prefix into DIR (keys relative to
# it), with the AWS CLI of the HyperPod AMIs (AWS's reference lifecycle scripts call `aws s3 cp` and
# `aws ecr` on the nodes without installing it: awslabs/awsome-distributed-ai 1.architectures/
# 5.sagemaker-hyperpod/LifecycleScripts/base-config/observability/install_node_exporter.sh). The
# region is explicit: a private subnet reaches S3 only through the gateway endpoint of its own
# region, not the global endpoint the CLI would try without one.
s3_download_prefix() {
  aws s3 cp --recursive --only-show-errors --no-progress --region "$3" "$1" "$2"
}

# s3_download_object S3_URI FILE REGION: one object to FILE (a missing key fails: the CLI's
# "fatal error: An error occurred (404) when calling the HeadObject operation: Key ... does not exist").
s3_download_object() {
  aws s3 cp --only-show-errors --no-progress --region "$3" "$1" "$2"
}
