"""``python -m training.export``: a checkpoint -> a diffusers directory (training/checkpoint/export.py)."""

from training.checkpoint.export import main

if __name__ == "__main__":
    main()
