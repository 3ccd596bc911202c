"""lifecycle_scripts/on_init_complete.sh run for real on a pretend cluster (see conftest.py).

Six nodes (controller, login, 2 gpu, 2 trn) boot AT THE SAME TIME on one shared FSx: each
env must be built exactly once, enroot and pyxis installed where the image lacks them, and
every node must end READY once its Slurm daemon runs. Then the same cluster is re-provisioned
(idempotence), and fresh clusters are broken in the ways a real one breaks.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

import node_model
import pytest
from lifecycle_cluster import (
    CONTROLLER_SLURM_CONF,
    ENROOT_VERSION,
    GROUP,
    LOG_LINE,
    NODES,
    SLURM_DAEMON,
    SLURM_READY,
    USERS,
    Cluster,
    make_bundle,
)

STEPS = {
    "controller": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "sync", "profile", "containers",
                   "observability", "ready"],
    "login": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "sync", "profile", "env-gpu",
              "containers", "observability", "ready"],
    "gpu": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "sync", "profile", "env-gpu",
            "containers", "observability", "ssh", "ready"],
    "trn": ["settings", "identity", "imds", "fsx", "dirs", "users", "package", "sync", "profile", "env-neuron",
            "containers", "observability", "ssh", "ready"],
}
CONTRACT_VARS = ["SANA_ROLE", "SANA_FSX", "SANA_PLATFORM_DIR", "SANA_ENV_GPU", "SANA_ENV_NEURON",
                 "SANA_CHECKPOINT_ROOT", "SANA_LOG_ROOT", "SANA_DATA_ROOT", "SANA_RDZV_PORT",
                 "SANA_ARTEFACTS_BUCKET", "SANA_DATA_BUCKET"]
FAILED = re.compile(r"^\S+Z \[on_init_complete\] FAILED step=([\w-]+): (.+)$")
PYXIS_LINE = "optional /usr/local/lib/slurm/spank_pyxis.so"


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


def boot_controller(c: Cluster) -> None:
    """HyperPod provisions the controller first (hyperpod-mental-model.md, "controller nodes
    provision first"): its slurmctld runs and it has registered pyxis."""
    assert c.run("controller-1").returncode == 0
    assert c.wait_late_check("controller-1") == 0


def done_line(node: str) -> str:
    return rf"\[on_init_complete\] DONE node={node} role={role(node)} in \d+s, warnings: none; "


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, standins, wheels, sources) -> tuple[Cluster, dict[str, subprocess.CompletedProcess], float]:
    base = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(base, make_bundle(base / "bundle", wheels, package_hash="pkg0001"), standins, sources)
    started = time.monotonic()
    # Every daemon is up before the lifecycles start (prepare), so the compute nodes' slurmd
    # fetched the controller's config before it registered pyxis: the registration reaches
    # them through `scontrol reconfigure`, which the late check waits for.
    procs = {node: cluster.start(node, LIFECYCLE_PYXIS_WAIT_S="120") for node in NODES}
    results = {}
    for node, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[node] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    for node in NODES:
        assert cluster.wait_late_check(node) == 0, (cluster.root(node) / "var/log/provision/node-ready.log").read_text()
    return cluster, results, time.monotonic() - started


