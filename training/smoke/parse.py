"""Parsers behind the smoke checks: sinfo, node status files, NCCL logs, Neuron versions.

Pure functions over text, so every verdict the smoke job prints is tested on captured text
in the formats the real tools write (sources cited at each parser).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from training.backends.neuron_release import NEURON_RELEASES

# --------------------------------------------------------------------------- sinfo

#: `sinfo --Node --noheader --format=` fields (sinfo(1)): partition (%P; the default one
#: carries a trailing "*"), node, long state, reason, CPUs, memory in MB.
SINFO_FORMAT = "%P|%N|%T|%E|%c|%m"

# sinfo(1) "NODE STATE CODES": a state is unusable for a job when it is one of these
# (compound states such as "idle+drain" or "mixed+fail" are joined with "+").
_BAD_STATES = {"down", "drain", "drained", "draining", "fail", "failing", "inval", "unknown",
               "not_responding", "no_respond", "future", "maint", "reboot_issued"}
# sinfo(1): "*" after the state = the node is not responding (slurmd unreachable).
_NOT_RESPONDING = "*"
_STATE_SUFFIXES = "*~#!%$@^-"


@dataclass(frozen=True)
class NodeState:
    partition: str
    node: str
    state: str
    reason: str
    cpus: int = 0
    memory_mb: int = 0

    @property
    def usable(self) -> bool:
        if self.state.endswith(_NOT_RESPONDING):
            return False
        parts = {p.rstrip(_STATE_SUFFIXES).lower() for p in self.state.split("+")}
        return not parts & _BAD_STATES


def parse_sinfo(text: str) -> list[NodeState]:
    """Rows of ``sinfo --Node --noheader --format=SINFO_FORMAT`` (one per node and partition)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        # The reason is free text: split the fixed fields off both ends.
        head = line.split("|", 3)
        tail = head[-1].rsplit("|", 2) if len(head) == 4 else []
        if len(tail) != 3:
            raise ValueError(f"unexpected sinfo line (format {SINFO_FORMAT}): {line!r}")
        partition, node, state = (f.strip() for f in head[:3])
        reason, cpus, memory = (f.strip() for f in tail)
        rows.append(NodeState(partition.rstrip("*"), node, state, "" if reason == "none" else reason,
                              int(cpus) if cpus.isdigit() else 0, int(memory) if memory.isdigit() else 0))
    return rows


# --------------------------------------------------------------------------- node status files

# The status file each node writes on FSx, $FSX/logs/provision/<node>.status (written whole,
# renamed into place):
#   lifecycle_scripts/status.sh:  "<ts> READY|PENDING node=<n> group=<g> role=<r> ip=<ip> package=<h> <k=v ...> [cause=<text>]"
#                                 then one "<ts> WARN node=<n> part=<step> cause=<text>" per optional
#                                 part that does not work on the node (container runtime, accounting)
#   the entry script's fail():    "<ts> FAILED node=<n> group=<g> role=<r> ip=<ip> step=<s> cause=<text>"
# (cause= is last and runs to the end of the line; it may hold spaces.) PENDING: the lifecycle
# finished, the late check (sana-node-ready.service) has not seen the node's Slurm daemon up.
_STATUS_RE = re.compile(r"^(?P<ts>\S+) (?P<verdict>READY|PENDING|FAILED|WARN) (?P<rest>.*)$")


@dataclass(frozen=True)
class NodeStatus:
    path: str
    verdict: str  # READY | PENDING | FAILED | WARN (one WARN line alone) | INVALID
    fields: dict[str, str] = field(default_factory=dict)
    timestamp: str = ""
    line: str = ""
    #: (part, cause) of each WARN line that follows the verdict line
    warnings: tuple[tuple[str, str], ...] = ()

    @property
    def node(self) -> str:
        return self.fields.get("node") or Path(self.path).name.removesuffix(".status")


def parse_status_line(line: str, path: str = "") -> NodeStatus:
    line = line.strip()
    match = _STATUS_RE.match(line)
    if not match:
        return NodeStatus(path, "INVALID", {}, "", line)
    rest, fields = match["rest"], {}
    if " cause=" in f" {rest}":
        head, _, cause = f" {rest}".partition(" cause=")
        rest, fields["cause"] = head.strip(), cause.strip()
    for word in rest.split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    return NodeStatus(path, match["verdict"], fields, match["ts"], line)


