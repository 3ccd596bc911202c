"""``python -m training.report``: bench results + prices -> the cost-performance report (build.py)."""

from training.report.build import main

main()
