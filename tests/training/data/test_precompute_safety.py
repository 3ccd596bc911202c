"""Precompute never corrupts or silently changes a feature set: a re-run with other settings
is refused in one line, the user's validation prompts survive a re-run, a full disk (a real
EFBIG from RLIMIT_FSIZE, a real ENOSPC from a small tmpfs) is one line and leaves no part
files, and every sample left out is named and counted under its reason."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from training.data.precompute import main
from training.model.tiny import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder

REPO = Path(__file__).resolve().parents[3]
N = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_components(tmp_path_factory.mktemp("models"))


def argv(models, inp, out, *extra) -> list[str]:
    """The CLI for the tiny models (``extra`` flags come last: argparse keeps the last value)."""
    return ["--input", str(inp), "--out", str(out), "--vae", str(models["vae"]), "--text-encoder",
            str(models["text_encoder"]), "--max-text-tokens", str(N), "--batch-size", "4",
            "--samples-per-shard", "4", "--resolution", str(TINY_RESOLUTION), *extra]


def one_line_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as exit_:
        call()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def parts(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob(".*.part-*"))


@pytest.mark.parametrize(("first", "second", "named"), [
    (("--resolution", "64"), ("--resolution", "128"), "resolution 64 (this run: 128)"),
    (("--buckets", "512"), ("--buckets", "square"), "buckets 512 (this run: square)"),
    ((), ("--caption-text", "diffusers"), "caption_text sana (this run: diffusers)"),
    ((), ("--chi", "none"), "chi_sha256"),
])
def test_a_rerun_with_other_settings_is_refused_and_changes_nothing(models, tmp_path, capsys, first, second, named):
    raw, out = tmp_path / "raw", tmp_path / "features"
    write_image_caption_folder(raw, num=6, seed=1)
    main(argv(models, raw, out, *first))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = one_line_error(capsys, lambda: main(argv(models, raw, out, *first, *second)))
    assert named in line and f"--out {out}" in line and "new --out" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # not a byte changed
    # a shard lost (a crashed run) and the index gone: still refused, from the markers alone
    (out / "index.json").unlink()
    (out / "shard-00001.json").unlink()
    assert named in one_line_error(capsys, lambda: main(argv(models, raw, out, *first, *second)))
    # the recorded settings finish it
    assert main(argv(models, raw, out, *first))["num_samples"] == 6


def test_the_users_validation_prompts_survive_a_rerun(models, tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "features"
    write_image_caption_folder(raw, num=5, seed=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\nthe dark square\n")
    main(argv(models, raw, out, "--validation-prompts", str(prompts)))
    stored = (out / "validation_prompts.safetensors").read_bytes()
    (out / "index.json").unlink()  # e.g. a merge redone after more shards
    again = main(argv(models, raw, out))
    assert again["validation"]["prompts"] == ["a red circle on a blue background", "the dark square"]
    assert (out / "validation_prompts.safetensors").read_bytes() == stored
    assert main(argv(models, raw, out, "--merge-only"))["validation"]["prompts"] == again["validation"]["prompts"]
    assert main(argv(models, raw, out, "--validation-prompts", "none"))["validation"]["prompts"] == []


def test_default_is_sanas_multi_scale_buckets_with_the_table_of_the_resolution(models, tmp_path):
    raw = tmp_path / "raw"
    write_image_caption_folder(raw, num=4, seed=3, aspect=1.25)
    index = main(argv(models, raw, tmp_path / "features"))
    # Sana's ASPECT_RATIO_512 "1.21": (544, 448) scaled by 64/512 and cut to the VAE's stride 2
    assert index["created_by"]["buckets"] == "512" and list(index["buckets"]) == ["1.21"]
    assert index["buckets"]["1.21"]["latent_shape"] == [4, 34, 28]


def test_every_skipped_sample_is_named_and_counted_by_reason(models, tmp_path, capsys):
    raw, out = tmp_path / "raw", tmp_path / "features"
    write_image_caption_folder(raw, num=4, seed=4)
    shutil.copy(raw / "000000.png", raw / "no-caption.png")
    shutil.copy(raw / "000000.png", raw / "empty.png")
    (raw / "empty.txt").write_text("  \n")
    shutil.copy(raw / "000000.png", raw / "latin1.png")
    (raw / "latin1.txt").write_bytes("a caf\u00e9 with a red ring".encode("latin-1"))
    (raw / "junk.png").write_bytes(b"GIF89a not really")
    (raw / "junk.txt").write_text("a red ring\n")
    index = main(argv(models, raw, out, "--buckets", "square"))
    err = capsys.readouterr().err
    assert index["num_samples"] == 4
    assert index["created_by"]["skipped_reasons"] == {"no caption": 1, "empty caption": 1, "caption not UTF-8": 1,
                                                      "unreadable or corrupt image": 1}
    assert index["created_by"]["skipped"] == 4
    assert f"{raw / 'no-caption.png'}: no caption (no-caption.txt missing); skipped" in err
    assert f"{raw / 'empty.png'}: empty caption ({raw / 'empty.txt'}); skipped" in err
    assert f"{raw / 'latin1.png'}: caption not UTF-8 ({raw / 'latin1.txt'}: byte 0xe9 at offset 5" in err
    assert f"{raw / 'junk.png'}: unreadable or corrupt image (cannot identify image file); skipped" in err
    assert "BytesIO" not in err


def precompute_process(args: list[str], *, fsize: int | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m training.precompute`` as a user runs it, optionally under ``ulimit -f`` (bytes)."""
    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "training.precompute", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=limit)


