"""``python -m training.precompute``: images + captions -> feature shards (training/data/precompute.py)."""

import sys

from training.data.precompute import main

if __name__ == "__main__":
    main(sys.argv[1:])
