"""Helpers for tests/lifecycle (named uniquely: several test dirs have a conftest.py).

A pretend HyperPod cluster on this machine for running lifecycle_scripts/on_init_complete.sh
for real.

Each node gets its own root filesystem (a temp dir passed as PLATFORM_ROOT) whose `fsx`
is a symlink to one shared directory, the way every node sees the same FSx for Lustre.
What HyperPod puts on a node is rebuilt here, each from its source (cited where it is built):
the downloaded lifecycle prefix (a copy of lifecycle_scripts/ + platform-settings.json + a
small training/ package), /opt/ml/config/resource_config.json, the AMI's local account files
(/etc/passwd, group, shadow, gshadow; the users step edits them with the real
useradd/groupadd --prefix) with the `ssm-user` the SSM agent adds, the controller's Slurm
config under /opt/slurm/etc (compute and login nodes have none: configless), the node's Slurm
headers under /opt/slurm/include, its local disks (/proc/mounts, dlami-nvme.service) and no
enroot or pyxis. HyperPod starts the node's Slurm daemon before, during or after
OnInitComplete (`Cluster.start_daemon`, node_model.py: a configless slurmd fetches its config
from the controller, then systemd runs the units that want the daemon).

Commands that only work on a real node are replaced by stand-ins first on PATH (see
STANDINS); everything else (bash, python3 -m venv, pip, flock, cp, mv, useradd, groupadd, usermod,
ssh-keygen, curl, dpkg-deb, tar, make, cc, systemctl --root) is the real thing.
The training package's requirements name local stand-in wheels called `torch` and
`torch_xla` and `torch_neuronx`, so the env build runs real venv + pip offline (PIP_NO_INDEX) in seconds and the
readiness check's production `import torch` / `import torch, torch_xla, torch_neuronx` imports them.
The container runtime is installed from local stand-ins of NVIDIA's release files
(`container_sources`: enroot .debs built with dpkg-deb, a pyxis source archive of
standin_pyxis/), fetched over file:// by the real install logic.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import node_model
from standin_network import AWS as _AWS
from standin_network import CURL as _CURL
from standin_network import DOCKER as _DOCKER

from tests.release_standins import publish_agent_releases as observability_sources  # noqa: F401 - the tests' name

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "lifecycle_scripts"

# What each stand-in stands for; each records its call in $STANDIN_LOG.
STANDINS = {
    # `hostname -I` on a node: its IP addresses. Here: the address the test gives the node.
    "hostname": 'if [ "$1" = "-I" ]; then echo "$STANDIN_NODE_IPS"; else echo standin-host; fi',
    # `findmnt --mountpoint DIR` on a node: every file system mounted at DIR, the first mounted
    # first. FSx mounted with x-systemd.automount, as AWS's own mount_fsx.sh does
    # (awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/LifecycleScripts/
    # base-config/mount_fsx.sh, opts=...,x-systemd.automount,...), lists systemd's autofs line,
    # then the lustre one. Here: mounted when DIR exists (the test creates the node's fsx link or
    # not); $PLATFORM_ROOT/run/standin-fsx-mount, when present, replaces the listing.
    "findmnt": ('for a; do dir=$a; done\n[ -d "$dir" ] || exit 1\n'
                'if [ -f "$PLATFORM_ROOT/run/standin-fsx-mount" ]; then cat "$PLATFORM_ROOT/run/standin-fsx-mount"; exit 0; fi\n'
                'echo "autofs     rw,relatime,fd=5,pgrp=1,timeout=0,minproto=5,maxproto=5,direct,pipe_ino=2123"\n'
                'echo "lustre     rw,relatime,flock,lazystatfs"'),
    # nvidia-smi on a p5: the driver answers with one line per GPU.
    "nvidia-smi": 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-standin-0)"',
    # neuron-ls on a trn1: the Neuron driver answers with its device table.
    "neuron-ls": 'echo "instance-type: trn1.32xlarge (standin)"',
    # apt-get on a node: `update` works; `install` of a local .deb unpacks it into the node's
    # root (what dpkg does with its files; real dpkg-deb), of a package named in
    # $STANDIN_APT_AVAILABLE (the AMI's repositories) succeeds, of anything else fails as
    # apt-get does (exit 100). Tests never install anything on this machine.
    "apt-get": ('case " $* " in *" install "*) ;; *) exit 0;; esac\n'
                'after=; for a; do\n'
                '  if [ -z "$after" ]; then [ "$a" = install ] && after=1; continue; fi\n'
                '  case $a in -*) continue;; *.deb) dpkg-deb -x "$a" "$PLATFORM_ROOT" || exit 100;'
                ' echo "Unpacking $(basename "$a") (stand-in)";;\n'
                '  *) case " $STANDIN_APT_AVAILABLE " in *" $a "*) echo "Setting up $a (stand-in)";;'
                ' *) echo "E: Unable to locate package $a (stand-in)" >&2; exit 100;; esac;;\n'
                '  esac\ndone'),
    # `systemctl` on a node. is-active UNIT: prints the state, exit 0 only when "active", else
    # 3 (systemctl(1)); here the state is what HyperPod (the test) put in
    # $PLATFORM_ROOT/run/standin-units/UNIT.{active,activating}, else inactive.
    # show UNIT --property=...: LoadState/ActiveState/ExecMainStatus from
    # run/standin-units/UNIT.show (a unit that is not there: LoadState=not-found).
    # enable/disable/is-enabled: the real systemctl on the node's root (--root), which makes
    # the [Install] links. daemon-reload: nothing to reload (no manager here).
    # start --no-block sana-*: queued, run on its own (node_model.py); start sana-*.timer: the
    # timer is armed, its service runs when the test fires it (node_model.fire_timer). Every other verb fails:
    # the lifecycle must never start, stop or restart the units HyperPod owns.
    "systemctl": ('verb=$1; for unit; do :; done\n'
                  'case $verb in\n'
                  '  is-active) m="$PLATFORM_ROOT/run/standin-units/${unit%.service}"\n'
                  '    if [ -f "$m.active" ]; then echo active; exit 0; fi\n'
                  '    if [ -f "$m.activating" ]; then echo activating; exit 3; fi\n'
                  '    echo inactive; exit 3;;\n'
                  '  show) f="$PLATFORM_ROOT/run/standin-units/${unit%.service}.show"\n'
                  '    if [ -f "$f" ]; then cat "$f"; else printf "LoadState=not-found\\nActiveState=inactive\\nExecMainStatus=0\\n"; fi;;\n'
                  '  enable|disable|is-enabled) exec /usr/bin/systemctl --root="$PLATFORM_ROOT" "$@";;\n'
                  '  daemon-reload) ;;\n'
                  '  start) case $unit in sana-*) exec python3 "$STANDIN_NODE_MODEL" start-unit "$PLATFORM_ROOT" "$unit";; esac\n'
                  '    echo "systemctl start $unit: refused by the stand-in (HyperPod owns it)" >&2; exit 1;;\n'
                  # restart of the platform's own long-running units (the observability step's
                  # exporters, Type=exec): systemd fails the job when ExecStart's program cannot be
                  # executed ("Failed to execute ...: No such file or directory", systemd.service(5)
                  # Type=exec); otherwise the unit runs (marked active here; no process is started).
                  '  restart) case $unit in sana-*) f="$PLATFORM_ROOT/etc/systemd/system/$unit"\n'
                  '      prog=$(sed -n "s/^ExecStart=\\([^ ]*\\).*/\\1/p" "$f" 2>/dev/null)\n'
                  # (the node's own file, or for /usr/bin and /bin this machine's: the AMI's base system)
                  '      found=; [ -n "$prog" ] && [ -x "$PLATFORM_ROOT$prog" ] && found=1\n'
                  '      case $prog in /usr/bin/*|/bin/*) [ -x "$prog" ] && found=1;; esac\n'
                  '      if [ -z "$found" ]; then\n'
                  '        echo "Job for $unit failed because of unavailable resources or another system error." >&2; exit 1; fi\n'
                  '      mkdir -p "$PLATFORM_ROOT/run/standin-units"; touch "$PLATFORM_ROOT/run/standin-units/${unit%.service}.active"; exit 0;; esac\n'
                  '    echo "systemctl restart $unit: refused by the stand-in (HyperPod owns it)" >&2; exit 1;;\n'
                  '  *) echo "systemctl $verb: refused by the stand-in (HyperPod owns the node\'s units)" >&2; exit 1;;\n'
                  'esac'),
    # `scontrol ping` on a node: "Slurmctld(primary) at <host> is UP", exit 0, or "... is DOWN"
    # and exit 1 (what Debian's scontrol 22.05 does against a controller that is not there).
    # Here: UP once the controller's slurmctld runs ($STANDIN_CLUSTER/controller-1/run/
    # standin-units/slurmctld.active). reconfigure (controller): slurmctld sends the changed
    # config files to every running slurmd (node_model.py push-config). show config: the
    # controller's slurm.conf as `Key = value` lines, as scontrol prints it, with HyperPod's
    # PrologFlags (Alloc,Contain; $STANDIN_PROLOG_FLAGS stands for another), wherever it is asked.
    "scontrol": ('ctld="$STANDIN_CLUSTER/controller-1"\n'
                 'case $1 in\n'
                 '  ping) if [ -f "$ctld/run/standin-units/slurmctld.active" ]; then\n'
                 '      echo "Slurmctld(primary) at controller-1 is UP"; exit 0; fi\n'
                 '    echo "Slurmctld(primary) at controller-1 is DOWN"; exit 1;;\n'
                 '  reconfigure) [ -f "$ctld/run/standin-units/slurmctld.active" ] || { echo "slurm_reconfigure error: Unable to contact slurm controller" >&2; exit 1; }\n'
                 '    exec python3 "$STANDIN_NODE_MODEL" push-config "$STANDIN_CLUSTER" controller-1;;\n'
                 '  show) [ "$2" = config ] || exit 1\n'
                 '    [ -f "$ctld/opt/slurm/etc/slurm.conf" ] && grep -v "^PrologFlags=" "$ctld/opt/slurm/etc/slurm.conf" \\\n'
                 '      | sed -n "s/^\\([A-Za-z]*\\)=\\(.*\\)/\\1 = \\2/p"\n'
                 '    echo "PrologFlags = ${STANDIN_PROLOG_FLAGS-Alloc,Contain}";;\n'
                 '  *) echo "scontrol $1: not stood in" >&2; exit 1;;\n'
                 'esac'),
    # sacctmgr talking to the controller's slurmdbd (HyperPod's default MariaDB accounting):
    # `show cluster|account|assoc ... format=` print matching records, `-i add account|user`
    # records them, in $PLATFORM_ROOT/run/standin-accounting (the real sacctmgr against a real
    # slurmdbd is tests/slurm/test_accounting.py).
    "sacctmgr": ('db="$PLATFORM_ROOT/run/standin-accounting"; touch "$db"\n'
                 'case " $* " in\n'
                 '  *" show cluster "*) echo sana-test;;\n'
                 '  *" show account "*) for a; do case $a in name=*) grep -x "account ${a#name=}" "$db" | cut -d" " -f2;; esac; done;;\n'
                 '  *" show assoc "*) u=; ac=; for a; do case $a in user=*) u=${a#user=};; account=*) ac=${a#account=};; esac; done\n'
                 '    grep -x "assoc $u $ac" "$db" | cut -d" " -f2;;\n'
                 '  *" add account "*) for a; do case $a in name=*) echo "account ${a#name=}" >>"$db";; esac; done;;\n'
                 '  *" add user "*) u=; ac=; for a; do case $a in name=*) u=${a#name=};; account=*) ac=${a#account=};; esac; done\n'
                 '    echo "assoc $u $ac" >>"$db";;\n'
                 '  *) echo "sacctmgr $*: not stood in" >&2; exit 1;;\n'
                 'esac'),
    # srun --help on a node lists pyxis's --container-image only when srun loads the plugin:
    # the plugstack.conf of the config this node uses (configless: the conf-cache; else
    # /opt/slurm/etc) names a spank_pyxis.so, directly or in an include next to it, that exists
    # on the node (an `optional` plugin that is missing is skipped, plugstack.conf(5)).
    "srun": ('[ "$1" = --help ] || { echo "srun $1: not stood in" >&2; exit 1; }\n'
             'echo "Usage: srun [OPTIONS...]"\n'
             'conf="$PLATFORM_ROOT/var/spool/slurmd/conf-cache"; [ -f "$conf/slurm.conf" ] || conf="$PLATFORM_ROOT/opt/slurm/etc"\n'
             'files="$conf/plugstack.conf"\n'
             'for inc in $(sed -n "s/^ *include *//p" "$conf/plugstack.conf" 2>/dev/null); do\n'
             '  case $inc in */*) files="$files $PLATFORM_ROOT$inc";; *) files="$files $conf/$inc";; esac; done\n'
             'for so in $(cat $files 2>/dev/null | sed -n "s/^ *\\(required\\|optional\\) *\\([^ ]*spank_pyxis.so\\).*/\\2/p"); do\n'
             '  if [ -f "$PLATFORM_ROOT$so" ]; then echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"; break; fi; done'),
    # `aws s3 cp --recursive --region R s3://BUCKET/PREFIX DIR` on a node (system.sh s3_download_prefix):
    # every object under the prefix into DIR, keys relative to it, and exit 0 when there is none (AWS
    # CLI Command Reference, s3 cp). `aws s3 cp --region R s3://BUCKET/KEY FILE` (s3_download_object):
    # that one object, or for a missing key the CLI's "fatal error: An error occurred (404) when calling
    # the HeadObject operation: Key "KEY" does not exist" and exit 1 (aws/aws-cli#6660 shows it). Here
    # bucket B is the directory $STANDIN_S3/B. A private subnet reaches S3 only through its own
    # region's gateway endpoint: any other region (or none, the CLI's us-east-1 default) gets the CLI's
    # connection error and exit 255, as a node would. `aws ecr get-login-password --region R`: a token
    # (the ECR endpoints of the node's region), the same connection error elsewhere.
    "aws": _AWS,
    # docker on a GPU node (HyperPod's AMI runs Docker). Global `--config DIR` (docker(1): where the
    # client keeps its configuration, default ~/.docker). `login --username AWS --password-stdin
    # REGISTRY`: a token on stdin is recorded in DIR/config.json's "auths" ("Login Succeeded"), none is
    # Docker's non-TTY refusal. `pull --quiet IMAGE`: the image line when the registry has IMAGE
    # ($STANDIN_DOCKER_IMAGES stands for what the registries hold), else Docker's "manifest unknown";
    # an ECR image without a login in the config is "no basic auth credentials" (the daemon's answer
    # when ECR gets no token, aws/amazon-vpc-cni-k8s#1217); in a private subnet
    # ($STANDIN_PRIVATE_SUBNET) a registry other than the node region's ECR is the daemon's timeout
    # ("net/http: request canceled while waiting for connection (Client.Timeout exceeded while
    # awaiting headers)", NVIDIA-NeMo/Speech#7354 for nvcr.io).
    "docker": _DOCKER,
    # curl on a node: the real one, except in a private subnet ($STANDIN_PRIVATE_SUBNET) for any URL
    # but file://, which fails the way curl fails where the route table has no route (the subnet's
    # router drops the SYNs): after --connect-timeout, once per attempt (1 + --retry), "curl: (28)
    # Failed to connect to <host> port 443 after <ms> ms: Timeout was reached", exit 28 (measured
    # with curl 7.88.1 in a network namespace whose OUTPUT chain drops the packets), here without
    # waiting; every attempt is recorded in $STANDIN_LOG as "curl-attempt <url>".
    "curl": _CURL,
}
# iptables / ip6tables on a node: the IMDS step's rules (lifecycle_scripts/imds_block.sh). Here a
# stand-in keeps them per node under $PLATFORM_ROOT/run/standin-netfilter: this machine's own
# firewall is never touched by a pretend node (tests/lifecycle/test_imds_block.py runs the real
# iptables inside a network namespace of its own). `-restore` keeps the chain it is given
# (declaring a chain flushes it, as the real one does), `-C`/`-I` the OUTPUT jump, `-S` lists.
_NETFILTER = ('d="$PLATFORM_ROOT/run/standin-netfilter"; mkdir -p "$d"; me=$(basename "$0"); fam=${me%-restore}\n'
              'case $me in *-restore) cat >"$d/$fam.rules"; exit 0;; esac\n'
              'for a; do case $a in -C) op=check;; -I) op=insert;; -S) op=list;; esac; done\n'
              'case ${op:-} in check) [ -f "$d/$fam.jump" ];; insert) echo jump >>"$d/$fam.jump";;\n'
              '  list) chain=$(for a; do :; done; echo "$a"); echo "-N $chain"; grep "^-A $chain " "$d/$fam.rules";;\n'
              '  *) echo "$me $*: not stood in" >&2; exit 2;; esac')
STANDINS.update({name: _NETFILTER for name in ("iptables", "ip6tables", "iptables-restore", "ip6tables-restore")})
# The test's clock: the real date, $STANDIN_CLOCK_OFFSET_S seconds later (a test stands for "10
# minutes later" without waiting them). On PATH only for a call that sets the offset.
CLOCK = 'exec /bin/date -d "@$(( $(/bin/date +%s) + ${STANDIN_CLOCK_OFFSET_S:-0} ))" "$@"'

# What HyperPod brings up on each role (Extended mode): the controller's slurmctld; slurmd on
# compute and login nodes (login nodes run a configless slurmd too: hyperpod-mental-model.md,
# "Runs on login nodes too"), where the login node's readiness is the client reaching slurmctld.
SLURM_DAEMON = {"controller": "slurmctld", "login": "slurmd", "gpu": "slurmd", "trn": "slurmd"}
SLURM_READY = {"controller": "slurmctld", "login": "slurmctld-reachable", "gpu": "slurmd", "trn": "slurmd"}
# The AMI's local accounts before the users step (Ubuntu's default user included). ssm-user is
# added by `add_ssm_user` with the real useradd.
BASE_ACCOUNTS = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
              "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\ndaemon:x:1:\nubuntu:x:1000:\nnogroup:x:65534:\n",
    "shadow": "root:*:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\nubuntu:!:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n",
    "gshadow": "root:*::\ndaemon:*::\nubuntu:!::\nnogroup:*::\n",
}
# The controller's slurm.conf, which HyperPod's cluster agent writes (hyperpod-mental-model.md:
# "Controller-side SlurmctldParameters=enable_configless lets workers/login fetch this file")
# with HyperPod's default accounting: "By default, SageMaker HyperPod deploys MariaDB on your
# cluster's controller instance" (docs.aws.amazon.com/sagemaker/latest/dg/
# sagemaker-hyperpod-external-accounting-db-slurm.html), i.e. slurmdbd storage.
CONTROLLER_SLURM_CONF = ("ClusterName=sana-test\nSlurmctldHost=controller-1\nSlurmctldParameters=enable_configless\n"
                         "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageEnforce=associations\n"
                         "PartitionName=gpu Nodes=gpu-[1-2]\nPartitionName=trn Nodes=trn-[1-2]\n")
# Local disks: the DLAMI mounts the instance-store NVMe at /opt/dlami/nvme from
# dlami-nvme.service (awsome-distributed-ai utils/install_enroot_pyxis.sh waits for it), and
# HyperPod the group's secondary EBS volume at /opt/sagemaker; the head nodes (m5) have no
# instance store.
MOUNTS = {"gpu": "/dev/nvme1n1 /opt/dlami/nvme ext4 rw 0 0\n/dev/nvme2n1 /opt/sagemaker xfs rw 0 0\n",
          "trn": "/dev/nvme1n1 /opt/dlami/nvme ext4 rw 0 0\n/dev/nvme2n1 /opt/sagemaker xfs rw 0 0\n",
          "login": "/dev/nvme1n1 /opt/sagemaker xfs rw 0 0\n", "controller": "/dev/nvme1n1 /opt/sagemaker xfs rw 0 0\n"}
DLAMI_NVME_DONE = "LoadState=loaded\nActiveState=active\nExecMainStatus=0\n"
# What the AMI's apt repositories offer the container step (the packages enroot runs with).
APT_AVAILABLE = "squashfs-tools parallel fuse-overlayfs squashfuse gcc make libc6-dev"
ENROOT_VERSION = "3.4.1"  # lifecycle_scripts/container_runtime.sh
STANDIN_DIR = Path(__file__).resolve().parent
USERS = {"researcher": 2001, "analyst": 2002}
SSHD_PAM = ("# PAM configuration for the Secure Shell service\n@include common-auth\naccount    required     pam_nologin.so\n"
            "@include common-account\nsession [success=ok ignore=ignore module_unknown=ignore default=bad] pam_selinux.so close\n"
            "@include common-session\n@include common-password\n")
GROUP = ("sana", 2000)
ADMIN_GROUP = ("sana-admin", 2999)
ADMINS = ("analyst",)  # cdk.json clusterAdmins: cluster users who may sudo

ROLES = {"controller": "controller", "login": "login", "gpu": "gpu", "trn": "trn"}
NODES = {  # instance name -> (group, CustomerIpAddress)
    "controller-1": ("controller", "10.1.0.10"),
    "login-1": ("login", "10.1.0.20"),
    "gpu-1": ("gpu", "10.1.1.1"),
    "gpu-2": ("gpu", "10.1.1.2"),
    "trn-1": ("trn", "10.1.2.1"),
    "trn-2": ("trn", "10.1.2.2"),
}
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) \[([\w-]+)\] (.*)$")


def settings(package_hash: str) -> dict:
    """platform-settings.json as the cluster stack writes it (stacks/config.py PlatformConfig.settings)."""
    return {
        "project": "sana", "cluster_name": "sana-test", "region": "eu-west-1",
        "fsx_mount": "/fsx",
        "groups": dict(ROLES),
        "data_bucket": "sana-data-test", "artefacts_bucket": "sana-artefacts-test",
        "lifecycle_bucket": "sagemaker-sana-lifecycle-test",
        "package_hash": package_hash,
        "neuron_pip_index": "https://pip.repos.neuron.amazonaws.com",
        "rendezvous_port": 29500,
        "envs": {"gpu": "/fsx/envs/gpu", "neuron": "/fsx/envs/neuron"},
        "cluster_group": {"name": GROUP[0], "gid": GROUP[1]},
        "cluster_users": [{"name": name, "uid": uid} for name, uid in USERS.items()],
        "cluster_admins": list(ADMINS),
        "admin_group": {"name": ADMIN_GROUP[0], "gid": ADMIN_GROUP[1]},
        "home_root": "/fsx/home",
        "slurm_accounting": False,
        "container_runtime": True,
        "private_network": False,
        "image_registry": "123456789012.dkr.ecr.eu-west-1.amazonaws.com",
        "wheelhouses": {},
    }


def resource_config() -> dict:
    """HyperPod's /opt/ml/config/resource_config.json for the six nodes."""
    groups: dict[str, list] = {}
    for i, (name, (group, ip)) in enumerate(NODES.items()):
        groups.setdefault(group, []).append({
            "InstanceName": name, "CustomerIpAddress": ip,
            "AgentIpAddress": f"172.16.0.{i + 1}", "InstanceId": f"i-0standin{i:08d}"})
    return {"ClusterConfig": {"ClusterName": "sana-test"},
            "InstanceGroups": [{"Name": g, "InstanceType": "ml.standin", "Instances": inst}
                               for g, inst in groups.items()]}


