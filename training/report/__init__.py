"""The GPU-vs-Trainium decision: bench results + prices -> a Markdown + PNG report.

- ``cli``: ``python -m training.report`` (flags -> ``inputs.Options``); ``build``: load, check,
  assemble and write the report
- ``runs``: bench results with their prices and derived numbers; ``inputs``: the target, FSx
  and feature-index figures the report is asked about
- ``recommendation``, ``render``, ``charts``: the recommendation paragraph, the Markdown, the PNGs;
  ``markdown``: table and number formatting every section shares
- ``projection``: time and cost per preset and instance type as a function of MFU, break-even;
  ``measured_points``: measured runs on it; ``budget``: budget answers; ``projection_chart``
  and ``projection_section``: its chart and its text
- ``prices``: the shipped, dated price table; ``aws_prices``: the AWS Price List API
  (``python -m training.report.aws_prices`` checks its filters against the live API)
- ``scenarios``: how much of the answer is price; ``mfu_evidence``: what the MFU band rests on
- ``parity``: whether both platforms train the same model; ``assemble``: the decision sections
  in order

Nothing here is imported by the training loop; the serving cost (training/report/serving.py) and
the pipeline's report stage read it.
"""
