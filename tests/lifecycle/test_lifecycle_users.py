"""The users step (lifecycle_scripts/cluster_users.sh) against what a node already has.

The real groupadd/useradd/usermod edit each pretend node's /etc (--prefix). A node whose AMI
already has a conflicting account must fail in the users step with one line; the settings
step rejects bad user specs before any tool sees them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from lifecycle_cluster import ADMIN_GROUP, ADMINS, GROUP, USERS
from test_lifecycle_on_init_complete import failure


def add_account(root, passwd: str = "", group: str = "") -> None:
    """What an AMI (or an operator) already put on the node."""
    for name, line in (("passwd", passwd), ("group", group)):
        if line:
            with open(root / "etc" / name, "a") as f:
                f.write(line + "\n")


@pytest.mark.parametrize("passwd,group,expected", [
    ("researcher:x:1500:1500::/home/researcher:/bin/bash", "",
     "user 'researcher' exists on this node with UID 1500, but cluster_users gives 2001;"),
    ("bob:x:2002:2002::/home/bob:/bin/bash", "",
     "UID 2002 of cluster user 'analyst' is already used by 'bob' on this node; pick another UID in clusterUsers"),
    ("", "sana:x:3000:", "group 'sana' exists on this node with GID 3000, but cluster_group gives 2000;"),
    ("", "docker:x:2000:", "GID 2000 of cluster group 'sana' is already used by group 'docker' on this node;"),
])
def test_conflicting_local_account_fails_in_the_users_step(make_cluster, passwd, group, expected):
    c = make_cluster()
    add_account(c.prepare("gpu-1"), passwd, group)
    step, cause = failure(c.run("gpu-1"))
    assert step == "users" and cause.startswith(expected), cause
    assert "(cdk context)" in cause and "redeploy" in cause
    (status,) = (c.fsx / "logs/provision/gpu-1.status").read_text().splitlines()
    assert " step=users cause=" in status
    assert not (c.fsx / "platform/current").exists()  # nothing after the failed step ran


def test_existing_user_with_the_right_uid_is_converged_not_duplicated(make_cluster):
    """An AMI that already has the user (same UID, other group/home): fixed, not re-created."""
    c = make_cluster()
    root = c.prepare("controller-1")
    add_account(root, "researcher:x:2001:1000::/home/researcher:/bin/bash")
    result = c.run("controller-1")
    assert result.returncode == 0, result.stdout[-3000:]
    entries = [e for e in c.accounts("controller-1") if e[0] == "researcher"]
    assert entries == [["researcher", "x", "2001", str(GROUP[1]), "", "/fsx/home/researcher", "/bin/bash"]]
    assert "user researcher (2001): primary group set to 2000, home to /fsx/home/researcher" in result.stdout


def test_rerun_after_a_user_is_added_creates_only_that_user(make_cluster):
    c = make_cluster()
    assert c.run("login-1").returncode == 0
    settings = c.bundle / "platform-settings.json"
    data = json.loads(settings.read_text())
    data["cluster_users"].append({"name": "carol", "uid": 2003})
    settings.write_text(json.dumps(data))
    result = c.run("login-1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "created user carol (2003)" in result.stdout
    assert all(f"user {name} ({uid}) already exists" in result.stdout for name, uid in USERS.items())
    assert (c.fsx / "home/carol/.ssh/id_ed25519").exists()
    assert re.findall(r"created home \S+/fsx/home/(\w+) ", result.stdout) == ["carol"]


def test_rerun_never_follows_a_users_symlinks_as_root(make_cluster):
    """A home belongs to its user: root must not chown or write through links planted there."""
    c = make_cluster()
    assert c.run("gpu-1").returncode == 0
    target = c.root("gpu-1") / "etc/shadow"
    before = (target.read_bytes(), target.stat().st_uid, target.stat().st_mode)
    auth = c.fsx / "home/researcher/.ssh/authorized_keys"
    auth.unlink()
    auth.symlink_to(target)  # what the user (uid 2001) could do in their own home
    (c.fsx / "home/analyst/.ssh").rename(c.fsx / "home/analyst/.ssh-moved")
    (c.fsx / "home/analyst/.ssh").symlink_to(c.root("gpu-1") / "etc")
    result = c.run("gpu-1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (target.read_bytes(), target.stat().st_uid, target.stat().st_mode) == before
    assert (c.root("gpu-1") / "etc").stat().st_uid == 0 and not (c.root("gpu-1") / "etc/id_ed25519").exists()
    assert "WARNING: " in result.stdout and "home/analyst exists without .ssh/id_ed25519" in result.stdout


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d["cluster_users"].append({"name": "other", "uid": 2001}), "cluster_users[2]: UID 2001 appears twice"),
    (lambda d: d["cluster_users"].append({"name": "analyst", "uid": 2005}), "user name 'analyst' appears twice"),
    (lambda d: d["cluster_users"].__setitem__(0, {"name": "researcher", "uid": 999}),
     "key 'cluster_users[0].uid' must be an integer in 2000..59999"),
    # ssm-user's UID on these nodes (the SSM agent took the next one after ubuntu).
    (lambda d: d["cluster_users"].__setitem__(0, {"name": "researcher", "uid": 1001}),
     "key 'cluster_users[0].uid' must be an integer in 2000..59999 (regular accounts above the node's own), got 1001"),
    (lambda d: d["cluster_users"].__setitem__(0, {"name": "Bad Name", "uid": 2001}),
     "key 'cluster_users[0].name' must be a POSIX user/group name"),
    (lambda d: d.__setitem__("cluster_users", []), "key 'cluster_users' must be a non-empty list"),
    (lambda d: d["cluster_group"].__setitem__("gid", 65534), "key 'cluster_group.gid' must be an integer in 2000..59999"),
    (lambda d: d.__setitem__("home_root", "/home"), "key 'home_root' must be under fsx_mount /fsx"),
    (lambda d: d.__setitem__("slurm_accounting", "yes"), "key 'slurm_accounting' must be true or false"),
    (lambda d: d.pop("cluster_group"), "key 'cluster_group' is missing"),
])
def test_bad_user_settings_fail_in_the_settings_step(make_cluster, edit, expected):
    c = make_cluster()
    settings = c.bundle / "platform-settings.json"
    data = json.loads(settings.read_text())
    edit(data)
    settings.write_text(json.dumps(data))
    step, cause = failure(c.run("controller-1"))
    assert step == "settings" and expected in cause and str(settings) in cause, cause
    assert "FAILED" not in (c.root("controller-1") / "etc/passwd").read_text()
    assert [e[0] for e in c.accounts("controller-1")] == ["root", "daemon", "ubuntu", "nobody", "ssm-user"]


def test_rerun_from_the_installed_package_adds_a_new_user_on_a_running_node(make_cluster):
    """runbooks/rollout.md: users reach running nodes by re-running the boot from FSx."""
    c = make_cluster()
    assert c.run("login-1").returncode == 0
    lifecycle = c.fsx / "platform/pkg0001/lifecycle"
    settings = lifecycle / "platform-settings.json"
    data = json.loads(settings.read_text())
    data["cluster_users"].append({"name": "carol", "uid": 2003})
    settings.write_text(json.dumps(data))  # stands for the settings of a rolled-out package
    result = subprocess.run(["bash", str(lifecycle / "on_init_complete.sh")], env=c.env("login-1"),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "created user carol (2003)" in result.stdout and "DONE node=login-1" in result.stdout
    assert ["carol", "x", "2003", str(GROUP[1]), "", "/fsx/home/carol", "/bin/bash"] in c.accounts("login-1")


def test_admins_may_sudo_through_a_checked_sudoers_entry_and_nobody_else(make_cluster):
    """clusterAdmins (analyst here) are members of the admin group on every node, and the
    group's sudoers entry is what sudo accepts (checked with the real visudo where installed)."""
    c = make_cluster()
    assert c.run("login-1").returncode == 0
    (group,) = [e for e in c.accounts("login-1", "group") if e[0] == ADMIN_GROUP[0]]
    assert group == [ADMIN_GROUP[0], "x", str(ADMIN_GROUP[1]), ",".join(ADMINS)]
    sudoers = c.root("login-1") / "etc/sudoers.d/sana-platform-admins"
    st = sudoers.stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o440)
    rules = [line for line in sudoers.read_text().splitlines() if line and not line.startswith("#")]
    assert rules == [f"Defaults:%{ADMIN_GROUP[0]} logfile=/var/log/sana-admin-sudo.log",
                     f"%{ADMIN_GROUP[0]} ALL=(ALL:ALL) NOPASSWD: ALL"]
    if shutil.which("visudo"):  # sudo's own parser (scripts/install-system-packages.sh installs sudo)
        subprocess.run(["visudo", "-c", "-f", str(sudoers)], check=True, capture_output=True)
    assert not list(sudoers.parent.glob(".*"))  # no temp file left where sudo reads its includes