def test_every_node_ends_ready(cluster):
    c, results, _ = cluster
    for node, result in results.items():
        assert result.returncode == 0, f"{node}:\n{result.stdout[-4000:]}\n{result.stderr}"
        last = result.stdout.strip().splitlines()[-1]
        assert re.search(done_line(node), last), last
        assert "FAILED" not in result.stdout and "[on_init_complete] WARN " not in result.stdout
        assert result.stderr == ""  # everything goes to stdout (CloudWatch) and the log
        # The late check (after slurmd/slurmctld) wrote READY, with no WARN line.
        (status,) = c.status(node)
        assert f" READY node={node} " in status, status


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
                "cache/inductor": (0, 0, 0o755), "cache/neuron": (0, 0, 0o755), "home": (0, 0, 0o755),
                # the paths the runbooks' commands use: weights an admin stages, runs by hand, exports
                "models": (0, 0, 0o755), "runs": (0, 0, 0o755), "exports": (0, 0, 0o755)}
    # One private directory per cluster user in every tree that holds a user's runs.
    for name, uid in USERS.items():
        for tree in ("logs", "artefacts/checkpoints", "cache/inductor", "cache/neuron", "runs", "exports"):
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
        (line,) = f.read_text().splitlines()  # READY and no WARN line
        group, ip = NODES[f.stem]
        extra = {"gpu": r" gpu=ok env=\S+", "trn": r" neuron=ok env=\S+"}.get(group, "")
        assert re.fullmatch(rf"\S+Z READY node={f.stem} group={group} role={group} ip={ip} package=pkg0001 "
                            rf"fsx=ok{extra} slurm={SLURM_READY[group]} slurm_wait=\d+s", line), line


def test_accelerator_nodes_ask_their_driver(cluster):
    c, _, _ = cluster

    def calls(node: str) -> str:
        path = c.root(node) / "standin-calls.log"
        return path.read_text() if path.exists() else ""
    assert "nvidia-smi --list-gpus" in calls("gpu-1") and "neuron-ls" not in calls("gpu-1")
    assert "neuron-ls" in calls("trn-1") and "nvidia-smi" not in calls("trn-1")
    assert "nvidia-smi" not in calls("controller-1") and "neuron-ls" not in calls("controller-1")
    # These AMIs have Python >= 3.11 + venv: apt-get only installs the container runtime, and
    # only where container jobs run.
    for node in NODES:
        installs = [ln for ln in calls(node).splitlines() if ln.startswith("apt-get") and " install " in ln]
        assert bool(installs) == (role(node) != "controller"), (node, installs)
        assert all("python" not in ln for ln in installs), installs
    # Each node only ASKS about its own part of Slurm; nothing starts, stops or restarts a
    # daemon. The systemd calls are for the platform's own unit; the controller asks slurmctld
    # to send the new plugstack.conf to the nodes (`scontrol reconfigure`).
    for node in NODES:
        asked = {ln for ln in calls(node).splitlines() if ln.startswith(("systemctl is-active", "scontrol"))}
        daemon = SLURM_DAEMON[role(node)]
        expected = {f"systemctl is-active {daemon}"}
        if role(node) == "login":
            expected |= {"scontrol ping"}  # the late check: the client reaches slurmctld
        if role(node) == "controller":
            expected |= {"scontrol ping", "scontrol reconfigure", "scontrol show config"}
        # gpu/trn: the late check reads PrologFlags only where pam_slurm_adopt is installed
        # (test_ssh_access.py); this image has no module, like the HyperPod AMI
        assert asked == expected, (node, asked)
        units = {ln for ln in calls(node).splitlines() if ln.startswith("systemctl ") and "is-active" not in ln
                 and "show " not in ln}
        # The platform's own units only: the late check and the settings timer (settings_timer.sh).
        assert units == {"systemctl daemon-reload", "systemctl enable sana-node-ready.service",
                         "systemctl start --no-block sana-node-ready.service", "systemctl enable sana-settings.timer",
                         "systemctl start sana-settings.timer"}, (node, units)


@pytest.mark.parametrize("node", ["controller-1", "trn-2"])
def test_the_settings_timer_runs_the_current_packages_sync_every_two_minutes(cluster, node):
    """sana-settings.timer (settings_timer.sh): enabled for every boot (timers.target), started now,
    its service running settings_sync.sh of whatever package `current` is (systemd.timer(5))."""
    c, _, _ = cluster
    units = c.root(node) / node_model.UNITS
    timer = (units / "sana-settings.timer").read_text()
    assert "OnActiveSec=30s\nOnUnitActiveSec=2min\n" in timer and "WantedBy=timers.target" in timer
    service = (units / "sana-settings.service").read_text()
    assert "ExecStart=/bin/bash /fsx/platform/current/lifecycle/settings_sync.sh\n" in service
    assert "Type=oneshot" in service
    assert "sana-settings.timer" in node_model.wanted_by(c.root(node), "timers.target")
    assert (c.root(node) / node_model.MARKERS / "sana-settings.timer.active").exists()
    # The boot applied the current package's settings: the first run has nothing to do.
    assert (c.root(node) / "var/lib/sana-platform/settings-applied").read_text().strip() == "pkg0001"


