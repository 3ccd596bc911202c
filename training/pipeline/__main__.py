"""``python -m training.pipeline``: see training/pipeline/__init__.py."""

from training.pipeline.cli import main

if __name__ == "__main__":
    main()
