"""``python -m training.demo --out DIR``."""

from training.demo.steps import main

main()
