"""The GPU-vs-Trainium decision: bench results + prices -> a Markdown + PNG report.

- ``build``: the report (``python -m training.report``), its tables, charts and recommendation
- ``projection``: time and cost per preset and instance type as a function of MFU, break-even
- ``prices``: the shipped, dated price table; ``aws_prices``: the AWS Price List API
  (``python -m training.report.aws_prices`` checks its filters against the live API)
- ``scenarios``: how much of the answer is price; ``mfu_evidence``: what the MFU band rests on
- ``parity``: whether both platforms train the same model; ``assemble``: the sections in order

Nothing here is imported by the training loop; the serving cost (training/report/serving.py) and
the pipeline's report stage read it.
"""
