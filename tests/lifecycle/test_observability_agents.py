"""The observability step (lifecycle_scripts/observability.sh) in a pretend node root, with the
pretend cluster's stand-ins (systemctl restart with Type=exec's refusal of a missing program,
docker pull refusing an image the registry lacks) and stand-in release archives published as the
projects publish them, with their checksum files, fetched over file:// by the real curl
(lifecycle_cluster.observability_sources; promtool is the real one). A private cluster's path is
tests/lifecycle/test_observability_private.py. What it writes is
checked with the real tools where they run here: the EFA/Lustre textfile through Debian's node
exporter, the collector's configuration through promtool. Every part that fails is one WARN
line; the node never fails for it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import urllib.request
from pathlib import Path

import node_model
import pytest
from lifecycle_cluster import observability_sources

from tests.conftest import free_port
from tests.observability.servers import binary, stop, wait_http

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "observability.sh"
REMOTE_WRITE = "https://aps-workspaces.us-east-1.amazonaws.com/workspaces/ws-0123/api/v1/remote_write"
DCGM_IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to the cluster group needs root (as on a node)")


def node(tmp_path: Path, standins: Path, role: str, **extra: str) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "nodes" / f"{role}-1"
    (root / "fsx").mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / node_model.MARKERS).mkdir(parents=True)
    env = {"PATH": f"{standins}:/usr/bin:/bin", "PLATFORM_ROOT": str(root), "FSX": str(root / "fsx"),
           "NODE_ROLE": role, "NODE_NAME": f"{role}-1", "NODE_IP": "10.1.1.1", "CFG_OBSERVABILITY": "true",
           "CFG_CLUSTER_GID": str(os.getgid()), "CFG_REGION": "us-east-1", "CFG_CLUSTER_NAME": "sana-test",
           "CFG_REMOTE_WRITE_URL": REMOTE_WRITE, "STANDIN_LOG": str(tmp_path / "calls.log"),
           "STANDIN_DOCKER_IMAGES": DCGM_IMAGE, "STEP_WARN_FILE": str(tmp_path / "warnings"),
           **observability_sources(tmp_path / "releases"), **extra}
    return root, env


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def warnings(tmp_path: Path) -> list[str]:
    path = tmp_path / "warnings"
    return path.read_text().splitlines() if path.exists() else []


def exec_start(root: Path, unit: str) -> str:
    (line,) = [ln for ln in (root / "etc/systemd/system" / unit).read_text().splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def fake_efa_and_lustre(root: Path) -> None:
    """What an EFA device and the Lustre client show in sysfs/debugfs (efa driver port stats;
    `lctl get_param llite.*.stats` lines)."""
    counters = root / "sys/class/infiniband/rdmap16s27/ports/1/hw_counters"
    counters.mkdir(parents=True)
    for name, value in {"tx_bytes": 1000, "rx_bytes": 2000, "rdma_read_bytes": 300, "rdma_write_bytes": 400,
                        "lifespan": 12}.items():
        (counters / name).write_text(f"{value}\n")
    stats = root / "sys/kernel/debug/lustre/llite/fsx-ffff9b2a/stats"
    stats.parent.mkdir(parents=True)
    stats.write_text("snapshot_time             1700000000.1 secs.nsecs\n"
                     "read_bytes                12 samples [bytes] 4096 1048576 5242880\n"
                     "write_bytes               3 samples [bytes] 4096 65536 73728\n"
                     "open                      20 samples [usecs] 1 10 50\n")


def test_a_gpu_node_runs_the_node_and_dcgm_exporters_and_registers_them(tmp_path, standins):
    root, env = node(tmp_path, standins, "gpu")
    fake_efa_and_lustre(root)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/docker").write_text("#!/bin/sh\n")  # the AMI's docker
    (root / "usr/bin/docker").chmod(0o755)
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert warnings(tmp_path) == []
    assert exec_start(root, "sana-node-exporter.service") == (
        "/opt/sana-observability/bin/node_exporter --web.listen-address=10.1.1.1:9100 "
        "--collector.textfile.directory=/var/lib/sana-observability/textfile")
    dcgm = exec_start(root, "sana-dcgm-exporter.service")
    assert "-p 10.1.1.1:9400:9400" in dcgm and dcgm.endswith(f"{DCGM_IMAGE} dcgm-exporter --hpc-job-mapping-dir "
                                                             "/run/slurm/dcgm-job-mapping")
    # A container left by a crash would block the name: removed first ("-": its absence is no error).
    assert "ExecStartPre=-/usr/bin/docker rm -f sana-dcgm-exporter" in \
        (root / "etc/systemd/system/sana-dcgm-exporter.service").read_text()
    assert "ExecStartPre" not in (root / "etc/systemd/system/sana-node-exporter.service").read_text()
    for unit in ("sana-node-exporter", "sana-dcgm-exporter"):
        assert (root / node_model.MARKERS / f"{unit}.active").exists()
    assert (root / "etc/systemd/system/timers.target.wants/sana-node-counters.timer").is_symlink()
    # The discovery file: both exporters, on the node's address, labelled with node and role.
    targets = json.loads((root / "fsx/observability/nodes/gpu-1.json").read_text())
    assert targets == [{"targets": ["10.1.1.1:9100"], "labels": {"job": "node", "node": "standin-host", "role": "gpu"}},
                       {"targets": ["10.1.1.1:9400"], "labels": {"job": "dcgm", "node": "standin-host", "role": "gpu"}}]
    targets_dir = (root / "fsx/observability/targets").stat()
    assert oct(targets_dir.st_mode & 0o7777) == "0o1775" and targets_dir.st_gid == os.getgid()
    # The textfile, read by a real node exporter: accepted, with the EFA and Lustre counters.
    textfile = root / "var/lib/sana-observability/textfile"
    port = free_port()
    proc = subprocess.Popen([binary("prometheus-node-exporter"), f"--web.listen-address=127.0.0.1:{port}",
                             f"--collector.textfile.directory={textfile}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scraped = response.read().decode()
    finally:
        stop(proc)
    assert "node_textfile_scrape_error 0" in scraped
    assert 'sana_efa_rx_bytes_total{device="rdmap16s27",port="1"} 2000' in scraped
    assert 'sana_efa_rdma_write_bytes_total{device="rdmap16s27",port="1"} 400' in scraped
    assert "sana_efa_lifespan" not in scraped
    assert 'sana_lustre_client_read_bytes_total{fs="fsx-ffff9b2a"} 5.24288e+06' in scraped
    # A second run (a rollout) downloads nothing again.
    calls_before = (tmp_path / "calls.log").read_text()
    assert run(env).returncode == 0 and "node_exporter 1.9.1 is installed" in run(env).stdout
    assert warnings(tmp_path) == [] and calls_before.count("docker pull") >= 1


def test_the_controller_runs_the_slurm_exporter_and_a_checked_collector_config(tmp_path, standins):
    root, env = node(tmp_path, standins, "controller")
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert warnings(tmp_path) == []
    collector = exec_start(root, "sana-collector.service")
    assert collector.startswith("/opt/sana-observability/bin/prometheus --enable-feature=agent ")
    assert "--web.listen-address=127.0.0.1:9090" in collector
    assert exec_start(root, "sana-slurm-exporter.service").endswith("--web.listen-address=10.1.1.1:9341")
    config = json.loads((root / "etc/sana-observability/collector.yml").read_text())
    assert config["remote_write"][0]["url"] == REMOTE_WRITE and config["remote_write"][0]["sigv4"] == {"region": "us-east-1"}
    files = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", []) for f in sd["files"]]
    assert files == ["/fsx/observability/nodes/*.json", "/fsx/observability/targets/*.json"]  # the node's paths
    assert config["global"]["external_labels"] == {"cluster": "sana-test"}
    assert "promtool refuses" not in done.stdout


def repack(releases: Path, name: str, *, reports: str | None = None, extra: bytes = b"") -> Path:
    """Replace the stand-in release archive of ``name`` in the published releases (the pins of
    observability_sources): its binary reporting ``reports`` as its version, or the same archive with
    ``extra`` bytes appended (an archive altered after the sha256 was recorded). Returns the archive."""
    pins = json.loads((releases / "agent-releases.json").read_text())["releases"][name]
    (archive,) = (releases / pins["repository"]).glob(f"releases/download/v{pins['version']}/*.tar.gz")
    if reports is not None:
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(f"/{name}") or m.name == name)
        script = f'#!/bin/sh\necho "{name}, version {reports} (branch: HEAD, revision: 0000000)"\n'.encode()
        member.size = len(script)
        with tarfile.open(archive, "w:gz") as out:
            out.addfile(member, io.BytesIO(script))
    with archive.open("ab") as f:
        f.write(extra)
    return archive


def record_sha256(releases: Path, name: str, archive: Path) -> None:
    """The pins record ``archive``'s sha256 for ``name`` (as if the pin had been taken from it)."""
    path = releases / "agent-releases.json"
    data = json.loads(path.read_text())
    data["releases"][name].update(sha256=hashlib.sha256(archive.read_bytes()).hexdigest(), sha256_source="test")
    path.write_text(json.dumps(data))


