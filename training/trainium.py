"""``python -m training.trainium --config training/configs/sana-600m-512.yaml [--set k=v] [--precompile]``

Entry point for Trainium (one process per NeuronCore under torchrun) and for torch-xla's
CPU device in tests (``PJRT_DEVICE=CPU``). Same flags as ``python -m training.gpu`` plus
``--precompile``; thin on purpose (CONTRIBUTING.md, 1): parse, build the backend, train, close.

``--precompile`` is for ``neuron_parallel_compile torchrun ... -m training.trainium ...`` (the
``precompile`` Slurm job kind wraps the training job's own torchrun world in it, so the
graphs, collectives included, are the ones the real run compiles): it
traces ``trainium.precompile_steps`` optimizer steps per aspect-ratio bucket of the data
(one graph each; a square dataset is one bucket) so the tool can compile every graph
of the real run in parallel into the persistent cache, writes no checkpoint, resumes from
none and reads no tensor value (the tool's graphs return zeros). The mode also turns on by
itself when ``NEURON_EXTRACT_GRAPHS_ONLY`` is set, which neuron_parallel_compile sets for its
trial run (awsdocs-neuron v2.29.0 frameworks/torch/torch-neuronx/api-reference-guide/
training/pytorch-neuron-parallel-compile.rst), so a plain training command under the tool
cannot write zero-filled checkpoints. Nothing in this module
imports torch-xla, so ``--help`` works in any environment.

Before the backend creates a device (and long before the first neuronx-cc compile), the
per-NeuronCore HBM estimate (training/perf/memory.py) is printed on rank 0 and a config that
cannot fit fails on every rank with one line naming the knob to turn.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from training.errors import exits_cleanly

PROG = "python -m training.trainium"
#: set by neuron_parallel_compile while it runs the command to extract graphs
EXTRACT_GRAPHS_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"


def extracting_graphs(env: dict[str, str] | None = None) -> bool:
    """Whether this process runs under neuron_parallel_compile's graph extraction."""
    value = (os.environ if env is None else env).get(EXTRACT_GRAPHS_ENV, "")
    return value not in ("", "0")


def apply_precompile(cfg, world_size: int = 1) -> None:
    """Turn a run config into its precompile twin: same graphs, few steps, no files.

    Aspect-ratio buckets are one graph each: the loader serves every bucket the run trains on
    (those with at least one global batch), one after another in the index's fixed order,
    ``precompile_steps`` optimizer steps each, so the tool sees every graph of the run."""
    from training.data.index import FeatureIndex
    from training.data.loader import kept_buckets

    index = FeatureIndex.load(cfg.data.path)
    accum = cfg.optim.grad_accum_steps if len(index.buckets) > 1 else 1
    buckets = max(1, len(kept_buckets(index, cfg.data.batch_size * world_size * accum)[0]))
    cfg.trainium.precompile = True
    cfg.data.fixed_bucket_steps = cfg.trainium.precompile_steps
    cfg.max_steps = cfg.trainium.precompile_steps * buckets
    cfg.checkpoint.enabled = False  # no save (even the final forced one), no resume
    cfg.checkpoint.resume = "none"


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    from training.config import load_config, parser

    argv = list(sys.argv[1:] if argv is None else argv)
    cli = parser(PROG)
    cli.add_argument("--precompile", action="store_true",
                     help="trace trainium.precompile_steps steps for neuron_parallel_compile: no "
                          "checkpoints, no resume, no tensor reads")
    precompile = cli.parse_args(argv).precompile  # also validates and serves --help
    cfg = load_config([a for a in argv if a != "--precompile"], prog=PROG)
    if precompile or cfg.trainium.precompile or extracting_graphs():
        apply_precompile(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))

    from training.perf.memory import check_trainium_config

    # torchrun's WORLD_SIZE is what ZeRO-1 shards over; the same on every rank, so every rank
    # reaches the same verdict (no collective needed to agree on it).
    check_trainium_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                          out=sys.stdout if os.environ.get("RANK", "0") == "0" else None)

    from training.backends.neuron import NeuronBackend
    from training.loop import run

    backend = NeuronBackend(cfg.trainium, precision=cfg.precision)
    run(cfg, backend, summary=lambda: {"precompile": cfg.trainium.precompile, **backend.compile_stats()},
        reset_logging=True)


if __name__ == "__main__":
    main()
