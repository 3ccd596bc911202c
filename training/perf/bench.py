"""``python -m training.bench``: training throughput, step-time spread, memory and MFU -> JSON.

    python -m training.bench --backend gpu --config training/configs/sana-600m-512.yaml \\
        --steps 50 --warmup 10 --synthetic --instance-type ml.p5.48xlarge --out result.json
    python -m training.bench --overhead          # loop-vs-bare-step overhead check (CPU)
    python -m training.bench --config training/configs/sana-600m-512.yaml --synthetic \
        --compare-reference --warmup 3 --steps 5 --repetitions 4 --out cmp.json  # vs diffusers-style step
    python -m training.bench --memory-table      # per-GPU memory, every GPU config x mesh x checkpointing

This module is the command line: it parses the flags, loads the config, builds the backend
and the (synthetic) data, and hands the run to the module that owns each mode:

- a bench run: training/perf/measure.py (the production loop, the clock around it, the result)
- ``--synthetic``: training/perf/synthetic_features.py (the model's shapes, real caption lengths)
- ``--compare-reference``: training/perf/reference_result.py (vs training/perf/reference_step.py)
- ``--overhead``: training/perf/overhead.py (loop step vs bare step, CPU)
- ``--memory-table`` / ``--dry-run``: training/perf/memory_table.py / training/perf/memory.py

On the GPU backend the per-GPU memory estimate (training/perf/memory.py) is printed and
checked before anything is built. The JSON schema is ``training.perf.bench_result.BenchResult``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.perf.measure import run_bench
from training.perf.memory_table import GPU_CONFIGS, memory_tables
from training.perf.overhead import (
    OVERHEAD_CONFIG,
    OVERHEAD_LIMIT,
    OverheadResult,
    measure_overhead,
    prepare_overhead_run,
)
from training.perf.reference_result import compare_and_save
from training.perf.synthetic_features import (
    DEFAULT_TEXT_TOKENS,
    ensure_synthetic_features,
    resolve_caption_lengths,
    synthetic_spec,
)


def make_backend(name: str, cfg: Any) -> Any:
    """The backend the matching entrypoint would build (training.gpu / training.trainium)."""
    if name == "gpu":
        from training.backends.gpu import GpuBackend

        return GpuBackend(cfg.gpu, precision=cfg.precision)
    if name == "trainium":
        from training.backends.neuron import NeuronBackend

        return NeuronBackend(cfg.trainium, precision=cfg.precision)
    raise UserError(f"--backend {name}: must be 'gpu' or 'trainium'")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.bench", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("gpu", "trainium"), default="gpu")
    p.add_argument("--config", help="training YAML (training/configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as for the training entrypoints; repeatable")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first (compile, allocator)")
    p.add_argument("--out", help="result JSON path (rank 0 writes it)")
    p.add_argument("--synthetic", action="store_true",
                   help="train on random features of the model's shapes instead of data.path")
    p.add_argument("--text-tokens", type=int, default=DEFAULT_TEXT_TOKENS,
                   help="padded caption length of synthetic features")
    p.add_argument("--caption-lengths", default="auto",
                   help="real caption lengths of synthetic features: a feature directory (its stored caption "
                        "tokens), a JSON from python -m training.data.caption_lengths, 'full' (every caption at "
                        "--text-tokens: caption trimming gains nothing), or 'auto' (default: data.path of the "
                        "config when it is a local feature directory, else full)")
    p.add_argument("--synthetic-samples", type=int, default=0,
                   help="synthetic samples to write (default: 2 global batches, at least 16)")
    p.add_argument("--work-dir", help="scratch for synthetic features and the run dir "
                   "(default: $TMPDIR; node-local disk is right)")
    p.add_argument("--instance-type", default=os.environ.get("SANA_INSTANCE_TYPE", "local"),
                   help="SageMaker instance type, e.g. ml.p5.48xlarge (default $SANA_INSTANCE_TYPE or 'local')")
    p.add_argument("--notes", default="", help="free text stored in the result")
    p.add_argument("--dry-run", action="store_true",
                   help="instead: print the memory estimate of --config (training/perf/memory.py: per NeuronCore "
                        "with --backend trainium, per GPU with --backend gpu) for --world-size ranks and exit; "
                        "exit 2 if it cannot fit")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks the estimate shards over (default: 32, one trn1.32xlarge, for trainium; 8, one "
                        "p5.48xlarge, for gpu; 16 for --memory-table)")
    p.add_argument("--overhead", action="store_true",
                   help=f"instead: loop step vs bare step on CPU fp32 (limit {OVERHEAD_LIMIT}x)")
    p.add_argument("--compare-reference", action="store_true",
                   help="time our step and a diffusers-style reference step (training/perf/reference_step.py) on the "
                        "same model, batches and precision, interleaved --repetitions times x --steps; the "
                        "result JSON gets both (field reference) and the ratio")
    p.add_argument("--repetitions", type=int, default=5,
                   help="--compare-reference: interleaved (ours, reference) blocks of --steps steps each")
    p.add_argument("--memory-table", action="store_true",
                   help="instead: print the per-GPU memory estimate (training/perf/memory.py) of every GPU config "
                        "(or --config) for each mesh and activation-checkpointing mode at --world-size ranks")
    return p


def _load_cfg(args: argparse.Namespace, config: str, output_dir: Path) -> Any:
    from training.config import load_config

    argv = ["--config", config, "--output-dir", str(output_dir)]
    for item in args.overrides:
        argv += ["--set", item]
    return load_config(argv, prog="python -m training.bench")


def main_dry_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The memory estimate of ``--config`` (per NeuronCore or per GPU) and one JSON line; nothing runs."""
    from training.perf.memory import check_gpu_config, check_trainium_config

    if not args.config:
        raise UserError("--dry-run: needs --config (e.g. training/configs/trn-sana-600m-512.yaml)")
    world = args.world_size or (32 if args.backend == "trainium" else 8)
    if world < 1:
        raise UserError(f"--world-size: {world} < 1; give the number of ranks (NeuronCores / GPUs)")
    cfg = _load_cfg(args, args.config, work / "run")
    if args.backend == "gpu":
        gpu = check_gpu_config(cfg, world_size=world, out=sys.stdout)
        summary = {"dry_run": True, "config": args.config, "memory_gib": gpu.as_gib()}
        print(json.dumps(summary), flush=True)
        return summary
    instance = None if args.instance_type == "local" else args.instance_type
    est = check_trainium_config(cfg, world_size=world, instance_type=instance, out=sys.stdout)
    summary = {"dry_run": True, "config": args.config, "hbm_gib": est.as_gib()}
    print(json.dumps(summary), flush=True)
    return summary


