"""Optimizers: the factory and its config (``factory``: AdamW or CAME, Sana's no-decay groups),
CAME (``came``) and the EMA of the weights (``ema``)."""
