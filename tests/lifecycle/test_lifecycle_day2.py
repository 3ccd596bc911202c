"""Day-2 operations on the pretend cluster: a user added after the deploy, a node replaced
after a `cdk deploy` nobody rolled out.

A user reaches the running nodes the documented way (runbooks/users.md): `cdk deploy` uploads a
new prefix (the settings are part of the package hash), the rollout makes it current, and each
node's sana-settings.timer applies it (the test fires the timer where systemd would after its
interval). A replaced node boots from the newest prefix but serves what is current.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from lifecycle_cluster import ADMIN_GROUP, ADMINS, GROUP, USERS, Cluster, make_bundle
from test_lifecycle_on_init_complete import failure
from test_lifecycle_rollout import rollout, upload_new

NODES = ("controller-1", "login-1", "gpu-1", "trn-1")
SETTINGS_LINE = re.compile(r"^\S+Z (APPLIED|FAILED) node=(\S+) role=(\S+) package=(\S+) (.*)$")


def boot(c: Cluster, nodes=NODES) -> Cluster:
    """The controller first (HyperPod provisions it first), then the others at the same time."""
    assert c.run("controller-1").returncode == 0
    assert c.wait_late_check("controller-1") == 0
    procs = {node: c.start(node) for node in nodes if node != "controller-1"}
    for node, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{node}: {out[-3000:]}"
    return c


def add_carol(data: dict) -> None:
    data["cluster_users"].append({"name": "carol", "uid": 2003})


def add_carol_as_admin(data: dict) -> None:
    add_carol(data)
    data["cluster_admins"].append("carol")


def settings_line(c: Cluster, node: str) -> tuple[str, ...]:
    (line,) = (c.fsx / f"logs/provision/{node}.settings").read_text().splitlines()
    match = SETTINGS_LINE.match(line)
    assert match, line
    return match.groups()


def associations(c: Cluster) -> list[str]:
    """What the controller's slurmdbd holds (the sacctmgr stand-in's records)."""
    return (c.root("controller-1") / "run/standin-accounting").read_text().splitlines()


@pytest.mark.slow
def test_a_user_added_after_deploy_reaches_every_running_node_by_the_rollout(make_cluster, wheels, s3_endpoint,
                                                                             lifecycle_bucket):
    c = boot(make_cluster(package_hash="pkg0001"))
    for node in NODES:  # the boot applied the current package's settings: the timer has nothing to do
        assert c.fire_settings_timer(node) == 0
        assert not (c.fsx / f"logs/provision/{node}.settings").exists()
    assert "assoc carol sana" not in associations(c)

    # cdk.json gains carol (an admin too); `cdk deploy` uploads a new prefix: same code, another hash.
    _, new = upload_new(c, wheels, s3_endpoint, lifecycle_bucket, "pkg0001", edit_settings=add_carol_as_admin)
    assert new != "pkg0001"
    result, outcome, _ = rollout(c, "gpu-1", new)
    assert outcome == "PENDING", result.stdout[-2000:]
    assert "building env" not in result.stdout  # same requirements: nothing to build
    result, outcome, _ = rollout(c, "trn-1", new)
    assert outcome == "ROLLED OUT", result.stdout[-2000:]
    assert os.readlink(c.fsx / "platform/current") == new
    assert all("carol" not in [e[0] for e in c.accounts(node)] for node in NODES)  # nothing but the timer adds her

    for node in NODES:
        assert c.fire_settings_timer(node) == 0, c.unit_output("sana-settings.service", node)[-3000:]
        assert ["carol", "x", "2003", str(GROUP[1]), "", "/fsx/home/carol", "/bin/bash"] in c.accounts(node)
        verdict, name, _, package, rest = settings_line(c, node)
        assert (verdict, name, package) == ("APPLIED", node, new)
        assert rest == f"users={','.join([*USERS, 'carol'])} admins={','.join([*ADMINS, 'carol'])}"
        (group,) = [e for e in c.accounts(node, "group") if e[0] == ADMIN_GROUP[0]]
        assert group[3] == ",".join([*ADMINS, "carol"])  # she may sudo there
    assert "assoc carol sana" in associations(c)  # her association, made once slurmdbd answered
    home = c.fsx / "home/carol"
    assert home.stat().st_uid == 2003 and (home / ".ssh/id_ed25519").exists()
    for rel in ("logs/carol", "artefacts/checkpoints/carol", "cache/inductor/carol", "cache/neuron/carol", "runs/carol",
                "exports/carol"):
        assert (c.fsx / rel).stat().st_uid == 2003, rel

    # Every later run of the timer: nothing to do, nothing written.
    before = {node: (c.fsx / f"logs/provision/{node}.settings").read_text() for node in NODES}
    for node in NODES:
        assert c.fire_settings_timer(node) == 0
    assert {node: (c.fsx / f"logs/provision/{node}.settings").read_text() for node in NODES} == before
    assert associations(c).count("assoc carol sana") == 1


@pytest.mark.slow
def test_a_node_that_cannot_apply_the_settings_says_why_and_retries(make_cluster, wheels, s3_endpoint,
                                                                    lifecycle_bucket):
    """A UID taken on one node: that node's settings line is FAILED naming the step and the
    conflict, the package stays unapplied there (the next run tries again), the others apply."""
    c = boot(make_cluster(package_hash="pkg0001"), nodes=("controller-1", "gpu-1", "trn-1"))
    _, new = upload_new(c, wheels, s3_endpoint, lifecycle_bucket, "pkg0001", edit_settings=add_carol)
    assert rollout(c, "gpu-1", new)[1] == "PENDING" and rollout(c, "trn-1", new)[1] == "ROLLED OUT"
    with open(c.root("gpu-1") / "etc/passwd", "a") as passwd:  # someone made a local account by hand
        passwd.write("dave:x:2003:2003::/home/dave:/bin/bash\n")

    assert c.fire_settings_timer("gpu-1") == 1
    verdict, _, _, package, rest = settings_line(c, "gpu-1")
    assert (verdict, package) == ("FAILED", new)
    assert rest == ("step=users cause=UID 2003 of cluster user 'carol' is already used by 'dave' on this node; "
                    "pick another UID in clusterUsers (cdk context) and redeploy")
    assert (c.root("gpu-1") / "var/lib/sana-platform/settings-applied").read_text().strip() != new
    assert c.fire_settings_timer("trn-1") == 0 and settings_line(c, "trn-1")[0] == "APPLIED"

    # Fixed by hand on the node: the next run of the timer applies the package.
    passwd = c.root("gpu-1") / "etc/passwd"
    passwd.write_text("".join(line for line in passwd.read_text().splitlines(keepends=True)
                              if not line.startswith("dave:")))
    assert c.fire_settings_timer("gpu-1") == 0
    assert settings_line(c, "gpu-1")[0] == "APPLIED"
    assert ["carol", "x", "2003", str(GROUP[1]), "", "/fsx/home/carol", "/bin/bash"] in c.accounts("gpu-1")


@pytest.mark.slow
def test_a_replaced_node_installs_its_package_beside_current_and_moves_nothing(make_cluster, wheels, s3_endpoint,
                                                                               lifecycle_bucket):
    """After a `cdk deploy` with new GPU requirements and no rollout, HyperPod replaces gpu-2 (or
    scales up): it boots from the new prefix, installs that package beside the others, and
    serves the package and envs every other node serves; then the rollout moves everything."""
    c = boot(make_cluster(package_hash="pkg0001"), nodes=("controller-1", "gpu-1", "trn-1"))
    envs = c.fsx / "envs"
    links = {p: os.readlink(p) for p in (c.fsx / "platform/current", envs / "gpu", envs / "neuron")}
    bundle, new = upload_new(c, wheels, s3_endpoint, lifecycle_bucket, "pkg0002",
                             gpu_requirements=f"# pkg0002 changes the GPU requirements\n{wheels['torch']}\n")
    c.bundle = bundle  # the cluster's SourceS3Uri now names the new prefix: what a new node downloads

    result = c.run("gpu-2")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (c.fsx / f"platform/{new}/training/__init__.py").exists()  # installed beside
    assert {p: os.readlink(p) for p in links} == links  # current and both env links untouched
    assert f"stays: only a rollout moves it (runbooks/rollout.md); this node's package {new} waits beside it" \
        in result.stdout
    assert "building env" not in c.log("gpu-2")
    assert c.wait_late_check("gpu-2") == 0
    (status,) = c.status("gpu-2")
    assert " READY node=gpu-2 " in status
    # What a job on gpu-2 runs: the cluster's package through the cluster's env.
    out = subprocess.run([str(envs / "gpu/bin/python"), "-I", "-c", "import training; print(training.VERSION)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "pkg0001"
    # Its timer applies the current package's settings, not its own.
    assert c.fire_settings_timer("gpu-2") == 0 and settings_line(c, "gpu-2")[3] == "pkg0001"

    # The rollout, as documented, moves the cluster (gpu-2 included) onto the new package.
    assert rollout(c, "gpu-2", new)[1] == "PENDING"
    assert rollout(c, "trn-1", new)[1] == "ROLLED OUT"
    assert os.readlink(c.fsx / "platform/current") == new and os.readlink(envs / "gpu") != links[envs / "gpu"]


def test_a_node_whose_env_key_differs_uses_the_clusters_env_or_fails_leaving_it(make_cluster, wheels):
    """gpu-2 boots from a newer upload whose settings change what its env key hashes (here the
    pip index): it uses the cluster's ready env when that runs there, never moves the link, and
    fails in env-gpu naming why when it does not (as on an AMI without the env's interpreter)."""
    c = make_cluster(package_hash="pkg0001")
    assert c.run("gpu-1").returncode == 0
    link = c.fsx / "envs/gpu"
    before = os.readlink(link)
    c.bundle = make_bundle(c.base / "bundle-pkg0002", wheels, package_hash="pkg0002",
                           edit_settings=lambda d: d.__setitem__("neuron_pip_index", "https://pip.example/simple"))
    result = c.run("gpu-2")
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"env {c.root('gpu-2')}/fsx/envs/gpu -> {before} stays: ready and imports torch here; only a rollout " \
        "moves it" in result.stdout
    assert os.readlink(link) == before and "building env" not in c.log("gpu-2")

    python = link / "bin/python"
    real = python.resolve()
    python.unlink()
    python.symlink_to("/nonexistent/python3.11")  # the interpreter a node of another AMI lacks
    try:
        step, cause = failure(c.run("gpu-2"))  # provisioned again
    finally:
        python.unlink()
        python.symlink_to(real)
    assert step == "env-gpu", cause
    assert cause.startswith(f"env {c.root('gpu-2')}/fsx/envs/gpu -> {before} is the cluster's (ready) but cannot "
                            "import torch on this node: "), cause
    assert cause.endswith("replace the node with the cluster's AMI, or roll out a package (the rollout rebuilds "
                          "the envs)")
    assert os.readlink(link) == before and "building env" not in c.log("gpu-2")