def main_memory_table(args: argparse.Namespace) -> str:
    configs = [args.config] if args.config else sorted((Path(__file__).resolve().parents[1] / "configs").glob(GPU_CONFIGS))
    text = memory_tables(configs, world_size=args.world_size or 16, overrides=args.overrides)
    print(text, end="", flush=True)
    return text


def main_overhead(args: argparse.Namespace, work: Path) -> OverheadResult:
    cfg = prepare_overhead_run(_load_cfg(args, args.config or str(OVERHEAD_CONFIG), work / "run"), work,
                               text_tokens=args.text_tokens)
    result = measure_overhead(cfg, work_dir=work)
    print(result.line(), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    return result


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    root = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir()) / "sana-bench"
    root.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    try:
        if args.overhead:
            main_overhead(args, work)
            return
        if args.dry_run:
            main_dry_run(args, work)
            return
        if args.memory_table:
            main_memory_table(args)
            return
        if not args.config or not args.out:
            raise UserError("--config and --out: required (or use --overhead)")
        cfg = _load_cfg(args, args.config, work / "run")
        memory_estimate = None
        if args.backend == "gpu":  # before anything is built: a config that cannot fit fails here
            from training.perf.memory import check_gpu_config

            memory_estimate = check_gpu_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                                               out=sys.stdout if int(os.environ.get("RANK", 0)) == 0 else None
                                               ).as_gib()
        backend = make_backend(args.backend, cfg)
        try:
            backend.init()
            data_label = None
            caption_label = f"real features ({cfg.data.path})"
            if args.synthetic:
                world = int(os.environ.get("WORLD_SIZE", backend.world_size))
                samples = args.synthetic_samples or max(16, 2 * cfg.data.batch_size * world
                                                        * cfg.optim.grad_accum_steps)
                captions = resolve_caption_lengths(args.caption_lengths, cfg)
                caption_label = captions.describe()
                if backend.is_main:
                    print(f"bench: synthetic captions, lengths from {caption_label}", flush=True)
                spec = synthetic_spec(cfg.model.model_kwargs(), args.text_tokens, captions)
                path = ensure_synthetic_features(root, spec, samples, write=backend.local_rank == 0)
                backend.barrier()  # local rank 0 wrote the node's copy
                cfg.data.path = str(path)
                data_label = "synthetic"
            command = "python -m training.bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
            if args.compare_reference:
                result = compare_and_save(args, cfg, backend, data_label=data_label, command=command,
                                          memory_estimate=memory_estimate, caption_lengths=caption_label)
            else:
                result = run_bench(cfg, backend, steps=args.steps, warmup=args.warmup,
                                   instance_type=args.instance_type, data_label=data_label, command=command,
                                   notes=args.notes, memory_estimate=memory_estimate,
                                   caption_lengths=caption_label)
        finally:
            backend.close()
        if result is not None:
            result.save(args.out)
            print(json.dumps({"out": str(args.out), "samples_per_s_total": round(result.samples_per_s_total, 3),
                              "samples_per_s_per_accelerator": round(result.samples_per_s_per_accelerator, 3),
                              "step_time_p50_s": round(result.step_time_p50_s, 4), "mfu": result.mfu,
                              "mfu_padded": result.mfu_padded,
                              **({"reference_ratio": round(result.reference["ratio"], 4)} if result.reference
                                 else {})}),
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
