"""What the GPU-vs-Trainium decision rests on besides the bench results: where each price
comes from (``prices``: the shipped table; ``aws_prices``: the AWS Price List API), how much
of the answer is price (``scenarios``), what the MFU band is grounded in (``mfu_evidence``),
and whether both platforms train the same model (``parity``).

``training/report.py`` and ``training/projection.py`` import these; nothing here imports
the report, so the modules can move with it later. Keep this file free of imports:
``projection`` imports ``mfu_evidence`` and ``scenarios`` imports ``projection``.
"""
