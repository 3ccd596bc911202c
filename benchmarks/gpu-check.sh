#!/usr/bin/env bash
# The prepared GPU check (issue 17): under 8 minutes on one H100/H200, bench JSON under OUT_DIR.
#
#   benchmarks/gpu-check.sh OUT_DIR [--dry-run]
#
# Runs, each under its own timeout (a step that hangs or runs long is recorded as failed and
# the next one still runs):
#   a) sana-600m-512, bf16-mixed, compile off: our step vs the diffusers-style reference step,
#      interleaved in one process (python -m training.bench --compare-reference)
#   b) the same with gpu.compile=true (longer warm-up: the first steps compile)
#   c) sana-1600m-1024 on one GPU (its config: FSDP2 + activation checkpointing), with the
#      memory estimate and the measured peak memory in the result
# then prints a one-screen summary (also OUT_DIR/summary.txt). Features are synthetic
# (training.data write_synthetic_features, via bench --synthetic), written under OUT_DIR/work.
#
# Python: the repository's .venv when it exists, else a venv made in OUT_DIR/venv from
# training/requirements-gpu.txt only (nothing else is installed).
#
# --dry-run: the same three commands on the tiny CPU config in seconds (compile is disabled
# with TORCHDYNAMO_DISABLE=1: a CPU compile takes minutes). Result directory convention:
# benchmarks/results/<machine>/ (benchmarks/README.md).
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR [--dry-run]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
OUT=$1
DRY=0
if [[ $# -eq 2 ]]; then
    [[ $2 == --dry-run ]] || usage
    DRY=1
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK="$OUT/work"
mkdir -p "$WORK"

if [[ -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"
else
    if [[ ! -x "$OUT/venv/bin/python" ]]; then
        python3 -m venv "$OUT/venv"
        "$OUT/venv/bin/python" -m pip install --quiet -r "$REPO/training/requirements-gpu.txt"
    fi
    PY="$OUT/venv/bin/python"
fi
cd "$REPO"

if [[ $DRY -eq 1 ]]; then
    CFG_600=training/configs/tiny-cpu.yaml
    CFG_1600=training/configs/tiny-cpu.yaml
    COMMON=(--set tensorboard=false --set "text_trim.lengths=[8, 16, 32]" --text-tokens 40)
    BATCH_600=()
    BIG=(--set gpu.distributed=fsdp --set model.activation_checkpointing=full)
    SHORT=(--warmup 1 --steps 2 --repetitions 2)
    LONG=(--warmup 1 --steps 2 --repetitions 2)
    STEPS_1600=(--warmup 1 --steps 2)
    T_A=120 T_B=120 T_C=120
    export TORCHDYNAMO_DISABLE=1
else
    CFG_600=training/configs/sana-600m-512.yaml
    CFG_1600=training/configs/sana-1600m-1024.yaml
    COMMON=(--set tensorboard=false --set precision=bf16-mixed)
    # --compare-reference holds two 600M models: batch 32 fits a 141 GB H200, 16 an 80 GB H100
    GIB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
    BATCH_600=(--set data.batch_size=32)
    if [[ $GIB -lt 100 ]]; then BATCH_600=(--set data.batch_size=16); fi
    BIG=()
    # warm-up >= the 4 batches --compare-reference cycles through, so every trimmed caption
    # length has been compiled before the clock starts
    SHORT=(--warmup 5 --steps 10 --repetitions 5)
    LONG=(--warmup 6 --steps 10 --repetitions 5)
    STEPS_1600=(--warmup 3 --steps 5)
    # a + b + c = 420 s of timeouts, leaving a minute for imports, synthetic features and the summary
    T_A=90 T_B=250 T_C=80
fi

FAILED=()
run() {  # name, timeout seconds, bench args...
    local name=$1 limit=$2
    shift 2
    echo "== $name (timeout ${limit}s)" >&2
    if ! timeout --kill-after=15 "$limit" "$PY" -m training.bench --backend gpu --synthetic \
            --work-dir "$WORK" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1; then
        echo "   FAILED: last lines of $OUT/$name.log:" >&2
        tail -n 5 "$OUT/$name.log" >&2
        FAILED+=("$name")
    fi
}

run compare-600m-512-eager "$T_A" --config "$CFG_600" "${COMMON[@]}" "${BATCH_600[@]}" --set gpu.compile=false \
    --compare-reference "${SHORT[@]}"
run compare-600m-512-compile "$T_B" --config "$CFG_600" "${COMMON[@]}" "${BATCH_600[@]}" --set gpu.compile=true \
    --compare-reference "${LONG[@]}"
run step-1600m-1024-1gpu "$T_C" --config "$CFG_1600" "${COMMON[@]}" "${BIG[@]}" "${STEPS_1600[@]}"

"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
def pct(v):
    return "n/a" if v is None else f"{100 * v:.1f}%"
def gib(v):
    return "n/a" if v is None else f"{v / 2**30:.1f}"
print(f"{'run':<28} {'samples/s':>10} {'vs ref':>7} {'MFU':>6} {'padded':>7} {'ref MFU':>7} "
      f"{'peak GiB':>8} {'est GiB':>7}")
for name in ("compare-600m-512-eager", "compare-600m-512-compile", "step-1600m-1024-1gpu"):
    path = out / f"{name}.json"
    if not path.is_file():
        print(f"{name:<28} FAILED (see {name}.log)")
        continue
    r = json.loads(path.read_text())
    ref = r.get("reference") or {}
    est = (r.get("memory_estimate") or {}).get("total")
    ratio = f"{ref['ratio']:.2f}x" if ref else "-"
    print(f"{name:<28} {r['samples_per_s_per_accelerator']:>10.2f} {ratio:>7} {pct(r['mfu']):>6} "
          f"{pct(r.get('mfu_padded')):>7} {pct(ref.get('mfu')) if ref else '-':>7} "
          f"{gib(r.get('peak_memory_bytes')):>8} {'n/a' if est is None else f'{est:.1f}':>7}")
    print(f"{'':<28} {r['accelerator']}, batch {r['per_device_batch']}, {r['precision']}, text tokens "
          f"{r.get('text_tokens_real') or 0:.0f} real / {r.get('text_tokens_computed') or 0:.0f} computed "
          f"of {r['text_tokens']}")
EOF

if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu-check: failed: ${FAILED[*]} (logs in $OUT)" >&2
    exit 1
fi
echo "gpu-check: results in $OUT" >&2