def parse_status_file(text: str, path: str = "") -> NodeStatus:
    """The verdict line (the first) with the WARN lines after it."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    status = parse_status_line(lines[0] if lines else "", path)
    warnings = []
    for line in lines[1:]:
        warn = parse_status_line(line, path)
        if warn.verdict != "WARN":
            return NodeStatus(path, "INVALID", {}, "", line)
        warnings.append((warn.fields.get("part", "?"), warn.fields.get("cause", "no cause recorded")))
    return dataclasses.replace(status, warnings=tuple(warnings))


def read_status_dir(directory: Path) -> list[NodeStatus]:
    """Every ``*.status`` file under the provision log dir."""
    return [parse_status_file(path.read_text(errors="replace"), str(path)) for path in sorted(directory.glob("*.status"))]


# --------------------------------------------------------------------------- NCCL log

# Which network transport NCCL chose, from its NCCL_DEBUG=INFO lines. Formats, as the real
# logs print them:
#   "NCCL INFO Using network Libfabric"   aws-ofi-nccl >= 1.9 names its plugin "Libfabric"
#                                         (log in NVIDIA/nccl#1597, p5en + EFA)
#   "NCCL INFO Using network AWS Libfabric"   older aws-ofi-nccl (NVIDIA/nccl#1597 channels,
#                                         NCCL_NET='AWS Libfabric'; aws/aws-ofi-nccl#24)
#   "NCCL INFO Using network Socket"      NCCL's internal TCP transport (NVIDIA/nccl#1267), also
#                                         after "NET/OFI aws-ofi-nccl initialization failed"
#                                         (the plugin loaded but could not start: aws/aws-ofi-nccl#889)
#   "NCCL INFO Channel 07/0 : 1[1] -> 0[0] [send] via NET/AWS Libfabric/1/GDRDMA"  (NVIDIA/nccl#1597)
#   "NCCL INFO Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0"   (older NCCL, aws/aws-ofi-nccl#24)
#   "NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)"   (NVIDIA/nccl#1597; aws-ofi-nccl#22)
# "NET/Socket : Using [0]eth0:..." (NVIDIA/nccl#352) alone is NOT a fallback: NCCL
# initialises its internal socket transport next to a plugin; the selection lines decide.
# NCCL's env-var page: NCCL_DEBUG=INFO prints this init/net information
# (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-debug).
_USING_NETWORK = re.compile(r"NCCL INFO Using network (?P<net>[A-Za-z][\w ]*?)\s*$")
_VIA_NET = re.compile(r"\bvia NET/(?P<net>[^/\n]+)/\d+")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (?P<provider>[\w;-]+)")
_OFI_NAMES = {"libfabric", "aws libfabric"}
_OFI_INIT_FAILED = "NET/OFI aws-ofi-nccl initialization failed"


@dataclass(frozen=True)
class NcclNetwork:
    ok: bool
    reason: str
    networks: tuple[str, ...] = ()
    provider: str | None = None


def nccl_network(log: str) -> NcclNetwork:
    """Did this NCCL_DEBUG=INFO log run over the EFA/OFI plugin on every communicator?"""
    nets = {m["net"].strip() for m in _VIA_NET.finditer(log)}
    for line in log.splitlines():  # srun --label / torchrun prefixes come before "NCCL INFO"
        m = _USING_NETWORK.search(line.rstrip("\r"))
        if m:
            nets.add(m["net"].strip())
    providers = {m["provider"] for m in _OFI_PROVIDER.finditer(log)}
    provider = ",".join(sorted(providers)) or None
    networks = tuple(sorted(nets))
    if not nets:
        return NcclNetwork(False, "no NCCL network selection line in the log (was NCCL_DEBUG=INFO "
                           "set, and did the job span 2 nodes?)", networks, provider)
    other = sorted(n for n in nets if n.lower() not in _OFI_NAMES)
    if other:
        why = ("aws-ofi-nccl loaded but its initialization failed (see the NET/OFI WARN lines)"
               if _OFI_INIT_FAILED in log else "aws-ofi-nccl not loaded or EFA unavailable")
        return NcclNetwork(False, f"NCCL used network {'/'.join(other)}, not the EFA OFI plugin "
                           f"(socket fallback: {why})", networks, provider)
    if providers and providers != {"efa"}:
        return NcclNetwork(False, f"aws-ofi-nccl selected libfabric provider {provider}, not efa "
                           "(set FI_PROVIDER=efa; check the EFA devices)", networks, provider)
    return NcclNetwork(True, f"NCCL network {'/'.join(networks)}, provider {provider or 'unreported'}",
                       networks, provider)


# --------------------------------------------------------------------------- Neuron versions

# The Neuron SDK release every trn node must run is chosen in ONE place: the
# "Neuron SDK release: X.Y.Z" line of training/requirements-neuron.txt, whose pip pins are
# that release's Python packages. The versions of each release (system packages: runtime
# library, collectives, driver; and the pip packages) live in ONE table,
# training/backends/neuron_release.py NEURON_RELEASES (from the Neuron release manifest); the pins
# test (tests/xla/test_neuron_pins.py) holds requirements-neuron.txt to the same table.
# A release missing there makes the version check fail with a line saying to add it.
NEURON_SYSTEM_PACKAGES: dict[str, dict[str, str]] = {
    release: dict(versions["system"]) for release, versions in NEURON_RELEASES.items()}
#: the Python packages of the Neuron stack whose pins the check compares (the rest of
#: requirements-neuron.txt is ordinary Python, checked by pip when the env is built)
NEURON_PIP_PACKAGES = ("torch", "torch-xla", "torch-neuronx", "neuronx-cc", "libneuronxla")
#: present only on a Neuron host (not in a CPU test env with torch-xla)
NEURON_ONLY = frozenset({"torch-neuronx", "neuronx-cc", "libneuronxla",
                         *(name for release in NEURON_SYSTEM_PACKAGES.values() for name in release)})

_SDK_LINE = re.compile(r"Neuron SDK release:\s*(?P<v>\d+\.\d+\.\d+)")
_PIN = re.compile(r"^\s*(?P<name>[A-Za-z0-9_.-]+)\s*==\s*(?P<spec>[^\s;#]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class NeuronPins:
    sdk: str
    packages: dict[str, str]  # normalised name -> expected version (pip: may end in ".*")


def neuron_pins(requirements: str) -> NeuronPins:
    """The SDK release and the expected versions of the Neuron stack, from requirements-neuron.txt."""
    match = _SDK_LINE.search(requirements)
    if not match:
        raise ValueError("training/requirements-neuron.txt has no 'Neuron SDK release: X.Y.Z' line")
    sdk = match["v"]
    if sdk not in NEURON_SYSTEM_PACKAGES:
        raise ValueError(f"Neuron SDK {sdk} (training/requirements-neuron.txt) has no system package "
                         "versions in training/backends/neuron_release.py NEURON_RELEASES; add that "
                         "release's Trn1 packages from the Neuron Release Content page")
    packages = dict(NEURON_SYSTEM_PACKAGES[sdk])
    wanted = {_norm(n) for n in NEURON_PIP_PACKAGES}
    for line in requirements.splitlines():
        pin = _PIN.match(line)
        if pin and _norm(pin["name"]) in wanted:
            packages[_norm(pin["name"])] = pin["spec"]
    return NeuronPins(sdk, packages)


def version_matches(installed: str, expected: str) -> bool:
    """pip-style equality ("2.9.0.2.13.*" is a prefix match); system package versions may
    carry a Debian/RPM suffix ("2.31.24.0~abc123", "2.31.24.0-1")."""
    base = re.split(r"[~+]|-(?=\d*[A-Za-z]|\d+$)", installed.strip(), maxsplit=1)[0]
    if expected.endswith(".*"):
        stem = expected[:-2]
        return base == stem or base.startswith(stem + ".")
    return base == expected


def version_skew(installed: dict[str, str | None], pins: NeuronPins, *,
                 required: set[str] | frozenset[str] | None = None) -> list[str]:
    """One line per component that differs from the pinned release (or is missing, when it
    is in ``required``; default: every pinned component)."""
    required = set(pins.packages) if required is None else set(required)
    problems = []
    for name, expected in pins.packages.items():
        have = installed.get(name)
        if have is None:
            if name in required:
                problems.append(f"{name} is not installed (Neuron SDK {pins.sdk} pins {expected})")
            continue
        if not version_matches(have, expected):
            problems.append(f"{name} {have} installed, but Neuron SDK {pins.sdk} "
                            f"(training/requirements-neuron.txt) pins {expected}")
    return problems