def test_the_late_check_is_a_unit_that_runs_after_the_slurm_daemon(cluster):
    """sana-node-ready.service: WantedBy= and After= the node's daemon (systemd.unit(5)), enabled
    by the real systemctl --root, running the node-local copy of slurm_ready.sh."""
    c, _, _ = cluster
    for node in NODES:
        root = c.root(node)
        daemon = f"{SLURM_DAEMON[role(node)]}.service"
        unit = (root / "etc/systemd/system/sana-node-ready.service").read_text()
        assert f"After={daemon}\n" in unit and f"WantedBy={daemon}\n" in unit and "Type=oneshot\n" in unit
        assert node_model.exec_start(root, "sana-node-ready.service") == \
            ["/bin/bash", f"{root}/var/lib/sana-platform/lifecycle/slurm_ready.sh"]
        assert node_model.wanted_by(root, daemon) == ["sana-node-ready.service"]
        # It reads the scripts from the node, not from FSx or the download.
        assert (root / "var/lib/sana-platform/lifecycle/slurm_ready.sh").read_bytes() == \
            (c.bundle / "slurm_ready.sh").read_bytes()


def test_enroot_and_pyxis_are_installed_where_the_image_lacks_them(cluster):
    c, _, _ = cluster
    for node in NODES:
        root = c.root(node)
        log = c.log(node)
        if role(node) == "controller":
            assert not (root / "usr/bin/enroot").exists() and not (root / "usr/local/lib/slurm").exists()
            continue
        # The .debs (downloaded and unpacked by apt-get) and pyxis built against the node's Slurm.
        version = subprocess.run([str(root / "usr/bin/enroot"), "version"], capture_output=True, text=True).stdout
        assert version.strip() == ENROOT_VERSION
        assert (root / "usr/local/lib/slurm/spank_pyxis.so").read_bytes()[:4] == b"\x7fELF"
        assert f"-I {root}/opt/slurm/include" in log and "installed at /usr/local/lib/slurm/spank_pyxis.so" in log
        conf = (root / "etc/enroot/enroot.conf").read_text()
        scratch = "/opt/dlami/nvme" if role(node) in ("gpu", "trn") else "/opt/sagemaker"
        assert f"ENROOT_DATA_PATH           {scratch}/tmp/enroot/data/user-$(id -u)\n" in conf, node
        assert not list((root / "tmp").glob("sana-containers.*"))  # the download and build dir is gone
        assert "pyxis /usr/local/lib/slurm/spank_pyxis.so registered in" in \
            (root / "var/log/provision/node-ready.log").read_text()


def test_pyxis_is_registered_on_the_controller_and_reaches_the_configless_nodes(cluster):
    """The controller's plugstack.conf gets the line itself (an include with a path would not
    travel); every other node has no Slurm config of its own and runs with the conf-cache."""
    c, _, _ = cluster
    ctld = c.root("controller-1") / "opt/slurm/etc"
    assert (ctld / "plugstack.conf").read_text().splitlines()[-1] == PYXIS_LINE
    assert (ctld / "slurm.conf").read_text() == CONTROLLER_SLURM_CONF  # HyperPod's file, untouched
    for node in NODES:
        if role(node) == "controller":
            continue
        root = c.root(node)
        assert not (root / "opt/slurm/etc").exists()
        cached = (root / "var/spool/slurmd/conf-cache/plugstack.conf").read_text()
        assert cached == (ctld / "plugstack.conf").read_text(), node
        srun = subprocess.run(["srun", "--help"], env=c.env(node), capture_output=True, text=True)
        assert "--container-image" in srun.stdout


