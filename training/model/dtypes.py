"""The dtypes an exported model may be written in (``python -m training.export --dtype``), shared
by the full export (training/checkpoint/export.py) and the LoRA export (lora.py)."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