def test_a_release_that_is_not_the_pinned_version_is_refused_with_one_warning(tmp_path, standins):
    root, env = node(tmp_path, standins, "login")
    archive = repack(tmp_path / "releases", "node_exporter", reports="1.8.0")
    record_sha256(tmp_path / "releases", "node_exporter", archive)  # the sha256 matches: the version check refuses it
    done = run(env)
    assert done.returncode == 0
    (warning,) = warnings(tmp_path)
    assert warning == ("node_exporter: node_exporter-1.9.1.linux-amd64.tar.gz holds 'node_exporter, version 1.8.0 "
                       "(branch: HEAD, revision: 0000000)', not version 1.9.1"), warning
    assert not (root / "opt/sana-observability/bin/node_exporter").exists()
    assert not (root / "fsx/observability/nodes/login-1.json").exists()  # nothing to scrape here


def test_an_archive_that_is_not_the_recorded_sha256_is_refused_before_it_runs(tmp_path, standins):
    """node_exporter's pin records its sha256; the archive GitHub serves differs (one byte appended):
    refused in one line naming both sha256, nothing extracted or run."""
    root, env = node(tmp_path, standins, "login")
    pinned = json.loads((tmp_path / "releases/agent-releases.json").read_text())["releases"]["node_exporter"]["sha256"]
    archive = repack(tmp_path / "releases", "node_exporter", extra=b"\0")
    assert run(env).returncode == 0
    (warning,) = warnings(tmp_path)
    found = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert warning == (f"node_exporter 1.9.1: node_exporter-1.9.1.linux-amd64.tar.gz has sha256 {found}, not {pinned} "
                       f"(the recorded pin) (from {archive.as_uri()}); not installed")
    assert not (root / "opt/sana-observability/bin/node_exporter").exists()


