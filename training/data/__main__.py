"""``python -m training.data --info SOURCE | --bench DIR`` (training/data/bench.py)."""

import sys

from training.data.bench import main

main(sys.argv[1:])