def test_no_step_writes_slurm_configuration(cluster):
    """Extended mode: HyperPod owns slurm.conf and its siblings; the lifecycle writes none (the
    controller's plugstack.conf is the one Slurm file it edits, above)."""
    c, _, _ = cluster
    for node in NODES:
        root = c.root(node)
        written = [p for p in root.rglob("*.conf") if p.name in node_model.SHIPPED and p.name != "plugstack.conf"
                   and "conf-cache" not in p.parts]
        assert written == ([root / "opt/slurm/etc/slurm.conf"] if role(node) == "controller" else []), node
        assert not (root / "etc/slurm").exists(), node


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
                          if p.is_file() and ".locks" not in p.parts},
                "plugstack": (c.root("controller-1") / "opt/slurm/etc/plugstack.conf").read_bytes(),
                "enroot": [(c.root(node) / p).read_bytes() for p in ("etc/enroot/enroot.conf", "usr/bin/enroot")
                           if (c.root(node) / p).exists()]}
    before = {node: snapshot(node) for node in ("controller-1", "gpu-1", "trn-2")}
    builds = c.builds()
    for node in before:
        result = c.run(node, LIFECYCLE_PYXIS_WAIT_S="60")
        assert result.returncode == 0, result.stdout[-3000:]
        assert "is already built and ready" in result.stdout or role(node) == "controller"
        assert "pyxis is already registered" in result.stdout or role(node) != "controller"
        assert "enroot 3.4.1 is installed" in result.stdout or role(node) == "controller"
        assert c.wait_late_check(node) == 0
        assert snapshot(node) == before[node]
        assert " READY " in c.status(node)[0]
    # HyperPod may start the entry with sh: it re-executes itself under bash.
    proc = subprocess.run(["sh", str(c.bundle / "on_init_complete.sh")], env=c.env("login-1"), cwd=c.bundle,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "DONE node=login-1" in proc.stdout, proc.stdout[-2000:]
    c.wait_late_check("login-1")
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


@pytest.mark.parametrize("node", ["gpu-1", "login-1", "controller-1"])
def test_a_slurm_daemon_that_starts_10_minutes_after_the_lifecycle_makes_the_node_ready_then(make_cluster, node):
    """HyperPod may start the daemon only after OnInitComplete returned. The lifecycle succeeds
    (PENDING), and when the daemon starts, systemd runs the late check, which records READY and
    how long Slurm took. The clock stands 10 minutes later (the date stand-in), nobody waits."""
    c = make_cluster()
    if node != "controller-1":
        boot_controller(c)
    result = c.run(node, slurm=False)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(done_line(node), result.stdout.strip().splitlines()[-1])
    (pending,) = c.status(node)
    daemon = SLURM_DAEMON[role(node)]
    assert f" PENDING node={node} " in pending and pending.endswith(f" slurm=waiting-for-{daemon}"), pending
    assert f"{daemon} is inactive (HyperPod starts it, not this script)" in result.stdout
    assert not (c.root(node) / node_model.MARKERS / "sana-node-ready.service.result").exists()  # nothing ran yet

    c.start_daemon(node, STANDIN_CLOCK_OFFSET_S="600")  # HyperPod, 10 minutes later
    assert c.wait_late_check(node, timeout=5) == 0
    (ready,) = c.status(node)
    match = re.fullmatch(rf"\S+Z READY node={node} .* slurm={SLURM_READY[role(node)]} slurm_wait=(\d+)s", ready)
    assert match and 600 <= int(match.group(1)) < 700, ready  # 10 minutes of the test's clock, plus real seconds
    late = (c.root(node) / "var/log/provision/node-ready.log").read_text()
    assert "Slurm is up here" in late and f", {match.group(1)}s after the lifecycle finished" in late
    assert "FAILED" not in c.log(node) + late


def test_a_daemon_starting_while_the_ready_step_runs_is_waited_for_by_the_queued_check(make_cluster):
    """slurmd `activating` when the ready step looks: its start job was queued before the unit
    was enabled, so the step queues the check itself (--no-block), which waits for slurmd."""
    c = make_cluster()
    boot_controller(c)
    root = c.prepare("gpu-1", slurm=False)
    (root / node_model.MARKERS / "slurmd.activating").touch()
    proc = c.start("gpu-1", slurm=False)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert "slurmd is activating: started sana-node-ready.service" in out
    log = root / "var/log/provision/node-ready.log"
    deadline = time.monotonic() + 60
    while "waiting for Slurm (activating" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the queued check never waited for slurmd"
        time.sleep(0.2)
    c.start_daemon("gpu-1")  # slurmd's start job completes
    assert c.wait_late_check("gpu-1") == 0
    assert " READY node=gpu-1 " in c.status("gpu-1")[0]


@pytest.mark.parametrize("node,expected", [
    ("controller-1", "slurmctld is not active on this node 2s after slurmctld.service started (inactive); "
                     "HyperPod runs the daemon (the group's SlurmConfig): see `journalctl -u slurmctld`"),
    ("login-1", "slurmctld does not answer from this login node 2s after slurmd.service started (Slurmctld(primary) "
                "at controller-1 is DOWN); HyperPod runs the daemon (the group's SlurmConfig): see `journalctl -u slurmd`"),
])
def test_a_daemon_that_never_comes_up_leaves_the_node_pending_never_failed(make_cluster, node, expected):
    """The daemon's start job ends but the daemon is not up (Wants= still runs the unit): the
    check gives up after its bound, the status says why, and the unit fails; the node is not
    failed (it is not replaced into the same loop)."""
    c = make_cluster()
    result = c.run(node, slurm=False)
    assert result.returncode == 0, result.stdout[-3000:]
    env = c.env(node, LIFECYCLE_SLURM_WAIT_S="2")
    assert node_model.run_unit(c.root(node), "sana-node-ready.service", env) == 1
    (status,) = c.status(node)
    assert f" PENDING node={node} " in status and status.endswith(f" cause={expected}"), status
    assert "FAILED" not in status


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


# ---------------------------------------------------------------- optional parts warn


def warnings(c: Cluster, node: str) -> list[tuple[str, str]]:
    """(part, cause) of each WARN line of the node's status file."""
    lines = c.status(node)[1:]
    found = [re.fullmatch(rf"\S+Z WARN node={node} part=([\w-]+) cause=(.+)", line) for line in lines]
    assert all(found), lines
    return [(m.group(1), m.group(2)) for m in found]


def test_container_runtime_off_is_a_warning_and_installs_nothing(make_cluster):
    c = make_cluster()
    settings = c.bundle / "platform-settings.json"
    settings.write_text(settings.read_text().replace('"container_runtime": true', '"container_runtime": false'))
    for node in ("controller-1", "login-1"):
        result = c.run(node)
        assert result.returncode == 0 and "FAILED" not in result.stdout, result.stdout[-3000:]
        assert c.wait_late_check(node) == 0
    assert " READY node=login-1 " in c.status("login-1")[0]
    assert warnings(c, "login-1") == [("containers", "containerRuntime=false: enroot and pyxis are not installed or "
                                       "configured here, container jobs (SANA_CONTAINER_IMAGE) cannot run on this node")]
    assert warnings(c, "controller-1") == []  # no container jobs there; nothing registered either
    assert not (c.root("controller-1") / "opt/slurm/etc/plugstack.conf").exists()
    assert not (c.root("login-1") / "usr/bin/enroot").exists()
    assert not (c.root("login-1") / "usr/local/lib/slurm").exists()
    assert "apt-get" not in (c.root("login-1") / "standin-calls.log").read_text()


@pytest.mark.parametrize("broken,expected", [
    ("LIFECYCLE_ENROOT_RELEASE_URL", r"cannot download file:///nonexistent/enroot_3\.4\.1-1_\w+\.deb \(curl exit 37\)"),
    ("LIFECYCLE_PYXIS_SOURCE_URL", r"cannot download file:///nonexistent/v0\.19\.0\.tar\.gz \(curl exit 37\)"),
])
def test_a_container_runtime_that_cannot_be_installed_warns_and_the_node_is_ready(make_cluster, broken, expected):
    """The install fails (no route to GitHub, say): one WARN line naming why; the node trains."""
    c = make_cluster()
    boot_controller(c)
    url = "file:///nonexistent" if broken.endswith("RELEASE_URL") else "file:///nonexistent/v0.19.0.tar.gz"
    result = c.run("login-1", **{broken: url})
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\[on_init_complete\] WARN step=containers: .*\(optional: the node goes on without it\)",
                     result.stdout)
    assert "DONE node=login-1 role=login in " in result.stdout.splitlines()[-1]
    assert ", warnings: containers; " in result.stdout.splitlines()[-1]
    assert c.wait_late_check("login-1") == 0
    assert " READY node=login-1 " in c.status("login-1")[0]
    ((part, cause),) = warnings(c, "login-1")  # the late pyxis check does not pile on a second one
    assert part == "containers" and re.fullmatch(expected, cause), cause
    assert not list((c.root("login-1") / "tmp").glob("sana-containers.*"))