def test_without_a_recorded_sha256_the_release_checksum_file_decides(tmp_path, standins):
    """slurm_exporter's pin records no sha256 (none was found in a public source): the controller
    checks the archive against the release's own slurm_exporter_checksums.txt."""
    root, env = node(tmp_path, standins, "controller")
    done = run(env)
    assert done.returncode == 0 and warnings(tmp_path) == []
    assert "slurm_exporter 1.8.3: sha256 " in done.stdout and \
        "matches the release's slurm_exporter_checksums.txt" in done.stdout
    (root / "opt/sana-observability/bin/slurm_exporter").unlink()
    archive = repack(tmp_path / "releases", "slurm_exporter", extra=b"\0")
    assert run(env).returncode == 0
    (warning,) = warnings(tmp_path)
    assert warning.startswith("slurm_exporter 1.8.3: slurm_exporter-1.8.3-linux-amd64.tar.gz has sha256 ")
    assert f"(the release's slurm_exporter_checksums.txt) (from {archive.as_uri()}); not installed" in warning
    assert not (root / "opt/sana-observability/bin/slurm_exporter").exists()


def test_a_dcgm_image_the_registry_lacks_and_missing_neuron_tools_are_warnings(tmp_path, standins):
    root, env = node(tmp_path, standins, "gpu", STANDIN_DOCKER_IMAGES="")
    assert run(env).returncode == 0
    assert warnings(tmp_path) == [f"DCGM exporter: docker pull {DCGM_IMAGE} failed (Error response from daemon: "
                                  f"manifest for {DCGM_IMAGE} not found: manifest unknown: manifest unknown)"]
    assert [t["labels"]["job"] for t in json.loads((root / "fsx/observability/nodes/gpu-1.json").read_text())] == ["node"]
    (tmp_path / "warnings").unlink()
    root, env = node(tmp_path / "trn", standins, "trn")
    env["STEP_WARN_FILE"] = str(tmp_path / "warnings")
    assert run(env).returncode == 0
    assert warnings(tmp_path) == ["neuron-monitor: /opt/aws/neuron/bin/neuron-monitor or neuron-monitor-prometheus.py "
                                  "is missing (aws-neuronx-tools, which the HyperPod Trainium AMI ships; nothing "
                                  "installs it from Neuron's apt repository, out of reach on a private cluster): use "
                                  "an AMI that has it; no NeuronCore metrics from this node"]


