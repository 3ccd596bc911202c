"""``python -m training.report``: bench results + prices -> the cost-performance report (cli.py)."""

from training.report.cli import main

main()