def make_standins(bin_dir: Path) -> Path:
    """Write the STANDINS into ``bin_dir`` (put first on PATH), plus this interpreter as the
    node's python3 / python3.11 (directly, not through a version-manager shim: ~50 ms a call)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in STANDINS.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\n[ -n "$STANDIN_LOG" ] && echo "{name} $*" >>"$STANDIN_LOG"\n{body}\n')
        path.chmod(0o755)
    (bin_dir / "clock").mkdir()
    (bin_dir / "clock/date").write_text(f"#!/bin/sh\n{CLOCK}\n")
    (bin_dir / "clock/date").chmod(0o755)
    real_python = Path(os.path.realpath(sys.executable))
    for name in ("python3", "python3.11"):
        (bin_dir / name).symlink_to(real_python)
    return bin_dir


def build_wheel(dist: Path, name: str, version: str = "0.0.0", *, requires: tuple[str, ...] = (),
                tag: str = "py3-none-any") -> Path:
    """A wheel whose module `name` says it is a stand-in (pip installs it offline), with the
    dependencies (METADATA Requires-Dist, PEP 508 markers allowed) and the tag given (PEP 427)."""
    info = f"{name}-{version}.dist-info"
    wheel = dist / f"{name}-{version}-{tag}.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/__init__.py", f'"""Stand-in for {name} in lifecycle tests."""\nSTANDIN = "{name}"\n')
        z.writestr(f"{info}/METADATA", metadata)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: sana-tests\n"
                                    f"Root-Is-Purelib: {'true' if tag.endswith('-none-any') else 'false'}\nTag: {tag}\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return wheel


def build_deb(dist: Path, package: str, version: str, files: dict[str, tuple[str, int]]) -> Path:
    """A Debian package built with the real dpkg-deb (what NVIDIA's enroot releases are)."""
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    tree = dist / f"{package}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(f"Package: {package}\nVersion: {version}\nArchitecture: {arch}\n"
                                         f"Maintainer: sana tests <tests@example.invalid>\n"
                                         f"Description: stand-in for NVIDIA's {package} (tests/lifecycle)\n")
    for path, (text, mode) in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
        (tree / path).chmod(mode)
    deb = dist / f"{package}_{version}_{arch}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)], check=True, capture_output=True)
    shutil.rmtree(tree)
    return deb


