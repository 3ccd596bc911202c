"""Measuring performance: the bench (``bench``, ``python -m training.bench``) and its result
schema (``bench_result``), the diffusers-style reference step it is compared with
(``reference_step``), the FLOP and memory models (``flops``, ``memory``) and the GPU check
that judges results against the targets (``gpu_check``)."""
