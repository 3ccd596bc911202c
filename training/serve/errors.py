"""The two failures a served model reports: a bad request (4xx, the caller's fix) and a model
directory that cannot be served (``/ping`` unhealthy with the cause).

``RequestError`` subclasses the SageMaker inference toolkit's ``BaseInferenceToolkitError``
when the toolkit is installed (it is in the PyTorch and Neuron inference DLCs): its
``Transformer.transform`` turns exactly that class into the HTTP status it carries and
everything else into a 500 (aws/sagemaker-inference-toolkit
src/sagemaker_inference/transformer.py ``transform`` / ``handle_error``). Without the toolkit
(the local server, tests that do not install it) a class with the same constructor and
attributes stands in, so the handler behaves the same in both places.
"""

from __future__ import annotations

try:  # the DLCs ship it; the local server does not need it
    from sagemaker_inference.errors import BaseInferenceToolkitError as _ToolkitError
except ImportError:  # pragma: no cover - exercised where the toolkit is absent
    class _ToolkitError(Exception):  # type: ignore[no-redef]
        """Stand-in with the toolkit's constructor: (status_code, message, phrase)."""

        def __init__(self, status_code: int, message: str, phrase: str) -> None:
            self.status_code = status_code
            self.message = message
            self.phrase = phrase
            super().__init__(status_code, message, phrase)


class RequestError(_ToolkitError):
    """A request the caller must change: HTTP ``status`` (400 by default) and ONE line that
    names the field and what is allowed. The toolkit sends ``message`` as the body (followed
    by its traceback) and ``phrase`` as the HTTP reason; both are the same line here."""

    def __init__(self, message: str, status: int = 400) -> None:
        line = " ".join(message.split())  # one line, whatever the caller formatted
        super().__init__(status, line, line)

    def __str__(self) -> str:
        return self.message


class ModelLoadError(Exception):
    """The model directory is missing, incomplete or does not fit this host; the message is
    one line naming the path and the fix (``/ping`` reports it)."""
