"""lifecycle_scripts/on_init_complete.sh run for real on a pretend cluster (see conftest.py).

Six nodes (controller, login, 2 gpu, 2 trn) boot AT THE SAME TIME on one shared FSx: each
env must be built exactly once and every node must end ready. Then the same cluster is
re-provisioned (idempotence), and fresh clusters are broken in the ways a real one breaks.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from lifecycle_cluster import GROUP, LOG_LINE, NODES, SLURM_DAEMON, USERS, Cluster, make_bundle

STEPS = {
    "controller": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "profile", "accounts", "ready"],
    "login": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "profile", "env-gpu", "containers", "ready"],
    "gpu": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "profile", "env-gpu", "containers", "ssh",
            "ready"],
    "trn": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "profile", "env-neuron", "containers",
            "ssh", "ready"],
}
CONTRACT_VARS = ["SANA_ROLE", "SANA_FSX", "SANA_PLATFORM_DIR", "SANA_ENV_GPU", "SANA_ENV_NEURON",
                 "SANA_CHECKPOINT_ROOT", "SANA_LOG_ROOT", "SANA_DATA_ROOT", "SANA_RDZV_PORT",
                 "SANA_ARTEFACTS_BUCKET", "SANA_DATA_BUCKET"]
FAILED = re.compile(r"^\S+Z \[on_init_complete\] FAILED step=([\w-]+): (.+)$")


def role(node: str) -> str:
    return NODES[node][0]


def profile_env(cluster: Cluster, node: str) -> dict[str, str]:
    """The environment a login shell or job script gets: the profile sourced by POSIX sh."""
    profile = cluster.root(node) / "etc/profile.d/sana-platform.sh"
    out = subprocess.run(["sh", "-c", f'. "{profile}" && env -0'], env={"PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def failure(result: subprocess.CompletedProcess) -> tuple[str, str]:
    """(step, cause) of the ONE FAILED line, which must be the last line of the output."""
    lines = result.stdout.strip().splitlines()
    assert result.returncode != 0
    assert [line for line in lines if "FAILED" in line] == lines[-1:], result.stdout[-3000:]
    match = FAILED.match(lines[-1])
    assert match, lines[-1]
    return match.group(1), match.group(2)


def ready_markers(fsx: Path) -> list[Path]:
    """Ready markers in real env dirs (not through the envs/<kind> links)."""
    envs = fsx / "envs"
    return sorted(p for p in envs.glob("*/.sana-env-ready") if not p.parent.is_symlink()) if envs.exists() else []


# ---------------------------------------------------------------- six nodes boot at once


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, standins, wheels) -> tuple[Cluster, dict[str, subprocess.CompletedProcess], float]:
    base = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(base, make_bundle(base / "bundle", wheels, package_hash="pkg0001"), standins)
    started = time.monotonic()
    procs = {node: cluster.start(node) for node in NODES}
    results = {}
    for node, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[node] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return cluster, results, time.monotonic() - started


def test_every_node_ends_ready(cluster):
    _, results, _ = cluster
    for node, result in results.items():
        assert result.returncode == 0, f"{node}:\n{result.stdout[-4000:]}\n{result.stderr}"
        last = result.stdout.strip().splitlines()[-1]
        assert re.search(rf"\[on_init_complete\] READY node={node} role={role(node)} in \d+s$", last), last
        assert "FAILED" not in result.stdout
        assert result.stderr == ""  # everything goes to stdout (CloudWatch) and the log


def test_concurrent_boot_builds_each_env_exactly_once(cluster):
    c, _, _ = cluster
    builds = c.builds()
    assert len([b for b in builds if "/envs/gpu-" in b]) == 1, builds
    assert len([b for b in builds if "/envs/neuron-" in b]) == 1, builds
    # The other node of each group waited for the lock and found the env ready.
    waited = [n for n in ("gpu-1", "gpu-2", "trn-1", "trn-2") if "was built by" in c.log(n)]
    assert len(waited) == 2, waited
    # Controller and login build nothing and never wait for the build lock; the login node
    # only makes sure it has the base Python the GPU env links to.
    assert "env" not in " ".join(re.findall(r"\[on_init_complete\] step (\S+)", c.log("controller-1")))
    login = c.log("login-1")
    assert "base Python: " in login and "building env" not in login and "build lock" not in login


def test_log_has_every_step_in_order_with_timestamps(cluster):
    c, results, _ = cluster
    for node in NODES:
        log = c.log(node)
        assert log == results[node].stdout  # the log file holds exactly what went to stdout
        ours = [LOG_LINE.match(line) for line in log.splitlines() if LOG_LINE.match(line)]
        started = [m.group(3).split()[1].rstrip(":") for m in ours
                   if m.group(2) == "on_init_complete" and m.group(3).endswith(": start")]
        assert started == STEPS[role(node)], node
        done = [m for m in ours if re.fullmatch(r"step [\w-]+: done in \d+s", m.group(3))]
        assert len(done) == len(STEPS[role(node)])
        assert all(m.group(1) <= ours[-1].group(1) for m in ours)


@pytest.mark.parametrize("node", list(NODES))
def test_profile_defines_the_job_environment_per_role(cluster, node):
    c, _, _ = cluster
    env = profile_env(c, node)
    fsx = str(c.root(node) / "fsx")
    assert {k: env[k] for k in CONTRACT_VARS} == {
        "SANA_ROLE": role(node), "SANA_FSX": fsx, "SANA_PLATFORM_DIR": f"{fsx}/platform/current",
        "SANA_ENV_GPU": f"{fsx}/envs/gpu", "SANA_ENV_NEURON": f"{fsx}/envs/neuron",
        "SANA_CHECKPOINT_ROOT": f"{fsx}/artefacts/checkpoints", "SANA_LOG_ROOT": f"{fsx}/logs",
        "SANA_DATA_ROOT": f"{fsx}/data", "SANA_RDZV_PORT": "29500",
        "SANA_ARTEFACTS_BUCKET": "sana-artefacts-test", "SANA_DATA_BUCKET": "sana-data-test"}
    assert env["SANA_CACHE_ROOT"] == f"{fsx}/cache"
    # No shared compile cache in the profile: launch.sh picks the user's own one per job.
    assert "NEURON_COMPILE_CACHE_URL" not in env
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1"
    efa = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    if role(node) == "gpu":
        assert efa.items() <= env.items()
        assert env["NCCL_SOCKET_IFNAME"] == "^docker,lo,veth"
        assert not [k for k in env if k.startswith("NEURON_")]
    elif role(node) == "trn":
        assert efa.items() <= env.items()
        assert env["NEURON_CC_FLAGS"] == "--model-type=transformer"
        assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
        assert env["MALLOC_ARENA_MAX"] == "64"
        assert not [k for k in env if k.startswith("NCCL_")]
        # the Neuron root-comm port launch.sh uses, reserved against ephemeral use (now + reboot)
        assert env["SANA_NEURON_COMM_PORT"] == "46820"
        reserved = c.root(node) / "proc/sys/net/ipv4/ip_local_reserved_ports"
        assert "46820" in reserved.read_text().strip().split(",")
        assert (c.root(node) / "etc/sysctl.d/90-sana-neuron.conf").read_text() == \
            "net.ipv4.ip_local_reserved_ports = 46820\n"
    else:
        assert not [k for k in env if k.startswith(("NCCL_", "NEURON_", "FI_"))]


def test_region_in_the_profile_yields_to_an_explicit_one(cluster):
    c, _, _ = cluster
    profile = c.root("login-1") / "etc/profile.d/sana-platform.sh"
    out = subprocess.run(["sh", "-c", f'. "{profile}"; echo "$AWS_DEFAULT_REGION"'],
                         env={"PATH": os.environ["PATH"], "AWS_DEFAULT_REGION": "us-west-2"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "us-west-2"


def test_shared_directories_exist_with_their_owners_and_modes(cluster):
    c, _, _ = cluster
    gid = GROUP[1]
    expected = {"envs": (0, 0, 0o755), "platform": (0, 0, 0o755), "logs/provision": (0, 0, 0o755),
                "data": (0, gid, 0o3775), "artefacts": (0, gid, 0o3775), "logs": (0, 0, 0o1755),
                "logs/root": (0, 0, 0o700), "artefacts/checkpoints": (0, 0, 0o755), "cache": (0, 0, 0o755),
                "cache/inductor": (0, 0, 0o755), "cache/neuron": (0, 0, 0o755), "home": (0, 0, 0o755)}
    # One private directory per cluster user in every tree that holds a user's runs.
    for name, uid in USERS.items():
        for tree in ("logs", "artefacts/checkpoints", "cache/inductor", "cache/neuron"):
            expected[f"{tree}/{name}"] = (uid, gid, 0o700)
    got = {d: ((st := (c.fsx / d).stat()).st_uid, st.st_gid, st.st_mode & 0o7777) for d in expected}
    assert got == expected


def test_package_installed_under_its_hash_with_a_current_link(cluster):
    c, _, _ = cluster
    current = c.fsx / "platform/current"
    assert os.readlink(current) == "pkg0001"
    assert (current / "training/__init__.py").read_text() == (c.bundle / "training/__init__.py").read_text()
    assert (c.fsx / "platform/pkg0001").stat().st_mode & 0o777 == 0o755
    assert not list((c.fsx / "platform").glob(".incoming-*"))  # no leftovers from the losers' copies


@pytest.mark.parametrize("kind,modules", [("gpu", "torch"), ("neuron", "torch, torch_xla, torch_neuronx")])
def test_env_is_ready_and_runs_the_package(cluster, kind, modules):
    c, _, _ = cluster
    link = c.fsx / "envs" / kind
    target = os.readlink(link)
    assert re.fullmatch(rf"{kind}-[0-9a-f]{{12}}", target)
    assert (c.fsx / "envs" / target / ".sana-env-ready").read_text().startswith("key=")
    # What a job does: the env's python, from the profile, imports the backend and the
    # package installed on FSx (through the env's .pth, not PYTHONPATH or the cwd).
    env = profile_env(c, "gpu-1" if kind == "gpu" else "trn-1")
    python = Path(env[f"SANA_ENV_{kind.upper()}"]) / "bin/python"
    out = subprocess.run([str(python), "-I", "-c", f"import {modules}, training; print({modules.replace(', ', '.STANDIN, ')}.STANDIN,"
                          " training.VERSION, training.__file__)"], cwd="/", capture_output=True, text=True, check=True)
    *standins, version, package_file = out.stdout.split()
    assert (standins, version) == (modules.split(", "), "pkg0001")
    # Through the platform/current link (whichever node's view of FSx built the env).
    assert re.search(r"/fsx/platform/current/training/__init__\.py$", package_file)
    assert Path(package_file).resolve() == (c.fsx / "platform/pkg0001/training/__init__.py").resolve()


def test_status_file_per_node_lists_ready(cluster):
    c, _, _ = cluster
    files = sorted((c.fsx / "logs/provision").glob("*.status"))
    assert [f.stem for f in files] == sorted(NODES)
    for f in files:
        (line,) = f.read_text().splitlines()
        group, ip = NODES[f.stem]
        extra = {"gpu": r" gpu=ok env=\S+", "trn": r" neuron=ok env=\S+"}.get(group, "")
        daemon = SLURM_DAEMON[group]
        assert re.fullmatch(rf"\S+Z READY node={f.stem} group={group} role={group} ip={ip} package=pkg0001 "
                            rf"fsx=ok{extra} slurm={daemon}", line), line


def test_accelerator_nodes_ask_their_driver(cluster):
    c, _, _ = cluster

    def calls(node: str) -> str:
        path = c.root(node) / "standin-calls.log"
        return path.read_text() if path.exists() else ""
    assert "nvidia-smi --list-gpus" in calls("gpu-1") and "neuron-ls" not in calls("gpu-1")
    assert "neuron-ls" in calls("trn-1") and "nvidia-smi" not in calls("trn-1")
    assert "nvidia-smi" not in calls("controller-1") and "neuron-ls" not in calls("controller-1")
    assert "apt-get" not in "".join(calls(n) for n in NODES)  # these AMIs have Python >= 3.11 + venv
    # Each node only ASKS about its own part of Slurm; nothing starts or restarts a daemon.
    for node in NODES:
        slurm = {line for line in calls(node).splitlines() if line.startswith(("systemctl ", "scontrol "))}
        expected = {"scontrol ping"} if role(node) == "login" else {f"systemctl is-active {SLURM_DAEMON[role(node)]}"}
        if role(node) in ("gpu", "trn"):
            expected.add("scontrol show config")  # the ssh step reads PrologFlags
        assert slurm == expected, (node, slurm)


def test_no_step_writes_slurm_configuration(cluster):
    """Extended mode: HyperPod owns slurm.conf and its siblings; the lifecycle writes none."""
    c, _, _ = cluster
    for node in NODES:
        written = [p for p in c.root(node).rglob("*") if "slurm" in p.name and p.suffix == ".conf"]
        assert written == [] and not (c.root(node) / "etc/slurm").exists(), node


def test_rerun_is_idempotent(cluster):
    """Node replacement runs on_init_complete.sh again: same result, no second build, same users."""
    c, _, _ = cluster

    def snapshot(node: str) -> dict:
        return {"profile": (c.root(node) / "etc/profile.d/sana-platform.sh").read_bytes(),
                "envs": {p.name: os.readlink(p) for p in (c.fsx / "envs").iterdir() if p.is_symlink()},
                "markers": {p.parent.name: p.read_text() for p in ready_markers(c.fsx)},
                "package": os.readlink(c.fsx / "platform/current"),
                "accounts": [(c.root(node) / "etc" / f).read_bytes() for f in ("passwd", "group", "shadow")],
                "homes": {p.relative_to(c.fsx).as_posix(): p.read_bytes() for p in (c.fsx / "home").rglob("*")
                          if p.is_file() and ".locks" not in p.parts}}
    before = {node: snapshot(node) for node in ("controller-1", "gpu-1", "trn-2")}
    builds = c.builds()
    for node in before:
        result = c.run(node)
        assert result.returncode == 0, result.stdout[-3000:]
        assert "is already built and ready" in result.stdout or role(node) == "controller"
        assert snapshot(node) == before[node]
    # HyperPod may start the entry with sh: it re-executes itself under bash.
    proc = subprocess.run(["sh", str(c.bundle / "on_init_complete.sh")], env=c.env("login-1"), cwd=c.bundle,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "READY node=login-1" in proc.stdout, proc.stdout[-2000:]
    assert c.builds() == builds
    assert len(list((c.fsx / "envs").glob("gpu-*"))) == 1


def test_cluster_users_are_the_same_on_every_node(cluster):
    c, _, _ = cluster
    group, gid = GROUP
    for node in NODES:
        passwd = {e[0]: e for e in c.accounts(node)}
        for name, uid in USERS.items():
            # Fixed UID, the cluster group as primary group, home on FSx, a login shell.
            assert passwd[name] == [name, "x", str(uid), str(gid), "", f"/fsx/home/{name}", "/bin/bash"], node
        groups = {e[0]: e for e in c.accounts(node, "group")}
        assert groups[group][:3] == [group, "x", str(gid)]
        assert passwd["ubuntu"][2] == "1000"  # the AMI's own accounts are untouched
        shadow = {line.split(":")[0] for line in (c.root(node) / "etc/shadow").read_text().splitlines()}
        assert set(USERS) <= shadow  # the real useradd wrote every file it owns


def test_each_user_has_one_home_and_key_pair_on_fsx(cluster):
    c, _, _ = cluster
    gid = GROUP[1]
    logs = "".join(c.log(node) for node in NODES)
    for name, uid in USERS.items():
        home = c.fsx / "home" / name
        st = home.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o700)
        # Six nodes raced for it; the per-user flock let exactly one create it and its keys.
        assert len(re.findall(rf"created home \S+/fsx/home/{name} .* with SSH key pair", logs)) == 1, name
        ssh = home / ".ssh"
        key, public, auth = ssh / "id_ed25519", ssh / "id_ed25519.pub", ssh / "authorized_keys"
        assert {p.name: ((st := p.stat()).st_uid, st.st_gid) for p in (ssh, key, public, auth)} == \
            {p.name: (uid, gid) for p in (ssh, key, public, auth)}
        assert [ssh.stat().st_mode & 0o777, key.stat().st_mode & 0o777, auth.stat().st_mode & 0o777] == \
            [0o700, 0o600, 0o600]
        # sshd accepts the user with this pair: the private key derives the authorized public key.
        derived = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True, check=True)
        assert auth.read_text().splitlines() == [public.read_text().strip()]
        assert derived.stdout.split()[:2] == public.read_text().split()[:2]
        assert not list((c.fsx / "home").glob(f".{name}.incoming.*"))


def test_ready_waits_for_the_slurm_daemon_hyperpod_is_still_starting(make_cluster):
    """Extended mode: slurmd may come up while OnInitComplete runs; READY waits for it."""
    c = make_cluster()
    proc = c.start("gpu-1", slurm=False, LIFECYCLE_SLURM_WAIT_S="60")
    log = c.root("gpu-1") / "var/log/provision/provisioning.log"
    deadline = time.monotonic() + 120
    while "waiting for Slurm" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, "never waited for slurmd"
        time.sleep(0.2)
    c.start_daemon("gpu-1")  # HyperPod's start of slurmd completes
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "waiting for Slurm (systemctl is-active slurmd: inactive;" in out
    assert "Slurm is up here (systemctl is-active slurmd: active)" in out
    assert "[on_init_complete] READY node=gpu-1 role=gpu in " in out.strip().splitlines()[-1]


@pytest.mark.parametrize("node,expected", [
    ("controller-1", "slurmctld is not active on this node after 2s (systemctl is-active slurmctld: inactive); "
                     "HyperPod starts Slurm in Extended mode (the group's SlurmConfig), not this script: "
                     "see `journalctl -u slurmctld` on this node"),
    ("gpu-1", "slurmd is not active on this node after 2s (systemctl is-active slurmd: inactive); "
              "HyperPod starts Slurm in Extended mode (the group's SlurmConfig), not this script: "
              "see `journalctl -u slurmd` on this node"),
    ("login-1", "slurmctld does not answer from this login node after 2s (scontrol ping: Slurmctld(primary) at "
                "controller-1 is DOWN); HyperPod starts Slurm in Extended mode (the group's SlurmConfig), not this "
                "script: see the controller's status file and `journalctl -u slurmctld` there"),
])
def test_slurm_not_up_fails_the_ready_step(make_cluster, node, expected):
    c = make_cluster()
    result = c.run(node, slurm=False, LIFECYCLE_SLURM_WAIT_S="2")
    step, cause = failure(result)
    assert (step, cause) == ("ready", expected)
    (status,) = (c.fsx / f"logs/provision/{node}.status").read_text().splitlines()
    assert f" FAILED node={node} " in status and " step=ready cause=" in status


def test_failure_waits_for_log_shipping_before_exiting(make_cluster):
    """As HyperPod's sample entry point does: the FAILED line, then a bounded wait, then exit 1."""
    c = make_cluster()
    started = time.monotonic()
    result = c.run("gpu-1", fsx=False, LIFECYCLE_FSX_WAIT_S="0", LIFECYCLE_FAILURE_LOG_WAIT_S="3")
    elapsed = time.monotonic() - started
    step, _ = failure(result)  # still ONE FAILED line, and the last line
    assert step == "fsx"
    assert 3 <= elapsed < 30, elapsed


