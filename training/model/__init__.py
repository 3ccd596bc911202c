"""The model: diffusers' ``SanaTransformer2DModel`` built from a preset or a pretrained directory
(``build``), Sana's initialisation (``init``), fp32 linear attention (``attention``), LoRA
adapters (``lora``), per-block compile (``compile``), activation checkpointing
(``activation_checkpointing``) and the tiny offline components the tests and the demo use
(``tiny``, ``python -m training.model.tiny OUT``). Imports nothing above it (no loop, data,
backends, perf or report)."""
