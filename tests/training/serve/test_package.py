"""model.tar.gz: the layout SageMaker and the inference DLCs expect, reproducible bytes, code that
works from the archive alone under the real SageMaker inference toolkit, and the upload to the
artefacts bucket (a real S3 API on loopback)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from training.errors import UserError
from training.serve.package import (
    CODE_MODULES,
    SERVE_PACKAGES,
    build_archive,
    serve_requirements,
    unresolved_imports,
    upload,
)

REPO = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).with_name("toolkit_driver.py")


@pytest.fixture(scope="module")
def archive(tmp_path_factory, tiny_export: Path, compiled_cpu: Path) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("package") / "model.tar.gz"
    return out, build_archive(tiny_export, out, compiled=compiled_cpu)


def test_archive_layout_and_pins(archive):
    path, sha = archive
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    with tarfile.open(path) as tar:
        names = tar.getnames()
        requirements = tar.extractfile("code/requirements.txt").read().decode()
        members = {m.name: m for m in tar.getmembers()}
    assert {"code/inference.py", "code/requirements.txt", "code/training/__init__.py", "code/training/errors.py",
            "code/training/data/__init__.py", "code/training/data/text_features.py", "code/training/serve/handler.py", "export/serving.json",
            "export/model_index.json", "export/tokenizer/tokenizer.json", "compiled/manifest.json",
            "compiled/transformer-32x32.pt"} <= set(names)
    # --compiled: the three compiled components travel as graphs, not weights
    assert not [n for n in names if n.startswith("export/") and n.endswith(".safetensors")]
    assert not [n for n in names if "tests" in n or "__pycache__" in n]
    # the runtime only: the build side (compile, package, bench, smoke, demo) stays out
    assert not {f"code/training/serve/{m}.py" for m in ("compile", "package", "bench", "smoke", "demo")} & set(names)
    assert all(m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in members.values())
    pins = {line.split("==")[0]: line.split("==")[1] for line in requirements.splitlines() if "==" in line}
    gpu = {line.split("==")[0]: line.split("==")[1].strip() for line in
           (REPO / "training" / "requirements-gpu.txt").read_text().splitlines() if "==" in line}
    assert list(pins) == list(SERVE_PACKAGES) and all(pins[k] == gpu[k] for k in pins)
    assert "torch" not in pins  # the DLC's torch (or torch-neuronx's) must stay


def test_the_archive_code_imports_only_what_it_carries():
    """A runtime module that starts importing a module code/ lacks fails the build in one
    line, not the endpoint's first request (training/serve/export.py importing
    training.files.publish did: a 500 under the toolkit)."""
    assert unresolved_imports() == []
    without = [m for m in CODE_MODULES if not m.startswith("training/files/")]
    assert unresolved_imports(without) == ["training/serve/export.py imports training.files.publish"]
    without = [m for m in CODE_MODULES if m != "training/serve/errors.py"]
    assert "training/serve/handler.py imports training.serve.errors" in unresolved_imports(without)


def test_the_same_inputs_give_the_same_bytes(archive, tiny_export: Path, compiled_cpu: Path, tmp_path: Path):
    assert build_archive(tiny_export, tmp_path / "again.tar.gz", compiled=compiled_cpu) == archive[1]
    plain = build_archive(tiny_export, tmp_path / "plain.tar.gz")
    assert plain != archive[1]
    with tarfile.open(tmp_path / "plain.tar.gz") as tar:
        assert "export/transformer/diffusion_pytorch_model.safetensors" in tar.getnames()


def test_graphs_of_another_export_are_refused(tiny_export: Path, compiled_cpu: Path, tmp_path: Path):
    other = tmp_path / "other"
    import shutil

    shutil.copytree(tiny_export, other)
    prov = json.loads((other / "serving_provenance.json").read_text())
    (other / "serving_provenance.json").write_text(json.dumps({**prov, "sha256": "f" * 64}))
    with pytest.raises(UserError, match=r"--compiled .*: compiled from export sha256 [0-9a-f]{12}, --export .* is "
                                        "ffffffffffff; compile this export"):
        build_archive(other, tmp_path / "x.tar.gz", compiled=compiled_cpu)
    assert not (tmp_path / "x.tar.gz").exists()


def _toolkit(model_dir: Path, cases: list[dict]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(model_dir / "code")  # as the toolkit sets it: model_dir/code only
    proc = subprocess.run([sys.executable, str(DRIVER), str(model_dir), json.dumps(cases)], cwd=model_dir,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_archive_serves_under_the_sagemaker_inference_toolkit(archive, tmp_path: Path):
    from PIL import Image

    model_dir = tmp_path / "opt-ml-model"
    with tarfile.open(archive[0]) as tar:
        tar.extractall(model_dir, filter="data")
    body = json.dumps({"prompt": "a small red circle", "seed": 2, "steps": 2})
    out = _toolkit(model_dir, [
        {"headers": {"Content-Type": "application/json", "Accept": "image/png"}, "body": body},
        {"headers": {"Content-Type": "application/json"}, "body": body},  # no Accept: the toolkit's default (JSON)
        {"headers": {"Content-Type": "application/json", "Accept": "image/png"},
         "body": json.dumps({"prompt": "a fox", "steps": 99})},
        {"headers": {"Content-Type": "application/json", "Accept": "image/png"}, "body": body},  # still serving
    ])
    assert out["inference_module"] == str(model_dir / "code" / "inference.py")  # imported from the archive
    png, doc, bad, after = out["results"]
    assert (png["status"], png["content_type"]) == (200, "image/png")
    assert Image.open(io.BytesIO(base64.b64decode(png["body"]))).size == (64, 64)
    assert (doc["status"], doc["content_type"]) == (200, "application/json")
    assert base64.b64decode(json.loads(base64.b64decode(doc["body"]))["image"]) == base64.b64decode(png["body"])
    # the toolkit turns RequestError (a BaseInferenceToolkitError) into its status; its body is the
    # message followed by the toolkit's own traceback, so the first line is ours
    assert bad["status"] == 400 and bad["phrase"] == "field steps=99: out of range; allowed 1 to 8"
    assert base64.b64decode(bad["body"]).decode().splitlines()[0] == bad["phrase"]
    assert after["status"] == 200 and after["body"] == png["body"]


def test_upload_names_the_object_by_its_hash_and_never_overwrites(archive, s3_bucket: str):
    from training import s3
    url = upload(archive[0], f"s3://{s3_bucket}/serving/", archive[1])
    assert url == f"s3://{s3_bucket}/serving/model-{archive[1][:12]}.tar.gz"
    assert hashlib.sha256(s3.get_bytes(url)).hexdigest() == archive[1]
    s3.put_bytes(b"planted", url)  # had a second upload put anything, these bytes would be gone
    assert upload(archive[0], f"s3://{s3_bucket}/serving", archive[1]) == url
    assert s3.get_bytes(url) == b"planted"
    assert s3.list_keys(f"s3://{s3_bucket}/serving/") == [url.rsplit("/", 1)[1]]
    with pytest.raises(UserError, match="--upload /tmp/x: give an s3:// prefix"):
        upload(archive[0], "/tmp/x", archive[1])


def test_requirements_follow_the_training_pins():
    assert serve_requirements().splitlines()[1:] == [f"{p}=={v}" for p, v in (
        (line.split("==")[0], line.split("==")[1].strip()) for line in
        (REPO / "training" / "requirements-gpu.txt").read_text().splitlines()
        if "==" in line and line.split("==")[0] in SERVE_PACKAGES)]