# ---------------------------------------------------------------- failures, one line each


def test_missing_fsx_fails_in_the_fsx_step(make_cluster):
    c = make_cluster()
    result = c.run("gpu-1", fsx=False, LIFECYCLE_FSX_WAIT_S="1")
    step, cause = failure(result)
    assert step == "fsx"
    assert cause.startswith(f"{c.root('gpu-1')}/fsx is not mounted after 1s")
    assert "FsxLustreConfig" in cause
    assert c.log("gpu-1").splitlines()[-1] == result.stdout.splitlines()[-1]
    assert not (c.root("gpu-1") / "etc/profile.d/sana-platform.sh").exists()
    assert not (c.fsx / "envs").exists()


@pytest.mark.parametrize("problem,expected", [
    ("missing", "cannot read the HyperPod resource config"),
    ("malformed", "is not valid JSON"),
    ("no-groups", "has no InstanceGroups list"),
])
def test_unreadable_resource_config_fails_in_the_identity_step(make_cluster, problem, expected):
    c = make_cluster()
    config = c.base / "resource_config.json"
    if problem == "malformed":
        config.write_text('{"InstanceGroups": [')
    elif problem == "no-groups":
        config.write_text('{"ClusterConfig": {}}')
    result = c.run("login-1", SAGEMAKER_RESOURCE_CONFIG_PATH=str(config))
    step, cause = failure(result)
    assert (step, str(config) in cause, expected in cause) == ("identity", True, True), cause
    assert not (c.fsx / "platform").exists()


