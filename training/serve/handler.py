"""The SageMaker inference handler: ``model_fn``, ``input_fn``, ``predict_fn``, ``output_fn``.

The contract is the SageMaker inference toolkit's, which the PyTorch and PyTorch-Neuron
inference DLCs run under TorchServe (aws/sagemaker-inference-toolkit
src/sagemaker_inference/transformer.py; aws/sagemaker-pytorch-inference-toolkit
handler_service.py): the worker imports ``inference.py`` from ``/opt/ml/model/code``
(``SAGEMAKER_PROGRAM``), calls ``model_fn(model_dir)`` once, then per request
``input_fn(body, content_type)`` -> ``predict_fn(data, model)`` -> ``output_fn(prediction,
accept)``, where a JSON body arrives decoded to ``str`` and a missing or ``*/*`` Accept is
replaced by ``SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT`` (default ``application/json``). An
exception that is a ``BaseInferenceToolkitError`` becomes its status code; any other becomes
a 500, and the worker keeps serving. ``model.tar.gz``'s ``code/inference.py`` re-exports these
four functions (training/serve/package.py); training/serve/server.py calls them the same way.

Request (JSON object; anything else is a 400 with one line): ``prompt`` (required, non-empty),
``negative_prompt`` (""), ``steps`` (serving.json default, 1..max_steps), ``guidance_scale``
(4.5, 0..20), ``seed`` (random, 0..2^32-1), ``height`` / ``width`` (one of the served sizes).

Response by Accept: ``image/png`` -> the PNG bytes; ``application/json`` -> ``{"image":
<base64 PNG>, "format": "png", "seed", "steps", "guidance_scale", "height", "width",
"seconds", "backend"}``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
from pathlib import Path
from typing import Any

from training.serve import runtime
from training.serve.errors import RequestError
from training.serve.spec import MAX_SEED, Limits, decode_body, validate_request

#: what the toolkit substitutes for a missing or */* Accept (sagemaker_inference environment.py)
DEFAULT_ACCEPT_ENV = "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT"
MAX_BODY_ENV = "SANA_SERVE_MAX_BODY_BYTES"
PNG = "image/png"
JSON = "application/json"
ACCEPTED = (PNG, JSON)


def default_accept() -> str:
    return os.environ.get(DEFAULT_ACCEPT_ENV, JSON)


def model_fn(model_dir: str) -> runtime.Served:
    """Load the model once per worker (training/serve/runtime.py ``load``)."""
    return runtime.load(Path(model_dir))


def input_fn(input_data: bytes | bytearray | str, content_type: str | None) -> dict[str, Any]:
    """Decode the JSON body (no model is needed for that); RequestError 400 otherwise."""
    limit = int(os.environ.get(MAX_BODY_ENV, Limits.max_body_bytes))
    return decode_body(input_data, content_type, max_body_bytes=limit)


def predict_fn(data: dict[str, Any], model: runtime.Served) -> dict[str, Any]:
    """Check the request against what the model serves, then generate one image."""
    request = validate_request(data, model.spec, random_seed=secrets.randbelow(MAX_SEED + 1))
    image, seconds = runtime.generate(model, request)
    return {"image": image, "seed": request.seed, "steps": request.steps, "guidance_scale": request.guidance_scale,
            "height": request.size.height, "width": request.size.width, "seconds": round(seconds, 4),
            "backend": model.backend}


def _media_types(accept: str | None) -> list[str]:
    types = [part.split(";")[0].strip().lower() for part in (accept or "").split(",")]
    return [t for t in types if t] or [default_accept()]


def output_fn(prediction: dict[str, Any], accept: str | None) -> tuple[bytes, str]:
    """PNG bytes or a JSON document with the base64 PNG, as Accept asks: (body, content type)."""
    buffer = io.BytesIO()
    prediction["image"].save(buffer, format="PNG")
    png = buffer.getvalue()
    for media in _media_types(accept):
        if media == "*/*":
            media = default_accept()
        if media == PNG:
            return png, PNG
        if media == JSON:
            meta = {k: v for k, v in prediction.items() if k != "image"}
            return json.dumps({"image": base64.b64encode(png).decode("ascii"), "format": "png", **meta}).encode(), JSON
    raise RequestError(f"Accept {accept!r}: this endpoint answers {PNG} (the image) or {JSON} (base64 PNG + "
                       "metadata)", status=406)
