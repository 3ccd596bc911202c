"""What systemd and configless Slurm do on a pretend HyperPod node (tests/lifecycle).

Imported by lifecycle_cluster.py (the test standing for HyperPod starting a node's Slurm
daemon) and run by the ``systemctl`` / ``scontrol`` stand-ins (``python3 node_model.py CMD``).
Each behaviour follows its documentation:

- Configless Slurm (https://slurm.schedmd.com/configless_slurm.html): slurmd pulls the
  "supported configuration files" from slurmctld into ``<SlurmdSpoolDir>/conf-cache`` and links
  ``/run/slurm/conf`` to it; an included file travels "ONLY ... if their 'Include' filename
  reference has no path separators and the file is located adjacent to slurm.conf"; a changed
  file reaches running nodes on ``scontrol reconfig`` or a slurmd restart. HyperPod's compute
  and login nodes run slurmd this way, with no config of their own under /opt/slurm/etc
  (awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/tools/devops-agent/docs/
  hyperpod-mental-model.md, "slurmd uses Slurm's configless mode").
- systemd (systemd.unit(5)): ``WantedBy=X`` in [Install] becomes, on ``systemctl enable``, a
  link in ``X.wants/`` (the real ``systemctl --root`` makes it here); starting X then starts
  the wanted unit too, and ``After=X`` orders it after X's start job. ``start --no-block``
  queues the job and returns at once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SLURM_ETC = "opt/slurm/etc"
CONF_CACHE = "var/spool/slurmd/conf-cache"  # SlurmdSpoolDir /var/spool/slurmd (HyperPod's)
# configless_slurm.html, "Supported configuration files are:".
SHIPPED = ("slurm.conf", "acct_gather.conf", "cgroup.conf", "cli_filter.lua", "gres.conf", "helpers.conf",
           "job_container.conf", "mpi.conf", "oci.conf", "plugstack.conf", "scrun.lua", "topology.conf",
           "topology.yaml")
UNITS = "etc/systemd/system"
MARKERS = "run/standin-units"


def ship_config(controller_root: Path, node_root: Path) -> list[str]:
    """What a configless slurmd receives from the controller: the supported files, plus the
    files they include by a bare name that sit next to slurm.conf. Returns the names shipped."""
    etc = controller_root / SLURM_ETC
    cache = node_root / CONF_CACHE
    if cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True)
    shipped = []
    for name in SHIPPED:
        if (etc / name).is_file():
            shutil.copy2(etc / name, cache / name)
            shipped.append(name)
            for line in (etc / name).read_text().splitlines():
                match = re.match(r"\s*include\s+(\S+)", line, re.IGNORECASE)
                if match and "/" not in match.group(1) and (etc / match.group(1)).is_file():
                    shutil.copy2(etc / match.group(1), cache / match.group(1))
                    shipped.append(match.group(1))
    link = node_root / "run/slurm/conf"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(cache)
    return shipped


def exec_start(root: Path, unit: str) -> list[str]:
    """The unit's ExecStart command line, its program paths under the node's root."""
    text = (root / UNITS / unit).read_text()
    (line,) = [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("ExecStart=")]
    argv = line.split()
    return [argv[0]] + [str(root) + a if a.startswith("/") else a for a in argv[1:]]


def run_unit(root: Path, unit: str, env: dict[str, str]) -> int:
    """Run a oneshot unit the way systemd would: its own process and output (kept in
    run/standin-units/<unit>.out), its exit status in <unit>.result once it has finished."""
    markers = root / MARKERS
    (markers / f"{unit}.result").unlink(missing_ok=True)
    with open(markers / f"{unit}.out", "ab") as log:
        code = subprocess.run(exec_start(root, unit), env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=600).returncode
    # Renamed into place: a test waiting for the file never reads it half-written.
    (markers / f"{unit}.result.tmp").write_text(f"{code}\n")
    (markers / f"{unit}.result.tmp").replace(markers / f"{unit}.result")
    return code


def queue_unit(root: Path, unit: str, env: dict[str, str]) -> None:
    """`systemctl start --no-block UNIT`: the job is queued and runs on its own; the caller goes on."""
    (root / MARKERS / f"{unit}.result").unlink(missing_ok=True)
    subprocess.Popen([sys.executable, __file__, "run-unit", str(root), unit], env=env, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def arm_timer(root: Path, timer: str) -> None:
    """`systemctl start X.timer`: the timer is active, nothing runs until it elapses."""
    (root / MARKERS / f"{timer}.active").touch()


def fire_timer(root: Path, timer: str, env: dict[str, str]) -> int:
    """The timer elapses (what the test stands for by "2 minutes later"): systemd starts the
    unit it activates, by default "a service that has the same name as the timer unit, except
    for the suffix" (systemd.timer(5), Unit=), if the timer is started and enabled."""
    assert (root / MARKERS / f"{timer}.active").exists(), f"{timer} was never started on {root.name}"
    assert timer in wanted_by(root, "timers.target"), f"{timer} is not enabled on {root.name} (no boot would start it)"
    return run_unit(root, timer.removesuffix(".timer") + ".service", env)


def wanted_by(root: Path, unit: str) -> list[str]:
    wants = root / UNITS / f"{unit}.wants"
    return sorted(p.name for p in wants.iterdir()) if wants.is_dir() else []


def start_daemon(root: Path, unit: str, env: dict[str, str], *, controller_root: Path | None = None) -> None:
    """HyperPod starts ``unit`` (slurmd, slurmctld): a configless slurmd fetches its config
    first; then the unit is active, and the units it wants run after it (After=)."""
    if unit == "slurmd.service" and controller_root is not None:
        ship_config(controller_root, root)
    markers = root / MARKERS
    markers.mkdir(parents=True, exist_ok=True)
    (markers / f"{unit.removesuffix('.service')}.active").touch()
    for wanted in wanted_by(root, unit):
        run_unit(root, wanted, env)


def push_config(nodes_dir: Path, controller: str) -> list[str]:
    """``scontrol reconfigure`` on the controller: every node whose slurmd runs gets the new files."""
    pushed = []
    for node_root in sorted(p for p in nodes_dir.iterdir() if p.name != controller):
        if (node_root / MARKERS / "slurmd.active").exists():
            ship_config(nodes_dir / controller, node_root)
            pushed.append(node_root.name)
    return pushed


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "push-config":  # nodes_dir controller
        print("reconfigured:", " ".join(push_config(Path(args[0]), args[1])) or "no running slurmd")
        return 0
    if command == "start-unit":  # root unit: systemctl start [--no-block]
        if args[1].endswith(".timer"):
            arm_timer(Path(args[0]), args[1])
        else:
            queue_unit(Path(args[0]), args[1], dict(os.environ))
        return 0
    if command == "run-unit":  # root unit: the queued job itself
        return run_unit(Path(args[0]), args[1], dict(os.environ))
    print(f"node_model.py: unknown command {command}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