def test_an_admin_removed_from_the_settings_loses_the_group_at_the_next_run(make_cluster):
    c = make_cluster()
    assert c.run("gpu-1").returncode == 0
    settings = c.bundle / "platform-settings.json"
    data = json.loads(settings.read_text())
    data["cluster_admins"] = []
    settings.write_text(json.dumps(data))
    result = c.run("gpu-1")
    assert result.returncode == 0, result.stdout[-3000:]
    (group,) = [e for e in c.accounts("gpu-1", "group") if e[0] == ADMIN_GROUP[0]]
    assert group[3] == ""  # nobody may sudo; the accounts themselves stay
    assert "analyst" in [e[0] for e in c.accounts("gpu-1")]
    assert f"admin group {ADMIN_GROUP[0]} ({ADMIN_GROUP[1]}) members: none" in result.stdout


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d.__setitem__("cluster_admins", ["mallory"]), "cluster_admins[0] = 'mallory' is not a cluster_users name"),
    (lambda d: d.__setitem__("admin_group", {"name": "sana", "gid": 2999}),
     "key 'admin_group' must differ from cluster_group in name and gid"),
    (lambda d: d.__setitem__("admin_group", {"name": "ops", "gid": 2001}),
     "key 'admin_group' (ops:2001) has a cluster user's name or uid"),
    (lambda d: d.pop("admin_group"), "key 'admin_group' is missing"),
])
def test_bad_admin_settings_fail_in_the_settings_step(make_cluster, edit, expected):
    c = make_cluster()
    settings = c.bundle / "platform-settings.json"
    data = json.loads(settings.read_text())
    edit(data)
    settings.write_text(json.dumps(data))
    step, cause = failure(c.run("controller-1"))
    assert step == "settings" and expected in cause, cause
    assert not (c.root("controller-1") / "etc/sudoers.d").exists()


def test_a_group_taking_the_admin_gid_fails_the_users_step(make_cluster):
    c = make_cluster()
    add_account(c.prepare("gpu-1"), group="wheel:x:2999:")
    step, cause = failure(c.run("gpu-1"))
    assert step == "users" and cause.startswith(
        "GID 2999 of admin group 'sana-admin' is already used by group 'wheel' on this node; pick another GID in "
        "clusterAdminGroup (cdk context) and redeploy"), cause
