"""``python -m training.bench``: throughput, memory and MFU of a config -> one JSON (training/perf/bench.py)."""

from training.perf.bench import main

if __name__ == "__main__":
    main()