def container_sources(dist: Path) -> dict[str, str]:
    """Local stand-ins for what container_runtime.sh downloads, laid out as NVIDIA publishes
    them: enroot_<v>-1_<arch>.deb and enroot+caps_<v>-1_<arch>.deb in one release directory
    (github.com/NVIDIA/enroot/releases/download/v<v>/), the pyxis source as a tag archive with
    one top directory (github.com/NVIDIA/pyxis/archive/refs/tags/v<v>.tar.gz). Returns the
    LIFECYCLE_* settings that point the step at them."""
    release = dist / "enroot-release"
    release.mkdir(parents=True)
    version = f"{ENROOT_VERSION}-1"
    build_deb(release, "enroot", version, {
        "usr/bin/enroot": (f'#!/bin/sh\n# stand-in for NVIDIA enroot\n[ "$1" = version ] && echo {ENROOT_VERSION}\n', 0o755),
        "etc/enroot/enroot.conf": ("#ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)\n", 0o644)})
    build_deb(release, "enroot+caps", version, {"usr/share/doc/enroot+caps/README": ("stand-in\n", 0o644)})
    archive = dist / "pyxis-v0.19.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted((STANDIN_DIR / "standin_pyxis").iterdir()):
            tar.add(path, arcname=f"pyxis-0.19.0/{path.name}")
    return {"LIFECYCLE_ENROOT_RELEASE_URL": release.as_uri(), "LIFECYCLE_PYXIS_SOURCE_URL": archive.as_uri()}


