"""``make demo``: the whole product on this machine's CPU with tiny models (``python -m training.demo``).

- ``steps``: the stages in order (raw data, tiny models, precompute, train, resume, the same
  recipe on the Trainium backend, export, sample, compare, serve) and ``main``
- ``compare``: both backends benched on this CPU, then the comparison report
- ``serve``: the export compiled for CPU and served through the SageMaker handler on loopback
"""
