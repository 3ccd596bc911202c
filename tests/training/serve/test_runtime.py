"""Loading a model directory and generating with it: the compiled graphs behind SanaPipeline give
the plain pipeline's image, a compiled model serves only its compiled sizes, and every broken
model directory fails to load with one line naming the file and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import request_body

from training.serve import handler, runtime
from training.serve.errors import ModelLoadError, RequestError
from training.serve.spec import Size


@pytest.fixture(scope="module")
def compiled(compiled_model: Path) -> runtime.Served:
    return runtime.load(compiled_model)


@pytest.fixture(scope="module")
def plain(plain_model: Path) -> runtime.Served:
    return runtime.load(plain_model)


def _image(served: runtime.Served, **fields) -> np.ndarray:
    data = handler.input_fn(request_body(**fields).decode(), "application/json")
    return np.asarray(handler.predict_fn(data, served)["image"])


def test_compiled_graphs_in_sana_pipeline_give_the_plain_pipelines_image(compiled, plain):
    assert (compiled.backend, plain.backend) == ("compiled-cpu", "diffusers-cpu")
    for fields in ({"seed": 3}, {"seed": 4, "guidance_scale": 1.0}, {"seed": 5, "negative_prompt": "blurry",
                                                                     "steps": 3}):
        a, b = _image(compiled, **fields), _image(plain, **fields)
        assert a.shape == (64, 64, 3)
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1, fields  # fp32 on both: at most a rounding step
    # ...and the seed is what decides the image (not a constant output)
    assert np.abs(_image(compiled, seed=3).astype(int) - _image(compiled, seed=9).astype(int)).mean() > 1


def test_compiled_model_serves_only_what_was_compiled(compiled, plain):
    assert [str(s) for s in plain.spec.sizes] == ["64x64", "32x64"]  # serving.json
    assert compiled.spec.sizes == (Size(64, 64),)  # compile --shapes 64x64
    with pytest.raises(RequestError) as err:
        _image(compiled, height=32, width=64)
    assert err.value.message == "size 32x64 (height x width) is not served; this endpoint serves 64x64"
    assert _image(plain, height=32, width=64).shape == (32, 64, 3)


def _broken(tmp_path: Path, compiled_model: Path) -> Path:
    root = tmp_path / "model"
    shutil.copytree(compiled_model, root)
    return root


def test_missing_and_incomplete_model_directories(tmp_path: Path, compiled_model: Path, monkeypatch):
    with pytest.raises(ModelLoadError, match=r"model directory .*/nowhere: missing; SageMaker extracts model.tar.gz"):
        runtime.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"empty: no serving.json; package with python -m training.serve.package"):
        runtime.load(tmp_path / "empty")
    plain = tmp_path / "plain"
    shutil.copytree(compiled_model / "export", plain / "export")
    monkeypatch.setenv(runtime.BACKEND_ENV, "compiled")
    with pytest.raises(ModelLoadError, match="SANA_SERVE_BACKEND=compiled but .* has no compiled/ directory"):
        runtime.load(plain)


def test_corrupt_graph_is_named(tmp_path: Path, compiled_model: Path):
    root = _broken(tmp_path, compiled_model)
    graph = root / "compiled" / "transformer-32x32.pt"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as err:
        runtime.load(root)
    assert str(err.value) == (f"{graph}: corrupt (size or sha256 differs from manifest.json); re-copy the model or "
                              "re-run the compile")
    graph.unlink()
    with pytest.raises(ModelLoadError, match="transformer-32x32.pt: missing .listed in manifest.json."):
        runtime.load(root)


def test_graphs_of_another_export_or_target_are_refused(tmp_path: Path, compiled_model: Path):
    root = _broken(tmp_path, compiled_model)
    manifest_file = root / "compiled" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "source_sha256": "0" * 64}))
    with pytest.raises(ModelLoadError, match=r"compiled from export sha256 000000000000, but .* is [0-9a-f]{12}; "
                                             "re-compile"):
        runtime.load(root)
    manifest_file.write_text(json.dumps({**manifest, "target": "inf2"}))
    with pytest.raises(ModelLoadError, match=r"graphs compiled for inf2, but torch-neuronx is not importable .*"
                                             r"serve on an inf2 instance with the Neuron DLC"):
        runtime.load(root)


def test_a_compiled_package_without_weights_cannot_be_served_by_diffusers(tmp_path: Path, compiled_model: Path):
    root = _broken(tmp_path, compiled_model)
    for weights in (root / "export").glob("*/*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelLoadError, match="no weights .*package without --compiled for a GPU instance"):
        runtime.load(root, backend="diffusers")
    assert runtime.load(root).backend == "compiled-cpu"  # the graphs carry the weights


def test_unreadable_serving_json_is_one_line(tmp_path: Path, compiled_model: Path):
    root = _broken(tmp_path, compiled_model)
    (root / "export" / "serving.json").write_text("{")
    with pytest.raises(ModelLoadError) as err:
        runtime.load(root)
    assert "serving.json: unreadable (JSONDecodeError" in str(err.value) and "\n" not in str(err.value)
