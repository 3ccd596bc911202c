"""Serving the trained model: Neuron compile, the SageMaker handler, a local endpoint, bench, smoke.

The path from a training export to a SageMaker endpoint (runbooks/serving.md):

1. ``python -m training.serve.export``: the transformer export (training/checkpoint/export.py) plus the
   DC-AE, Gemma-2 and tokenizer it was trained with -> one diffusers ``SanaPipeline``
   directory, the *serving export*, with ``serving.json`` (sizes, limits, text conditioning).
2. ``python -m training.serve.compile``: the serving export -> one TorchScript graph per
   component and shape (``torch_neuronx.trace`` for inf2/trn1/trn2, ``torch.jit.trace`` for
   ``--target cpu``) plus ``manifest.json``.
3. ``python -m training.serve.package``: code + artefacts -> ``model.tar.gz`` (optionally
   uploaded to the artefacts bucket); the ``<project>-serving`` stack (stacks/serving.py)
   deploys it.
4. ``handler.py`` is the SageMaker inference-toolkit entry (``model_fn``/``input_fn``/
   ``predict_fn``/``output_fn``); ``server.py`` runs the same handler behind ``/ping`` and
   ``/invocations`` on loopback; ``bench.py`` times it; ``smoke.py`` is the one-command check
   on a Neuron host.

Modules here import the training package's shared pieces (errors, text conditioning) but
nothing of the training loop.
"""
