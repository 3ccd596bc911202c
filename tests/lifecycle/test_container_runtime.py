"""The container-runtime step (lifecycle_scripts/container_runtime.sh), run for real in a
pretend node root (PLATFORM_ROOT) with stand-ins for what the HyperPod AMI provides: an
``enroot`` binary, pyxis's plugstack.conf registration, and an ``srun`` whose --help does or
does not list pyxis's options (as a real srun with and without the plugin loaded)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "container_runtime.sh"
PYXIS_LINE = "required /opt/slurm/lib/slurm/spank_pyxis.so\n"
SRUN_WITH_PYXIS = "#!/bin/sh\necho 'Usage: srun [OPTIONS...]'\necho '      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'\n"
SRUN_WITHOUT = "#!/bin/sh\necho 'Usage: srun [OPTIONS...]'\necho '      --label'\n"


def node(tmp_path: Path, *, enroot: bool = True, plugstack: str | None = PYXIS_LINE, srun: str = SRUN_WITH_PYXIS,
         mounts: str = "/dev/nvme1n1 /opt/dlami/nvme ext4 rw 0 0\n") -> tuple[Path, dict[str, str]]:
    root = tmp_path / "node"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    tools = {"srun": srun}
    if enroot:
        tools["enroot"] = "#!/bin/sh\n[ \"$1\" = version ] && echo 3.5.0\n"
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "mounts").write_text(mounts)
    (root / "etc" / "enroot").mkdir(parents=True)
    (root / "etc" / "enroot" / "enroot.conf").write_text("ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)\n")
    (root / "fsx").mkdir()
    if plugstack is not None:
        (root / "opt" / "slurm" / "etc").mkdir(parents=True)
        (root / "opt" / "slurm" / "etc" / "plugstack.conf").write_text(plugstack)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PLATFORM_ROOT": str(root), "FSX": str(root / "fsx"),
           "CFG_CLUSTER_GID": str(os.getgid()), "CFG_CLUSTER_USERS": "ana:2001 ben:2002"}
    return root, env


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def conf(root: Path) -> dict[str, str]:
    lines = (root / "etc/enroot/enroot.conf").read_text().splitlines()
    return dict(line.split(None, 1) for line in lines if line and not line.startswith("#"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to the cluster group needs root (as on a node)")
def test_configures_enroot_on_nvme_with_the_cache_and_images_on_fsx(tmp_path):
    root, env = node(tmp_path)
    done = run(env)
    assert done.returncode == 0, done.stderr
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
    # The AMI's own config is kept once, next to ours.
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
    assert "enroot 3.5.0 + pyxis ready" in done.stdout
    # Idempotent: a second run (node reboot, rollout) converges to the same file.
    before = (root / "etc/enroot/enroot.conf").read_text()
    assert run(env).returncode == 0 and (root / "etc/enroot/enroot.conf").read_text() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to the cluster group needs root (as on a node)")
def test_falls_back_to_opt_sagemaker_and_accepts_pyxis_through_an_include(tmp_path):
    plugstack = f"include {tmp_path}/node/opt/slurm/etc/plugstack.conf.d/*\n"
    root, env = node(tmp_path, plugstack=plugstack, mounts="/dev/nvme0n1 /opt/sagemaker xfs rw 0 0\n")
    (root / "opt/slurm/etc/plugstack.conf.d").mkdir()
    (root / "opt/slurm/etc/plugstack.conf.d/pyxis.conf").write_text(PYXIS_LINE)
    done = run(env)
    assert done.returncode == 0, done.stderr
    assert conf(root)["ENROOT_DATA_PATH"] == "/opt/sagemaker/tmp/enroot/data/user-$(id -u)"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to the cluster group needs root (as on a node)")
def test_without_local_nvme_enroot_uses_tmp_and_the_warning_is_not_taken_for_a_path(tmp_path):
    # The warning once went to stdout inside $(local_scratch): the "scratch path" became the
    # warning text plus /tmp, relative to the working directory, and enroot.conf got a two-line path.
    root, env = node(tmp_path, mounts="/dev/root / ext4 rw 0 0\n")
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=work)
    assert done.returncode == 0, done.stderr
    assert "neither /opt/dlami/nvme nor /opt/sagemaker is mounted" in done.stderr
    assert conf(root)["ENROOT_DATA_PATH"] == "/tmp/tmp/enroot/data/user-$(id -u)"
    assert conf(root)["ENROOT_TEMP_PATH"] == "/tmp/tmp"
    assert (root / "tmp/tmp/enroot/data").is_dir()
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("kwargs,expected", [
    ({"enroot": False}, "enroot is not installed on this node;"),
    ({"plugstack": None}, "pyxis is not registered in "),
    ({"plugstack": "required /opt/slurm/lib/slurm/other.so\n"}, "pyxis is not registered in "),
    ({"srun": SRUN_WITHOUT}, "srun --help does not list --container-image"),
])
def test_a_missing_piece_fails_the_step_with_one_line(tmp_path, kwargs, expected):
    _root, env = node(tmp_path, **kwargs)
    done = run(env)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"ERROR: {expected}"), line
