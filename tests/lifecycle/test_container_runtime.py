"""The containers step (lifecycle_scripts/container_runtime.sh) run alone in a pretend node root
(PLATFORM_ROOT), with the pretend cluster's stand-ins (lifecycle_cluster.py STANDINS) and local
stand-ins of NVIDIA's enroot .debs and pyxis source (container_sources): the real install
logic downloads (file://), checks, unpacks, builds and installs them."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import node_model
import pytest
from lifecycle_cluster import APT_AVAILABLE, CONTROLLER_SLURM_CONF, DLAMI_NVME_DONE, STANDIN_DIR, build_deb

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "container_runtime.sh"
NVME = "/dev/nvme1n1 /opt/dlami/nvme ext4 rw 0 0\n"
SAGEMAKER = "/dev/nvme2n1 /opt/sagemaker xfs rw 0 0\n"
PYXIS_LINE = "optional /usr/local/lib/slurm/spank_pyxis.so"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to the cluster group needs root (as on a node)")


def node(tmp_path: Path, standins: Path, sources: dict[str, str], *, role: str = "gpu", mounts: str = NVME + SAGEMAKER,
         nvme_service: str | None = DLAMI_NVME_DONE, runtime: bool = True) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "nodes" / ("controller-1" if role == "controller" else "gpu-1")
    (root / "proc").mkdir(parents=True)
    (root / "proc/mounts").write_text(mounts)
    (root / "fsx").mkdir()
    (root / node_model.MARKERS).mkdir(parents=True)
    if nvme_service is not None:
        (root / node_model.MARKERS / "dlami-nvme.show").write_text(nvme_service)
    shutil.copytree(STANDIN_DIR / "standin_slurm_include", root / "opt/slurm/include")  # the node's Slurm headers
    if role == "controller":
        (root / "opt/slurm/etc").mkdir()
        (root / "opt/slurm/etc/slurm.conf").write_text(CONTROLLER_SLURM_CONF)
    env = {"PATH": f"{standins}:/usr/bin:/bin", "PLATFORM_ROOT": str(root), "FSX": str(root / "fsx"),
           "CFG_CLUSTER_GID": str(os.getgid()), "CFG_CLUSTER_USERS": "ana:2001 ben:2002", "NODE_ROLE": role, "CFG_CONTAINER_RUNTIME": str(runtime).lower(),
           "STANDIN_LOG": str(tmp_path / "calls.log"), "STANDIN_APT_AVAILABLE": APT_AVAILABLE,
           "STANDIN_CLUSTER": str(tmp_path / "nodes"), "STANDIN_NODE_MODEL": str(STANDIN_DIR / "node_model.py"),
           "LIFECYCLE_NVME_WAIT_S": "20", "LIFECYCLE_NVME_POLL_S": "1",
           "STEP_WARN_FILE": str(tmp_path / "warnings"), **sources}
    return root, env


def run(env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, cwd=cwd)


def conf(root: Path) -> dict[str, str]:
    lines = (root / "etc/enroot/enroot.conf").read_text().splitlines()
    return dict(line.split(None, 1) for line in lines if line and not line.startswith("#"))


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls.log"
    return path.read_text().splitlines() if path.exists() else []


def test_installs_enroot_and_pyxis_and_configures_enroot_on_nvme(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources)
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    # enroot from the two .debs (apt-get with what it runs with), pyxis built and installed.
    (install,) = [c for c in calls(tmp_path) if c.startswith("apt-get") and " install " in c]
    assert install.split(" install --no-install-recommends ")[1].split()[:4] == \
        ["squashfs-tools", "parallel", "fuse-overlayfs", "squashfuse"]
    assert install.endswith("enroot+caps_3.4.1-1_amd64.deb") and "/enroot_3.4.1-1_amd64.deb " in install
    assert subprocess.run([str(root / "usr/bin/enroot"), "version"], capture_output=True, text=True).stdout == "3.4.1\n"
    plugin = root / "usr/local/lib/slurm/spank_pyxis.so"
    assert plugin.read_bytes()[:4] == b"\x7fELF"
    # pyxis's own make install also writes its pyxis.conf; the step registers nothing here.
    assert (root / "usr/local/share/pyxis/pyxis.conf").read_text() == "required /usr/local/lib/slurm/spank_pyxis.so\n"
    assert not (root / "opt/slurm/etc").exists()
    assert conf(root) == {
        "ENROOT_RUNTIME_PATH": "/opt/dlami/nvme/tmp/enroot/user-$(id -u)",
        "ENROOT_DATA_PATH": "/opt/dlami/nvme/tmp/enroot/data/user-$(id -u)",
        "ENROOT_TEMP_PATH": "/opt/dlami/nvme/tmp",
        "ENROOT_CACHE_PATH": "${HOME}/.cache/enroot",
        "ENROOT_CONFIG_PATH": "${HOME}/.config/enroot",
        "ENROOT_SQUASH_OPTIONS": "-comp lzo -noD",
        "ENROOT_ROOTFS_WRITABLE": "yes",
        "ENROOT_MOUNT_HOME": "no",
        "ENROOT_RESTRICT_DEV": "no",
    }
    # The packaged config is kept once, next to ours.
    assert "/run/enroot" in (root / "etc/enroot/enroot.conf.ami").read_text()
    # Root-only parents; each cluster user's runtime and container directory made for that user;
    # the image store root's (imports are root's, import_image.sh).
    for path, owner, mode in (("opt/dlami/nvme/tmp", 0, 0o1777), ("opt/dlami/nvme/tmp/enroot", 0, 0o755),
                              ("opt/dlami/nvme/tmp/enroot/data", 0, 0o755),
                              ("opt/dlami/nvme/tmp/enroot/user-2001", 2001, 0o700),
                              ("opt/dlami/nvme/tmp/enroot/data/user-2002", 2002, 0o700),
                              ("fsx/images", 0, 0o755), ("fsx/images/by-tag", 0, 0o755)):
        st = (root / path).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (owner, mode), path
    assert not (root / "fsx/enroot").exists()  # no shared layer cache
    assert "dlami-nvme.service has finished" in done.stdout
    assert not (tmp_path / "warnings").exists()
    # Idempotent: a second run (node reboot, rollout) installs nothing and writes the same file.
    before = (root / "etc/enroot/enroot.conf").read_text(), plugin.read_bytes()
    again = run(env)
    assert again.returncode == 0 and ((root / "etc/enroot/enroot.conf").read_text(), plugin.read_bytes()) == before
    assert "enroot 3.4.1 is installed" in again.stdout and "pyxis is installed" in again.stdout
    assert len([c for c in calls(tmp_path) if c.startswith("apt-get") and " install " in c]) == 1


def test_waits_for_dlami_nvme_before_choosing_the_scratch_disk(tmp_path, standins, sources):
    """dlami-nvme.service still mounting the NVMe when the step runs (the reference's race)."""
    root, env = node(tmp_path, standins, sources, mounts=SAGEMAKER,
                     nvme_service="LoadState=loaded\nActiveState=activating\nExecMainStatus=0\n")

    def dlami_nvme_finishes() -> None:
        time.sleep(2.5)
        (root / "proc/mounts").write_text(SAGEMAKER + NVME)
        (root / node_model.MARKERS / "dlami-nvme.show").write_text(DLAMI_NVME_DONE)
    finisher = threading.Thread(target=dlami_nvme_finishes)
    finisher.start()
    done = run(env)
    finisher.join()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "waiting for dlami-nvme.service (activating;" in done.stdout
    assert conf(root)["ENROOT_DATA_PATH"] == "/opt/dlami/nvme/tmp/enroot/data/user-$(id -u)"


def test_falls_back_to_opt_sagemaker_without_an_nvme_service(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources, mounts=SAGEMAKER, nvme_service=None)
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no dlami-nvme.service on this AMI" in done.stdout
    assert conf(root)["ENROOT_DATA_PATH"] == "/opt/sagemaker/tmp/enroot/data/user-$(id -u)"


def test_without_local_nvme_enroot_uses_tmp_and_the_warning_is_not_taken_for_a_path(tmp_path, standins, sources):
    # The warning once went to stdout inside $(local_scratch): the "scratch path" became the
    # warning text plus /tmp, relative to the working directory, and enroot.conf got a two-line path.
    root, env = node(tmp_path, standins, sources, mounts="/dev/root / ext4 rw 0 0\n", nvme_service=None)
    work = tmp_path / "cwd"
    work.mkdir()
    done = run(env, cwd=work)
    assert done.returncode == 0, done.stderr
    assert "neither /opt/dlami/nvme nor /opt/sagemaker is mounted" in done.stderr
    assert conf(root)["ENROOT_DATA_PATH"] == "/tmp/tmp/enroot/data/user-$(id -u)"
    assert conf(root)["ENROOT_TEMP_PATH"] == "/tmp/tmp"
    assert (root / "tmp/tmp/enroot/data").is_dir()
    assert list(work.iterdir()) == []


def test_an_ami_with_enroot_and_pyxis_downloads_nothing(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/enroot").write_text("#!/bin/sh\necho 3.5.0\n")
    (root / "usr/bin/enroot").chmod(0o755)
    (root / "usr/local/lib/slurm").mkdir(parents=True)
    (root / "usr/local/lib/slurm/spank_pyxis.so").write_bytes(b"\x7fELF")
    done = run(env)
    assert done.returncode == 0, done.stderr
    assert not [c for c in calls(tmp_path) if c.startswith("apt-get")]
    assert "enroot 3.5.0 is installed" in done.stdout


def test_a_download_that_is_not_the_package_stops_with_one_line(tmp_path, standins, sources):
    """An error page or another release saved under the .deb's name is refused before apt-get."""
    release = tmp_path / "wrong-release"
    release.mkdir()
    build_deb(release, "enroot", "3.5.0-1", {"usr/bin/enroot": ("#!/bin/sh\n", 0o755)})
    (release / "enroot_3.5.0-1_amd64.deb").rename(release / "enroot_3.4.1-1_amd64.deb")
    _root, env = node(tmp_path, standins, {**sources, "LIFECYCLE_ENROOT_RELEASE_URL": release.as_uri()})
    env["STEP_ERROR_FILE"] = str(tmp_path / "error")
    done = run(env)
    assert done.returncode == 1
    assert (tmp_path / "error").read_text() == \
        f"{release.as_uri()}/enroot_3.4.1-1_amd64.deb is not the Debian package enroot 3.4.1-1\n"
    assert not [c for c in calls(tmp_path) if c.startswith("apt-get")]


def test_a_failing_apt_get_stops_with_one_line(tmp_path, standins, sources):
    _root, env = node(tmp_path, standins, sources)
    env["STANDIN_APT_AVAILABLE"] = "squashfs-tools parallel"  # the AMI's repositories lack fuse-overlayfs
    env["STEP_ERROR_FILE"] = str(tmp_path / "error")
    done = run(env)
    assert done.returncode == 1
    assert (tmp_path / "error").read_text() == "apt-get install of enroot 3.4.1 failed (its output above says why)\n"
    assert "E: Unable to locate package fuse-overlayfs" in done.stderr


def test_the_controller_registers_pyxis_in_plugstack_conf_itself_and_reconfigures(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources, role="controller")
    etc = root / "opt/slurm/etc"
    (etc / "plugstack.conf").write_text("# HyperPod's\nrequired /opt/slurm/lib/slurm/other_spank.so\n")
    (root / node_model.MARKERS / "slurmctld.active").touch()  # slurmctld runs: reconfigure
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (etc / "plugstack.conf").read_text().splitlines()
    assert lines[:2] == ["# HyperPod's", "required /opt/slurm/lib/slurm/other_spank.so"]  # kept
    assert lines[-1] == PYXIS_LINE
    assert "scontrol reconfigure" in calls(tmp_path)
    assert not (root / "usr/bin/enroot").exists()  # the controller runs no container job
    # A re-run adds nothing.
    assert run(env).returncode == 0
    assert (etc / "plugstack.conf").read_text().splitlines() == lines
    assert (etc / "slurm.conf").read_text() == CONTROLLER_SLURM_CONF


def test_a_controller_whose_slurmctld_is_not_up_only_writes_the_file(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources, role="controller")
    done = run(env)
    assert done.returncode == 0, done.stderr
    assert (root / "opt/slurm/etc/plugstack.conf").read_text().splitlines()[-1] == PYXIS_LINE
    assert "scontrol reconfigure" not in calls(tmp_path)
    assert "slurmctld is not up yet" in done.stdout and "it reads plugstack.conf when it starts" in done.stdout


@pytest.mark.parametrize("plugstack,registered", [
    ("required /usr/local/lib/slurm/spank_pyxis.so\n", True),
    ("include pyxis.conf\n", True),  # adjacent, named without a path: configless ships it
])
def test_an_existing_registration_is_left_alone(tmp_path, standins, sources, plugstack, registered):
    root, env = node(tmp_path, standins, sources, role="controller")
    etc = root / "opt/slurm/etc"
    (etc / "plugstack.conf").write_text(plugstack)
    (etc / "pyxis.conf").write_text("required /usr/local/lib/slurm/spank_pyxis.so\n")
    done = run(env)
    assert done.returncode == 0 and "pyxis is already registered" in done.stdout
    assert (etc / "plugstack.conf").read_text() == plugstack
    assert not (tmp_path / "warnings").exists()


def test_a_registration_configless_nodes_never_receive_is_a_warning(tmp_path, standins, sources):
    """AWS's reference registers pyxis with `include /opt/slurm/etc/plugstack.conf.d/pyxis.conf`:
    a path, so configless slurmds do not get it (configless_slurm.html, Limitations)."""
    root, env = node(tmp_path, standins, sources, role="controller")
    etc = root / "opt/slurm/etc"
    (etc / "plugstack.conf.d").mkdir()
    (etc / "plugstack.conf.d/pyxis.conf").write_text("required /usr/local/lib/slurm/spank_pyxis.so\n")
    (etc / "plugstack.conf").write_text("include /opt/slurm/etc/plugstack.conf.d/pyxis.conf\n")
    done = run(env)
    assert done.returncode == 0
    (warning,) = (tmp_path / "warnings").read_text().splitlines()
    assert warning.startswith(f"{etc}/plugstack.conf registers pyxis through '/opt/slurm/etc/plugstack.conf.d/"
                              "pyxis.conf', which configless nodes never receive")
    # ... which the configless model agrees with: a node gets plugstack.conf but not the include.
    compute = tmp_path / "nodes/gpu-1"
    assert node_model.ship_config(root, compute) == ["slurm.conf", "plugstack.conf"]


def test_container_runtime_off_installs_nothing_and_warns(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources, runtime=False)
    done = run(env)
    assert done.returncode == 0
    assert (tmp_path / "warnings").read_text().startswith("containerRuntime=false: enroot and pyxis are not installed")
    assert not (root / "usr").exists() and not (root / "etc/enroot").exists()


# ---- privateNetwork: nothing downloaded, images from this account's ECR only -------------------
PRIVATE_CAUSE = ("{what} is not on this AMI and a private cluster (privateNetwork) cannot download it: no internet "
                 "egress to NVIDIA's releases on github.com or Ubuntu's archive; container jobs need an AMI that "
                 'carries enroot and pyxis (runbooks/containers.md, "Private network")\n')


def test_a_private_cluster_downloads_nothing_and_says_why_in_one_line(tmp_path, standins, sources):
    """The local release files stand for GitHub: reachable here, so a step that tried would succeed."""
    root, env = node(tmp_path, standins, sources)
    env.update(CFG_PRIVATE_NETWORK="true", STEP_ERROR_FILE=str(tmp_path / "error"))
    done = run(env)
    assert done.returncode == 1
    assert (tmp_path / "error").read_text() == PRIVATE_CAUSE.format(what="enroot")
    assert not [c for c in calls(tmp_path) if c.startswith("apt-get")]
    assert not (root / "usr/bin/enroot").exists() and not (root / "etc/enroot/enroot.conf").exists()


def test_a_private_cluster_on_an_ami_with_enroot_but_no_pyxis_names_pyxis(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/enroot").write_text("#!/bin/sh\necho 3.5.0\n")
    (root / "usr/bin/enroot").chmod(0o755)
    env.update(CFG_PRIVATE_NETWORK="true", STEP_ERROR_FILE=str(tmp_path / "error"))
    done = run(env)
    assert done.returncode == 1
    assert (tmp_path / "error").read_text() == PRIVATE_CAUSE.format(what="pyxis")
    assert not (root / "usr/local/lib/slurm/spank_pyxis.so").exists()


def test_a_private_cluster_on_an_ami_with_both_configures_enroot(tmp_path, standins, sources):
    root, env = node(tmp_path, standins, sources)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/enroot").write_text("#!/bin/sh\necho 3.5.0\n")
    (root / "usr/bin/enroot").chmod(0o755)
    (root / "usr/local/lib/slurm").mkdir(parents=True)
    (root / "usr/local/lib/slurm/spank_pyxis.so").write_bytes(b"\x7fELF")
    env.update(CFG_PRIVATE_NETWORK="true", CFG_IMAGE_REGISTRY="123456789012.dkr.ecr.eu-west-1.amazonaws.com")
    done = run(env)
    assert done.returncode == 0, done.stderr
    assert conf(root)["ENROOT_CONFIG_PATH"] == "${HOME}/.config/enroot"
    assert ("private network: container images only from 123456789012.dkr.ecr.eu-west-1.amazonaws.com, imported "
            "by root (import_image.sh)") in done.stdout