def test_a_trn_node_pipes_neuron_monitor_into_its_prometheus_exporter(tmp_path, standins):
    root, env = node(tmp_path, standins, "trn")
    tools = root / "opt/aws/neuron/bin"
    tools.mkdir(parents=True)
    (tools / "neuron-monitor").write_text("#!/bin/sh\n")
    (tools / "neuron-monitor").chmod(0o755)
    (tools / "neuron-monitor-prometheus.py").write_text("# aws-neuronx-tools\n")
    env_dir = root / "fsx/envs/neuron/bin"
    env_dir.mkdir(parents=True)
    # The Neuron env's python, which has prometheus_client (training/requirements-neuron.txt): here .venv's.
    (env_dir / "python").write_text(f'#!/bin/sh\nexec {REPO / ".venv/bin/python"} "$@"\n')
    (env_dir / "python").chmod(0o755)
    env["ENV_NEURON_DIR"] = str(root / "fsx/envs/neuron")
    assert run(env).returncode == 0 and warnings(tmp_path) == []
    assert exec_start(root, "sana-neuron-monitor.service") == (
        "/bin/bash -o pipefail -c '/opt/aws/neuron/bin/neuron-monitor | /fsx/envs/neuron/bin/python "
        "/opt/aws/neuron/bin/neuron-monitor-prometheus.py --port 8000'")
    assert [t["labels"]["job"] for t in json.loads((root / "fsx/observability/nodes/trn-1.json").read_text())] == \
        ["node", "neuron"]


def test_observability_off_installs_nothing(tmp_path, standins):
    root, env = node(tmp_path, standins, "gpu", CFG_OBSERVABILITY="false")
    done = run(env)
    assert done.returncode == 0 and "observability=false" in done.stdout
    assert warnings(tmp_path) == [] and not (root / "etc/systemd/system").exists()
    assert not (root / "fsx/observability").exists()


def test_through_the_boot_a_failing_part_is_a_warn_line_and_the_node_is_ready(make_cluster, tmp_path):
    """on_init_complete.sh runs the step as optional: a GPU node whose DCGM image cannot be
    pulled boots READY with one `WARN part=observability` line; its node exporter is registered."""
    c = make_cluster()
    settings = c.bundle / "platform-settings.json"
    data = json.loads(settings.read_text())
    data["observability"], data["remote_write_url"] = {"enabled": True}, REMOTE_WRITE
    settings.write_text(json.dumps(data))
    sources = observability_sources(tmp_path / "releases")
    for name in ("controller-1", "gpu-1"):
        result = c.run(name, STANDIN_DOCKER_IMAGES="", **sources)
        assert result.returncode == 0 and "FAILED" not in result.stdout, result.stdout[-3000:]
        assert c.wait_late_check(name) == 0
    assert " READY node=gpu-1 " in c.status("gpu-1")[0]
    warn_lines = [line for line in c.status("gpu-1")[1:] if " WARN " in line]
    assert len(warn_lines) == 1 and " part=observability cause=DCGM exporter: docker pull " in warn_lines[0]
    assert [line for line in c.status("controller-1")[1:] if " WARN " in line] == []
    nodes = sorted(p.name for p in (c.fsx / "observability/nodes").iterdir())
    assert nodes == ["controller-1.json", "gpu-1.json"]
    assert (c.root("controller-1") / "etc/sana-observability/collector.yml").exists()
