"""Run requests through the SageMaker inference toolkit's Transformer, as the DLC's TorchServe worker
does, and print what came back (one JSON line). Used by test_package.py in a subprocess whose
PYTHONPATH is only the extracted archive's code/ directory.

The context object follows TorchServe's (pytorch/serve ts/context.py ``Context`` and
``RequestProcessor``: ``system_properties["model_dir"]``, ``request_processor[i]
.get_request_properties()``, ``set_response_status(code, phrase)``,
``set_response_content_type(idx, value)``); the toolkit calls nothing else on it. Bodies arrive
as bytearrays, as TorchServe hands them over with ``decode_input_request=false``
(aws/sagemaker-pytorch-inference-toolkit etc/default-ts.properties).

Usage: python toolkit_driver.py MODEL_DIR CASES_JSON  (CASES: [{"headers": {...}, "body": "..."}])
"""

from __future__ import annotations

import base64
import json
import sys


class RequestProcessor:
    def __init__(self, request_header: dict) -> None:
        self._status_code = 200
        self._reason_phrase = None
        self._response_header: dict[str, str] = {}
        self._request_header = request_header

    def get_request_property(self, key: str):
        return self._request_header.get(key)

    def get_request_properties(self) -> dict:
        return self._request_header

    def report_status(self, code, reason_phrase=None) -> None:
        self._status_code, self._reason_phrase = code, reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        self._response_header[key] = value


class Context:
    def __init__(self, model_dir: str) -> None:
        self.system_properties = {"model_dir": model_dir, "gpu_id": None, "batch_size": 1, "server_name": "MMS"}
        self.request_processor: list[RequestProcessor] = []

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self.request_processor[idx].report_status(code, reason_phrase=phrase)

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.request_processor[idx].add_response_property("content-type", value)


def main() -> None:
    import inference  # the archive's code/inference.py, as the toolkit will import it
    from sagemaker_inference.transformer import Transformer

    model_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    transformer = Transformer()
    out = []
    for case in cases:
        context = Context(model_dir)
        context.request_processor = [RequestProcessor(case["headers"])]
        response = transformer.transform([{"body": bytearray(case["body"].encode())}], context)[0]
        processor = context.request_processor[0]
        raw = response if isinstance(response, bytes | bytearray) else str(response).encode()
        out.append({"status": processor._status_code, "phrase": processor._reason_phrase,
                    "content_type": processor._response_header.get("content-type"),
                    "body": base64.b64encode(bytes(raw)).decode()})
    print(json.dumps({"inference_module": inference.__file__, "results": out}))


if __name__ == "__main__":
    main()
