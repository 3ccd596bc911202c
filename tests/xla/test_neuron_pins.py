"""training/requirements-neuron.txt installs ONE Neuron SDK release, exactly.

Every Neuron pin (and the torch / torch-xla pair torch-neuronx is built for) is an exact
``==`` version equal to the named release's row in training/backends/neuron_release.py, the table
the deployment smoke job also compares the nodes with (training/smoke/parse.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training.backends.neuron_release import NEURON_RELEASES
from training.smoke.parse import NEURON_SYSTEM_PACKAGES, neuron_pins

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = (REPO / "training/requirements-neuron.txt").read_text()
PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)\s*(?P<op>==|~=|>=|<=|>|<|!=)\s*(?P<version>\S+)", re.M)


def release_and_pins(text: str) -> tuple[str, dict[str, tuple[str, str]]]:
    release = re.search(r"Neuron SDK release:\s*(\d+\.\d+\.\d+)", text)
    assert release, "requirements-neuron.txt: no 'Neuron SDK release: X.Y.Z' line"
    pins = {re.sub(r"[-_.]+", "-", m["name"]).lower(): (m["op"], m["version"]) for m in PIN.finditer(text)}
    return release[1], pins


def skew(text: str) -> list[str]:
    """What in ``text`` disagrees with its release's row (empty: one release, exact)."""
    release, pins = release_and_pins(text)
    if release not in NEURON_RELEASES:
        return [f"release {release} has no row in training/backends/neuron_release.py"]
    problems = []
    for name, version in NEURON_RELEASES[release]["pip"].items():
        op, have = pins.get(name, ("", "<missing>"))
        if (op, have) != ("==", version):
            problems.append(f"{name}{op}{have}, release {release} ships {version}")
    return problems


def test_every_neuron_pin_is_the_named_release_exactly() -> None:
    assert skew(REQUIREMENTS) == []


@pytest.mark.parametrize("edit", [
    ("torch-neuronx==2.9.0.2.15.32035", "torch-neuronx==2.9.0.2.15.*"),  # a wildcard
    ("torch-neuronx==2.9.0.2.15.32035", "torch-neuronx==2.9.0.2.13.26312"),  # 2.29.1's build
    ("neuronx-cc==2.26.6360.0", "neuronx-cc==2.27.5334.0"),  # 2.32's compiler
    ("libneuronxla==2.2.17544.0\n", ""),  # missing
    ("libneuronxla==2.2.17544.0", "libneuronxla==3.0.3854.0"),  # 2.31's JAX plugin line
    ("Neuron SDK release: 2.31.1", "Neuron SDK release: 2.29.0"),  # line moved, pins did not
])
def test_a_mixed_or_loose_pin_is_caught(edit: tuple[str, str]) -> None:
    old, new = edit
    assert old in REQUIREMENTS
    assert skew(REQUIREMENTS.replace(old, new))


def test_the_smoke_job_compares_nodes_with_the_same_row() -> None:
    pins = neuron_pins(REQUIREMENTS)
    row = NEURON_RELEASES[pins.sdk]
    assert NEURON_SYSTEM_PACKAGES[pins.sdk] == row["system"]
    assert {k: v for k, v in pins.packages.items() if k in row["pip"]} == row["pip"]
    assert {k: v for k, v in pins.packages.items() if k in row["system"]} == row["system"]
