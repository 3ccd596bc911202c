"""``python -m training.trainium --config training/configs/sana-600m-512.yaml [--set k=v] [--precompile]``

Entry point for Trainium (one process per NeuronCore under torchrun) and for torch-xla's
CPU device in tests (``PJRT_DEVICE=CPU``). Same flags as ``python -m training.gpu`` plus
``--precompile``; thin on purpose (STYLE.md rule 1): parse, build the backend, train, close.

``--precompile`` is for ``neuron_parallel_compile python -m training.trainium ...``: it
traces ``trainium.precompile_steps`` optimizer steps so the tool can compile every graph
of the real run in parallel into the persistent cache, writes no checkpoint, resumes from
none and reads no tensor value (the tool's graphs return zeros). Nothing in this module
imports torch-xla, so ``--help`` works in any environment.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from training.errors import exits_cleanly

PROG = "python -m training.trainium"


def apply_precompile(cfg) -> None:
    """Turn a run config into its precompile twin: same graphs, few steps, no files."""
    cfg.trainium.precompile = True
    cfg.max_steps = cfg.trainium.precompile_steps
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
    if precompile or cfg.trainium.precompile:
        apply_precompile(cfg)

    from training.backends.neuron import NeuronBackend
    from training.entry import run

    backend = NeuronBackend(cfg.trainium, precision=cfg.precision)
    run(cfg, backend, summary=lambda: {"precompile": cfg.trainium.precompile, **backend.compile_stats()},
        reset_logging=True)


if __name__ == "__main__":
    main()
