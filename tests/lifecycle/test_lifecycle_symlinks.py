"""Symlink attacks on the root-run lifecycle steps, made by a cluster user (uid 2001, setpriv).

Every cluster user can write somewhere on FSx; root's steps re-run on every replacement node.
The attacks of issue 24 are made for real by an unprivileged process, then the node is booted
again, and nothing outside the paths the steps own may have changed: a decoy tree outside FSx
(standing for /etc) and the node's own /etc are compared byte for byte, with owners and modes.
The cluster lives in a directory every uid can traverse (pytest's base directory is 0700, where
every attack would fail for the wrong reason), and each test first shows the attacker CAN write
where a user may.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from lifecycle_cluster import GROUP, USERS, Cluster, make_bundle
from test_lifecycle_on_init_complete import failure

pytestmark = pytest.mark.slow  # two or three boots of a login node each

ATTACKER, VICTIM = USERS["researcher"], USERS["analyst"]
GID = GROUP[1]


@pytest.fixture
def world(standins, wheels, sources):
    """A fresh cluster under a 0755 directory, plus a root-owned decoy tree outside FSx."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("the attacks need root (to boot) and setpriv (to attack as a cluster uid)")
    base = Path(tempfile.mkdtemp(prefix="sana-attack-"))
    base.chmod(0o755)
    decoy = base / "decoy-etc"
    decoy.mkdir()
    (decoy / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (decoy / "shadow").chmod(0o640)
    c = Cluster(base / "cluster", make_bundle(base / "cluster/bundle", wheels, package_hash="pkg0001"), standins,
                sources)
    c.base.chmod(0o755)
    yield c, decoy
    shutil.rmtree(base, ignore_errors=True)


def as_user(uid: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={GID}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60)


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every entry under ``roots`` (links not followed): type, owner, mode and content hash. A
    node's /etc counts only its account files (the boot itself legitimately writes other files there)."""
    out = {}
    for root in roots:
        paths = [root / n for n in ("passwd", "shadow", "group", "gshadow")] if root.name == "etc" else \
            [root, *sorted(root.rglob("*"))]
        for path in paths:
            st = path.lstat()
            if path.is_symlink():
                what = ("link", os.readlink(path))
            elif path.is_file():
                what = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                what = ("dir",)
            out[str(path)] = (*what, st.st_uid, st.st_gid, st.st_mode)
    return out


def test_a_user_cannot_touch_the_root_owned_trees_and_links_in_their_own_dir_are_not_followed(world):
    c, decoy = world
    node = "login-1"
    assert c.run(node).returncode == 0
    etc = c.root(node) / "etc"
    fsx = c.fsx
    own = fsx / "logs/researcher"
    # Where a user may write, the attacker can (so a refusal below is the layout's, not the test's).
    assert as_user(ATTACKER, "touch", str(own / "mine.txt")).returncode == 0
    assert as_user(ATTACKER, "touch", str(fsx / "data/shared-input")).returncode == 0
    before = snapshot(decoy, etc)
    # The attacks of issue 24: swap a log directory root writes into for a link to /etc; plant
    # the predictable output file of root's rollout job and the node status file; replace
    # another user's directories; and, in their own directory, links to what root must not touch.
    attempts = {
        "swap logs/provision": ["sh", "-c", f"mv {fsx}/logs/provision {fsx}/logs/old && ln -s {decoy} {fsx}/logs/provision"],
        "link in logs/": ["ln", "-s", str(decoy), str(fsx / "logs/slurm")],
        "plant the rollout output": ["ln", "-s", str(decoy / "shadow"), str(fsx / "logs/root/sana-rollout-1.out")],
        "plant a status file": ["ln", "-s", str(decoy / "shadow"), str(fsx / f"logs/provision/{node}.status")],
        "replace another user's run dir": ["sh", "-c", f"mv {fsx}/artefacts/checkpoints/analyst {fsx}/x; "
                                                      f"mkdir {fsx}/artefacts/checkpoints/analyst"],
        "write into another user's cache": ["touch", str(fsx / "cache/inductor/analyst/planted.py")],
        "squat a future user's cache": ["mkdir", str(fsx / "cache/neuron/carol")],
        "rename the shared data dir": ["mv", str(fsx / "data"), str(fsx / "data-old")],
        "write the package": ["touch", str(fsx / "platform/current/training/planted.py")],
    }
    for what, argv in attempts.items():
        done = as_user(ATTACKER, *argv)
        assert done.returncode != 0, f"{what}: the attacker succeeded ({done.stdout}{done.stderr})"
    # What the attacker CAN do: fill their own directory with links to root's files, open it up.
    for name, target in (("pinned-env", decoy / "shadow"), ("x", etc / "shadow"), ("d", decoy)):
        assert as_user(ATTACKER, "ln", "-s", str(target), str(own / name)).returncode == 0
    assert as_user(ATTACKER, "chmod", "0777", str(own)).returncode == 0
    assert as_user(ATTACKER, "rm", str(fsx / "data/shared-input")).returncode == 0  # their own entry

    # A replacement node boots (every step again, as root): it must neither follow nor adopt.
    result = c.run(node)
    assert result.returncode == 0, result.stdout[-3000:]
    assert snapshot(decoy, etc) == before
    st = own.lstat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (ATTACKER, GID, 0o755)  # write bits for others gone
    assert (fsx / "artefacts/checkpoints/analyst").stat().st_uid == VICTIM


def test_an_old_layout_with_planted_links_fails_the_boot_and_root_follows_none(world):
    """A cluster provisioned before this layout had /fsx/logs and /fsx/cache/* writable by every
    user, so links and squatted directories may already be there: the next boot refuses them in
    one line (and writes no status file through them) instead of chowning or writing through."""
    c, decoy = world
    node = "login-1"
    assert c.run(node).returncode == 0
    fsx = c.fsx
    # The old modes (shared_dirs.sh before this change): logs root:<group> 2775, caches 1777.
    os.chmod(fsx / "logs", 0o2775)
    os.chown(fsx / "logs", 0, GID)
    for cache in ("cache", "cache/neuron"):
        os.chmod(fsx / cache, 0o1777)
    before = snapshot(decoy, c.root(node) / "etc")
    assert as_user(ATTACKER, "sh", "-c", f"mv {fsx}/logs/provision {fsx}/logs/p-old && "
                                         f"ln -s {decoy} {fsx}/logs/provision").returncode == 0
    result = c.run(node)
    step, cause = failure(result)
    seen = c.root(node) / "fsx"  # the node's view of FSx (its /fsx)
    assert (step, cause) == ("dirs", f"{seen}/logs/provision is a symlink (to {decoy}); the platform expects a "
                                     "directory there and never follows a link: move the link away")
    assert snapshot(decoy, c.root(node) / "etc") == before  # no chown, chmod or status file through it

    # The link removed, a directory squatted for another user is refused, not handed over.
    (fsx / "logs/provision").unlink()
    (fsx / "logs/p-old").rename(fsx / "logs/provision")
    shutil.rmtree(fsx / "cache/neuron/analyst")
    assert as_user(ATTACKER, "mkdir", str(fsx / "cache/neuron/analyst")).returncode == 0
    step, cause = failure(c.run(node))
    assert (step, cause) == ("dirs", f"{seen}/cache/neuron/analyst belongs to uid {ATTACKER}, not to uid {VICTIM} "
                                     "whose directory it is; someone else made it: move it away and re-run the step")
    assert snapshot(decoy, c.root(node) / "etc") == before


def test_the_container_step_makes_each_users_enroot_dirs_before_anyone_else_can(world):
    """enroot's per-uid runtime and data directories (container roots are unpacked there) are
    root-made for their user under root-only parents: another user can create none of them."""
    c, decoy = world
    node = "login-1"
    assert c.run(node).returncode == 0
    scratch = c.root(node) / "opt/sagemaker/tmp/enroot"  # a login node has no NVMe: the secondary EBS volume
    for uid in USERS.values():
        for sub in (f"user-{uid}", f"data/user-{uid}"):
            st = (scratch / sub).lstat()
            assert (st.st_uid, st.st_mode & 0o7777) == (uid, 0o700), sub
    assert as_user(ATTACKER, "mkdir", str(scratch / "data/user-2099")).returncode != 0
    images = c.fsx / "images"
    assert (images.stat().st_uid, images.stat().st_mode & 0o7777) == (0, 0o755)
    assert as_user(ATTACKER, "touch", str(images / ("sha256-" + "0" * 64 + ".sqsh"))).returncode != 0