def test_node_ip_not_in_resource_config_fails_naming_the_addresses(make_cluster):
    c = make_cluster()
    result = c.run("gpu-1", STANDIN_NODE_IPS="10.9.9.9 172.17.0.1")
    step, cause = failure(result)
    assert step == "identity"
    assert "none of this node's addresses (10.9.9.9 172.17.0.1) is a CustomerIpAddress" in cause
    assert "10.1.1.1" in cause  # names what the config does list


def test_group_without_a_role_in_settings_fails(make_cluster):
    c = make_cluster()
    settings = c.bundle / "platform-settings.json"
    settings.write_text(settings.read_text().replace('"trn": "trn"', '"trn-old": "trn"'))
    step, cause = failure(c.run("trn-1"))
    assert step == "identity"
    assert "instance group 'trn' has no role in platform-settings.json groups" in cause


@pytest.mark.parametrize("edit,expected", [
    (lambda s: s.replace('"fsx_mount": "/fsx",', ""), "key 'fsx_mount' is missing"),
    (lambda s: s.replace('"gpu": "gpu"', '"gpu": "gpus"'), "groups['gpu'] = 'gpus' is not one of"),
    (lambda s: s.replace('"package_hash": "pkg0001"', '"package_hash": "../x"'), "must be a plain directory name"),
    (lambda s: s.replace('"eu-west-1"', '"eu-west-1\\"; touch /tmp/x"'), "key 'region' is not an AWS region name"),
    (lambda s: s[:-3], "not valid JSON"),
])
def test_bad_settings_fail_in_the_settings_step(make_cluster, edit, expected):
    c = make_cluster()
    settings = c.bundle / "platform-settings.json"
    settings.write_text(edit(settings.read_text()))
    step, cause = failure(c.run("controller-1"))
    assert step == "settings" and expected in cause and str(settings) in cause, cause