def test_fsx_behind_an_automount_is_read_from_its_lustre_line(make_cluster):
    """x-systemd.automount: findmnt lists autofs first; an autofs-only listing is touched and
    asked again, and stays a failure naming what is there."""
    c = make_cluster()
    root = c.prepare("controller-1")
    (root / "run").mkdir(exist_ok=True)
    (root / "run/standin-fsx-mount").write_text("autofs     rw,relatime,fd=5,pgrp=1,direct\n"
                                                "lustre     rw,noatime,flock,lazystatfs\n")
    result = c.run("controller-1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "fsx is mounted: lustre rw,noatime,flock,lazystatfs (findmnt lists: autofs lustre)" in result.stdout
    (root / "run/standin-fsx-mount").write_text("autofs     rw,relatime,fd=5,pgrp=1,direct\n")
    step, cause = failure(c.run("controller-1", LIFECYCLE_FSX_WAIT_S="1"))
    assert step == "fsx" and cause.startswith(f"{root}/fsx is a autofs mount, expected lustre (FSx for Lustre) after 1s")
    assert "is an automount point not mounted yet: touching it" in c.log("controller-1")


def test_the_controller_registers_the_cluster_users_with_hyperpods_default_accounting(cluster):
    """slurm.conf has AccountingStorageType=accounting_storage/slurmdbd (HyperPod's MariaDB),
    slurmAccounting is false: the associations are made anyway (the real slurmdbd:
    tests/slurm/test_accounting.py)."""
    c, _, _ = cluster
    records = (c.root("controller-1") / "run/standin-accounting").read_text().splitlines()
    assert records == ["account sana", *(f"assoc {user} sana" for user in USERS)]
    assert "accounting database configured (AccountingStorageType=accounting_storage/slurmdbd" in \
        (c.root("controller-1") / "var/log/provision/node-ready.log").read_text()


def test_ssm_user_has_the_uid_after_ubuntu_and_no_cluster_user_takes_it(cluster):
    """The SSM agent's ssm-user takes the next free UID (1001) before the lifecycle runs; the
    cluster's UIDs start at 2000 (stacks/config.py POSIX_ID_MIN)."""
    c, _, _ = cluster
    for node in NODES:
        passwd = {e[0]: e for e in c.accounts(node)}
        assert passwd["ssm-user"][2] == "1001"
        assert all(int(passwd[name][2]) >= 2000 for name in USERS)
