"""The Neuron SDK releases this package knows, by version: ONE table for every check.

``training/requirements-neuron.txt`` names the release it installs ("Neuron SDK release:
X.Y.Z") and pins its Python packages; tests/xla/test_neuron_pins.py requires every pin there
to equal this table's entry, exactly, and the deployment smoke job (training/smoke/parse.py)
compares what a trn node has installed (runtime library, collectives, driver, and the pip
packages of the Neuron env) with the same entry.

Source: aws-neuron/aws-neuron-sdk ``src/helperscripts/n2-manifest.json`` (the file the
"Release Content" pages are generated from; commit 81ce03ae), entries ``neuron_version``
2.29.0 and 2.31.1, Trn1 packages.

Which release: the newest that still ships ``torch-neuronx``, the PyTorch/XLA package this
backend trains with, is 2.31.1 (torch-neuronx 2.9.0.2.15.32035, as 2.31.0). 2.32.0 ships no
``torch-neuronx`` at all; the same repository's setup/pytorch/manual.rst says so ("torch-neuronx
(PyTorch/XLA) is not included in Neuron 2.32.0 ... use the latest Neuron release that ships it,
Neuron 2.31") and release-notes/components/pytorch.rst gives 2.9.0.2.15.32035 as its latest
version. 2.31.1 differs from 2.31.0 only in aws-neuronx-tools (release-notes/2.31.1.rst). Of
the two ``libneuronxla`` builds 2.31.1 lists, the 2.2 line is torch-neuronx's (archive/appnotes/
torch-neuronx/introducing-pytorch-2-7.rst: "the version of libneuronxla that supports PyTorch
NeuronX ... is 2.2.*"), 3.0 is JAX's PJRT plugin (frameworks/jax/index.rst); the torch-xla
2.10-2.12 wheels it lists serve the native ``libtorch_neuronx_lite`` stack on trn2/trn3
(``major_version_properties``), not this one. torch / torch-xla are the pair torch-neuronx
2.9.0.2.x is built for (torch-xla's C++ extension is tied to one torch ABI).

Every pin is exact: within one release line a wildcard picks another release's build (2.29.1
replaced 2.29.0's neuronx-cc 2.24.5133.0 with 2.24.8799.0 and torch-neuronx 2.9.0.2.13.24727
with 2.9.0.2.13.26312, so ``torch-neuronx==2.9.0.2.13.*`` gave 2.29.1's build next to 2.29.0's
compiler). 2.29.0 stays in the table for nodes built before the move (the smoke job names
what such a node runs).
"""

from __future__ import annotations

#: release -> {"pip": Python packages of the Neuron env, "system": OS packages of the node}
NEURON_RELEASES: dict[str, dict[str, dict[str, str]]] = {
    "2.31.1": {
        "pip": {"torch": "2.9.0", "torch-xla": "2.9.0", "torch-neuronx": "2.9.0.2.15.32035",
                "neuronx-cc": "2.26.6360.0", "libneuronxla": "2.2.17544.0"},
        "system": {"aws-neuronx-runtime-lib": "2.33.10.0", "aws-neuronx-collectives": "2.33.10.0",
                   "aws-neuronx-dkms": "2.29.0.0"},
    },
    "2.29.0": {
        "pip": {"torch": "2.9.0", "torch-xla": "2.9.0", "torch-neuronx": "2.9.0.2.13.24727",
                "neuronx-cc": "2.24.5133.0", "libneuronxla": "2.2.16408.0"},
        "system": {"aws-neuronx-runtime-lib": "2.31.24.0", "aws-neuronx-collectives": "2.31.24.0",
                   "aws-neuronx-dkms": "2.27.4.0"},
    },
}
