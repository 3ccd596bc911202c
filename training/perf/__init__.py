"""Measuring performance: the bench command line (``bench``, ``python -m training.bench``), one
measured run and its result (``measure``, schema ``bench_result``), the data it trains on when
given none (``synthetic_features``), the comparison with the diffusers-style reference step
(``reference_step``, ``reference_result``), the loop-overhead check (``overhead``), the memory
model and its tables (``memory``, ``memory_table``) and the GPU check that judges results
against the targets (``gpu_check``)."""
