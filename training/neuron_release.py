"""The Neuron SDK releases this package knows, by version: ONE table for every check.

``training/requirements-neuron.txt`` names the release it installs ("Neuron SDK release:
X.Y.Z") and pins its Python packages; tests/xla/test_neuron_pins.py requires every pin there
to equal this table's entry, exactly, and the deployment smoke job (training/smoke/parse.py)
compares what a trn node has installed (runtime library, collectives, driver, and the pip
packages of the Neuron env) with the same entry.

Source: aws-neuron/aws-neuron-sdk ``src/helperscripts/n2-manifest.json`` (the file the
"Release Content" pages are generated from; commit 81ce03ae), entries ``neuron_version``
2.29.0, Trn1 packages. 2.29.1 differs in neuronx-cc (2.24.8799.0) and torch-neuronx
(2.9.0.2.13.26312): a wildcard ``torch-neuronx==2.9.0.2.13.*`` resolves to 2.29.1's build
next to 2.29.0's compiler, which is why every pin is exact. torch / torch-xla are the pair
torch-neuronx 2.9.0.2.13 is built for (torch-xla's C++ extension is tied to one torch ABI).
"""

from __future__ import annotations

#: release -> {"pip": Python packages of the Neuron env, "system": OS packages of the node}
NEURON_RELEASES: dict[str, dict[str, dict[str, str]]] = {
    "2.29.0": {
        "pip": {"torch": "2.9.0", "torch-xla": "2.9.0", "torch-neuronx": "2.9.0.2.13.24727",
                "neuronx-cc": "2.24.5133.0", "libneuronxla": "2.2.16408.0"},
        "system": {"aws-neuronx-runtime-lib": "2.31.24.0", "aws-neuronx-collectives": "2.31.24.0",
                   "aws-neuronx-dkms": "2.27.4.0"},
    },
}