@pytest.mark.slow
def test_file_size_limit_is_one_line_and_leaves_no_part_files(models, tmp_path):
    """RLIMIT_FSIZE (``ulimit -f``, a site's quota on one file) makes write(2) fail with EFBIG
    on the first shard (CPython ignores SIGXFSZ, so the error reaches the writer)."""
    raw, out = tmp_path / "raw", tmp_path / "features"
    write_image_caption_folder(raw, num=8, seed=5)
    args = argv(models, raw, out, "--buckets", "square")
    failed = precompute_process(args, fsize=20_000)  # one shard of 4 samples is ~35 kB
    assert failed.returncode == 2, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}: file too large") and "shard-00000.tar" in last and "re-run" in last
    assert "Traceback" not in failed.stderr
    assert parts(out) == [] and not (out / "index.json").exists() and not list(out.glob("shard-*.tar"))
    # a part file a killed run left (another pid) goes too when the shard is written again
    (out / ".shard-00001.tar.part-999999").write_bytes(b"half a shard")
    done = precompute_process(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert parts(out) == [] and json.loads((out / "index.json").read_text())["num_samples"] == 8


def unshare_available() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not unshare_available(), reason="needs unprivileged user + mount namespaces (unshare -rm)")
def test_a_full_disk_is_one_line_and_a_rerun_on_more_space_finishes_clean(models, tmp_path):
    """A real ENOSPC: --out on a 96 KiB tmpfs mounted in a private mount namespace; after the
    failure the same tmpfs is grown (remount) and the same command finishes it."""
    raw, disk = tmp_path / "raw", tmp_path / "disk"
    disk.mkdir()
    write_image_caption_folder(raw, num=12, seed=6)
    out = disk / "features"
    args = " ".join(argv(models, raw, out, "--buckets", "square"))
    script = (f"set -u; mount -t tmpfs -o size=96k tmpfs {disk}; "
              f"{sys.executable} -m training.precompute {args}; echo \"rc1=$?\"; "
              f"echo \"after1: $(ls -A {out} | tr '\\n' ' ')\"; "
              f"mount -o remount,size=16m {disk}; "
              f"{sys.executable} -m training.precompute {args} > /dev/null; echo \"rc2=$?\"; "
              f"echo \"after2: $(ls -A {out} | tr '\\n' ' ')\"")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    report = dict(line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith("rc"))
    after1 = next(line for line in proc.stdout.splitlines() if line.startswith("after1:")).split()[1:]
    after2 = next(line for line in proc.stdout.splitlines() if line.startswith("after2:")).split()[1:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert report["rc1"] == "2" and len(errors) == 1, proc.stderr[-3000:]
    assert f"{out}: no space left on the device writing shard-" in errors[0] and "MiB free" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not [name for name in after1 if ".part-" in name] and "index.json" not in after1
    assert report["rc2"] == "0", proc.stderr[-3000:]
    assert "index.json" in after2 and not [name for name in after2 if ".part-" in name]
    assert sum(name.endswith(".tar") for name in after2) == 3
