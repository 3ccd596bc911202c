"""Assembling diffusers' ``SanaPipeline`` from what training produces (an exported transformer,
the DC-AE and Gemma-2 the features were made with) and sampling it: ``sample``."""