def make_bundle(dest: Path, wheels: dict[str, Path], *, package_hash: str,
                gpu_requirements: str | None = None, content_hash: bool = False,
                edit_settings: Callable[[dict], None] | None = None) -> Path:
    """What HyperPod downloads from s3://<bucket>/lifecycle/<hash>/ onto every node.

    ``package_hash`` is the package's name and VERSION; with ``content_hash`` the settings carry
    the real content hash instead (lifecycle_scripts/package_hash.py over the code and the node
    settings, what the cluster stack names the prefix with and rollout.sh recomputes):
    ``bundle_hash(dest)`` reads it back. ``edit_settings`` changes the settings first (e.g. a
    user added in cdk.json), before the hash is taken, as the stack does."""
    shutil.copytree(SCRIPTS, dest)
    package = dest / "training"
    package.mkdir()
    (package / "__init__.py").write_text(f'"""Stand-in training package {package_hash}."""\nVERSION = "{package_hash}"\n')
    (package / "requirements-gpu.txt").write_text(
        gpu_requirements if gpu_requirements is not None else f"# gpu env (test)\n{wheels['torch']}\n")
    (package / "requirements-neuron.txt").write_text(
        f"{wheels['torch']}\n{wheels['torch_xla']}\n{wheels['torch_neuronx']}\n")
    data = settings(package_hash)
    if edit_settings is not None:
        edit_settings(data)
    if content_hash:
        data["package_hash"] = _hash_module().package_hash(SCRIPTS, package, data)
    (dest / "platform-settings.json").write_text(json.dumps(data, indent=2))
    return dest