@pytest.mark.parametrize("obstacle,step,expected", [
    # Something the scripts do not anticipate still fails in one line naming the command.
    ("envs-is-a-file", "dirs", r".*/fsx/envs exists and is not a directory; move it away so the platform can manage it"),
    ("current-is-a-directory", "package", r".*/fsx/platform/current exists and is not a symlink; move it away.*"),
])
def test_unexpected_state_on_fsx_fails_in_one_line(make_cluster, obstacle, step, expected):
    c = make_cluster()
    c.fsx.mkdir()
    if obstacle == "envs-is-a-file":
        (c.fsx / "envs").write_text("not a directory\n")
    else:
        (c.fsx / "platform/current").mkdir(parents=True)
    failed_step, cause = failure(c.run("controller-1"))
    assert failed_step == step and re.fullmatch(expected, cause), cause
    if step == "package":  # after the dirs step, the failure is also in the node's status file
        (status,) = (c.fsx / "logs/provision/controller-1.status").read_text().splitlines()
        assert f" step={step} cause=" in status


def test_failed_env_build_is_never_marked_ready(make_cluster, wheels):
    c = make_cluster(gpu_requirements=f"{wheels['torch']}\n/nonexistent/wheels/diffusers-0.0.0-py3-none-any.whl\n")
    result = c.run("gpu-1")
    step, cause = failure(result)
    assert step == "env-gpu"
    assert cause.startswith("pip install -r ") and "requirements-gpu.txt failed (exit 1)" in cause
    assert "diffusers-0.0.0-py3-none-any.whl" in result.stdout  # pip's own words are in the log
    assert ready_markers(c.fsx) == []
    assert not (c.fsx / "envs/gpu").exists(), "no env link for a failed build"
    assert list((c.fsx / "envs").glob("gpu-*")) == [], "the half-built env is removed"
    (status,) = (c.fsx / "logs/provision/gpu-1.status").read_text().splitlines()
    assert " FAILED node=gpu-1 " in status and " step=env-gpu cause=pip install -r " in status
    # The lock went with the process: the next node to boot gets it at once and builds afresh
    # (that path is the concurrent-boot test's first builder).
    with open(c.fsx / "envs/.locks/gpu.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_node_without_a_new_enough_python_fails_naming_the_package(make_cluster):
    """Stands for an AMI whose python3 is too old: the step tries apt-get (a failing stand-in)."""
    c = make_cluster()
    step, cause = failure(c.run("gpu-1", LIFECYCLE_MIN_PYTHON="3.99"))
    assert step == "env-gpu"
    assert cause.startswith("no Python >= 3.99 on this node (python3 is 3.")
    assert "apt-get install python3.99 python3.99-venv failed" in cause
    assert "apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends python3.99 python3.99-venv" in \
        (c.root("gpu-1") / "standin-calls.log").read_text()
    assert ready_markers(c.fsx) == [] and c.builds() == []


def test_waiting_for_another_nodes_build_times_out_in_one_line(make_cluster):
    c = make_cluster()
    locks = c.fsx / "envs/.locks"
    locks.mkdir(parents=True)
    with open(locks / "gpu.lock", "w") as held:  # another node is building (flock(2), as flock(1))
        fcntl.flock(held, fcntl.LOCK_EX)
        result = c.run("gpu-1", LIFECYCLE_ENV_LOCK_TIMEOUT_S="1")
    step, cause = failure(result)
    assert step == "env-gpu"
    assert cause.startswith(f"timed out after 1s waiting for {c.root('gpu-1')}/fsx/envs/.locks/gpu.lock")
    assert ready_markers(c.fsx) == [] and c.builds() == []