def bundle_hash(bundle: Path) -> str:
    """The package hash a bundle's settings carry."""
    return json.loads((bundle / "platform-settings.json").read_text())["package_hash"]


def _hash_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sana_package_hash", SCRIPTS / "package_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upload_bundle(bundle: Path, endpoint: str, bucket: str, prefix: str) -> None:
    """Put a bundle under s3://bucket/prefix the way the stack's BucketDeployments lay it out
    (lifecycle/<hash>/: the scripts, platform-settings.json, training/)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(bundle.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            s3.upload_file(str(path), bucket, prefix + path.relative_to(bundle).as_posix())


@dataclass
class Cluster:
    """Nodes sharing one FSx directory; each node has its own PLATFORM_ROOT."""

    base: Path
    bundle: Path
    standins: Path
    #: LIFECYCLE_* settings pointing the containers step at local release files
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def fsx(self) -> Path:
        return self.base / "fsx"

    def root(self, node: str) -> Path:
        return self.base / "nodes" / node

    def prepare(self, node: str, *, fsx: bool = True, slurm: bool = True) -> Path:
        """The node's root filesystem: FSx (if mounted), HyperPod's resource config, the AMI's
        account files (kept across re-runs), Slurm's files, the local disks and, if `slurm`,
        the role's running Slurm daemon."""
        root = self.root(node)
        role = NODES.get(node, ("gpu", ""))[0]
        (root / "opt/ml/config").mkdir(parents=True, exist_ok=True)
        (root / "opt/ml/config/resource_config.json").write_text(json.dumps(resource_config()))
        (root / "etc").mkdir(exist_ok=True)
        fresh = not (root / "etc/passwd").exists()
        for name, text in BASE_ACCOUNTS.items():
            if not (root / "etc" / name).exists():
                (root / "etc" / name).write_text(text)
        # Ubuntu's sshd PAM stack (openssh-server's /etc/pam.d/sshd, its account part).
        (root / "etc/pam.d").mkdir(parents=True, exist_ok=True)
        if not (root / "etc/pam.d/sshd").exists():
            (root / "etc/pam.d/sshd").write_text(SSHD_PAM)
        if fresh:
            add_ssm_user(root)
        # HyperPod installs Slurm under /opt/slurm with its headers (the reference builds pyxis
        # with CPPFLAGS='-I /opt/slurm/include/', utils/install_enroot_pyxis.sh); a config only
        # on the controller (compute and login nodes are configless).
        if not (root / "opt/slurm/include").exists():
            shutil.copytree(STANDIN_DIR / "standin_slurm_include", root / "opt/slurm/include")
        if role == "controller":
            self._controller_config()
        (root / "proc").mkdir(exist_ok=True)
        (root / "proc/mounts").write_text(MOUNTS[role])
        units = root / node_model.MARKERS
        units.mkdir(parents=True, exist_ok=True)
        if role in ("gpu", "trn"):
            (units / "dlami-nvme.show").write_text(DLAMI_NVME_DONE)
        self.fsx.mkdir(exist_ok=True)
        if fsx and not (root / "fsx").exists():
            (root / "fsx").symlink_to(self.fsx)
        if slurm:
            self.start_daemon(node)
        return root

    def _controller_config(self) -> None:
        etc = self.root("controller-1") / node_model.SLURM_ETC
        etc.mkdir(parents=True, exist_ok=True)
        if not (etc / "slurm.conf").exists():
            (etc / "slurm.conf").write_text(CONTROLLER_SLURM_CONF)

    def start_daemon(self, node: str, **overrides: str) -> None:
        """What HyperPod does in Extended mode: the role's Slurm daemon starts (a slurmd needs
        the controller's slurmctld: it fetches its config from there), and systemd runs the
        units that want it (node_model.start_daemon)."""
        role = NODES.get(node, ("gpu", ""))[0]
        ctld = self.root("controller-1")
        if role != "controller" and not (ctld / node_model.MARKERS / "slurmctld.active").exists():
            self._controller_config()
            (ctld / node_model.MARKERS).mkdir(parents=True, exist_ok=True)
            (ctld / node_model.MARKERS / "slurmctld.active").touch()
        node_model.start_daemon(self.root(node), f"{SLURM_DAEMON[role]}.service", self.env(node, **overrides),
                                controller_root=ctld)

    def wait_late_check(self, node: str, timeout: float = 180) -> int:
        """Until sana-node-ready.service (queued with --no-block) has finished; its exit status."""
        result = self.root(node) / node_model.MARKERS / "sana-node-ready.service.result"
        deadline = time.monotonic() + timeout
        while not result.exists():
            assert time.monotonic() < deadline, f"{node}: sana-node-ready.service did not finish in {timeout}s"
            time.sleep(0.2)
        return int(result.read_text())

    def fire_settings_timer(self, node: str, **overrides: str) -> int:
        """sana-settings.timer elapses on ``node`` (settings_timer.sh): its service's exit status."""
        return node_model.fire_timer(self.root(node), "sana-settings.timer", self.env(node, **overrides))

    def unit_output(self, unit: str, node: str) -> str:
        """What a unit run by the stand-in systemd printed on ``node`` (its journal)."""
        return (self.root(node) / node_model.MARKERS / f"{unit}.out").read_text()

    def status(self, node: str) -> list[str]:
        return (self.fsx / f"logs/provision/{node}.status").read_text().splitlines()

    def accounts(self, node: str, name: str = "passwd") -> list[list[str]]:
        """The node's /etc/passwd (or group) entries, split into fields."""
        return [line.split(":") for line in (self.root(node) / "etc" / name).read_text().splitlines()]

    def env(self, node: str, **overrides: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PIP_", "SANA_", "LIFECYCLE_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(
            PATH=f"{self.standins}:{env['PATH']}",
            PLATFORM_ROOT=str(self.root(node)),
            STANDIN_NODE_IPS=f"{NODES.get(node, ('', '10.9.9.9'))[1]} 172.17.0.1",
            STANDIN_LOG=str(self.root(node) / "standin-calls.log"),
            STANDIN_CLUSTER=str(self.base / "nodes"),
            STANDIN_NODE_MODEL=str(STANDIN_DIR / "node_model.py"),
            STANDIN_APT_AVAILABLE=APT_AVAILABLE,
            # pip offline with no user/global pip config: the stand-in wheels are local files.
            PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1",
            LIFECYCLE_FSX_WAIT_S="60", LIFECYCLE_FSX_POLL_S="1", LIFECYCLE_ENV_LOCK_TIMEOUT_S="180",
            LIFECYCLE_SLURM_WAIT_S="30", LIFECYCLE_SLURM_POLL_S="1",
            LIFECYCLE_NVME_WAIT_S="10", LIFECYCLE_NVME_POLL_S="1",
            # A lone node has no controller registering pyxis; the six-node boot sets more.
            LIFECYCLE_PYXIS_WAIT_S="2",
            # The production wait for CloudWatch after a failure (60 s) has its own test.
            LIFECYCLE_FAILURE_LOG_WAIT_S="0",
            **self.sources,
        )
        env.update(overrides)
        if "STANDIN_CLOCK_OFFSET_S" in overrides:
            env["PATH"] = f"{self.standins / 'clock'}:{env['PATH']}"
        return env

    def start(self, node: str, *, fsx: bool = True, slurm: bool = True, **overrides: str) -> subprocess.Popen:
        self.prepare(node, fsx=fsx, slurm=slurm)
        (self.root(node) / node_model.MARKERS / "sana-node-ready.service.result").unlink(missing_ok=True)
        return subprocess.Popen(["bash", str(self.bundle / "on_init_complete.sh")], env=self.env(node, **overrides),
                                cwd=self.bundle, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, node: str, *, fsx: bool = True, slurm: bool = True, **overrides: str) -> subprocess.CompletedProcess:
        proc = self.start(node, fsx=fsx, slurm=slurm, **overrides)
        out, err = proc.communicate(timeout=240)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def log(self, node: str) -> str:
        return (self.root(node) / "var/log/provision/provisioning.log").read_text()

    def builds(self) -> list[str]:
        """Every 'building env' line in every node's log (one per env build started)."""
        return [line for node in NODES if (self.root(node) / "var/log/provision/provisioning.log").exists()
                for line in self.log(node).splitlines() if "building env" in line]


def add_ssm_user(root: Path) -> None:
    """The SSM agent's ssm-user: "SSM Agent will create a local user 'ssm-user' ... every time
    the agent starts" (aws/amazon-ssm-agent release 2.3.68.0), before any lifecycle script, with
    useradd's defaults: the next free UID (useradd(8): "the smallest ID value greater than or
    equal to UID_MIN and greater than every other user"), here the real useradd."""
    subprocess.run(["useradd", "--prefix", str(root), "--create-home", "--shell", "/bin/bash", "ssm-user"],
                   check=True, capture_output=True)
