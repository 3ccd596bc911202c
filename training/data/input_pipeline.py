"""Host batches -> device batches one step ahead, and the loader position that survives it.

Why one step ahead: the host-to-device copy of batch k+1 (a [32, 300, 2304] caption batch is
44 MB in bf16) runs on a side CUDA stream while the GPU computes step k, instead of on the
compute stream in front of it. What that needs (CUDA semantics, https://docs.pytorch.org/docs/
stable/notes/cuda.html "CUDA streams" / "Use pinned memory buffers"):

- the host tensors pinned (the loader's buffer pool allocates them pinned with
  ``data.pin_memory: true``; an unpinned one is pinned here, on the main thread, as before);
- the compute stream waits for the copy (``wait_event``) before the step reads the batch;
- ``Tensor.record_stream(compute)`` on each device tensor: it was allocated on the side
  stream, and the caching allocator must not hand its memory out again while the compute
  stream still uses it;
- the host buffers stay referenced until their copy finished: the loader's pool reuses a
  buffer once no tensor views it (training/data/decode.py ``_BufferPool``).

Why a position tracker: ``FeatureLoader.state_dict()`` is the position after the last batch
*returned*; reading ahead returns one batch more than the steps used, so a checkpoint taken
from the loader itself would skip a batch on resume. ``LoaderPosition`` snapshots the
loader's state after each pull and reports the snapshot of the last batch handed to a step;
the checkpointer saves that (training/loop.py). It is backend-agnostic: any read-ahead in
between (this module's, torch-xla's MpDeviceLoader) is covered as long as order is kept.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

Batch = dict[str, torch.Tensor]


class LoaderPosition:
    """``state_dict()``: the loader's position after the last batch a step *used*.

    Wrap the host side with ``pulled`` (right after the loader) and the device side with
    ``delivered`` (what the step iterates); batches keep their order in between.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._after_pull: collections.deque[dict[str, Any]] = collections.deque()
        self._current: dict[str, Any] | None = None

    def pulled(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        for batch in batches:
            self._after_pull.append(self.loader.state_dict())
            yield batch

    def delivered(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        for batch in batches:
            self._current = self._after_pull.popleft()
            yield batch

    @property
    def ahead(self) -> int:
        """Batches pulled from the loader but not yet handed to a step."""
        return len(self._after_pull)

    def state_dict(self) -> dict[str, Any]:
        if self._current is not None:
            return dict(self._current)
        if self._after_pull:
            raise RuntimeError(
                "LoaderPosition: batches were read ahead before any was used; "
                "the position before the first pull is unknown"
            )
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._after_pull.clear()
        self._current = None


def read_ahead(
    batches: Iterable[Batch], start: Callable[[Batch], Any], finish: Callable[[Any], Batch]
) -> Iterator[Batch]:
    """Yield ``finish(start(b))`` for each batch, with ``start`` of the next batch issued
    before the current one is yielded (so its copy overlaps the step using the current)."""
    it = iter(batches)
    try:
        pending = start(next(it))
    except StopIteration:
        return
    for host in it:
        current, pending = pending, start(host)
        yield finish(current)
    yield finish(pending)


class StreamCopy:
    """``start``/``finish`` for ``read_ahead`` on CUDA: async copies on a side stream."""

    def __init__(self, device: torch.device, *, text_dtype: torch.dtype | None = torch.float32) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        #: dtype the step gets captions in (the model's inputs as before issue 17: fp32);
        #: the wire carries the stored dtype (bf16) and the cast runs on the GPU
        self.text_dtype = text_dtype
        self._in_flight: collections.deque[tuple[torch.cuda.Event, Batch]] = collections.deque()

    def start(self, batch: Batch) -> tuple[Batch, torch.cuda.Event]:
        host = {k: (v if v.is_pinned() else v.pin_memory()) for k, v in batch.items()}
        with torch.cuda.stream(self.stream):
            out = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        self._in_flight.append((event, host))
        while self._in_flight and self._in_flight[0][0].query():  # copies done: release hosts
            self._in_flight.popleft()
        return out, event

    def finish(self, started: tuple[Batch, torch.cuda.Event]) -> Batch:
        out, event = started
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for t in out.values():
            t.record_stream(compute)
        return cast_text(out, self.text_dtype)


def cast_text(batch: Batch, dtype: torch.dtype | None) -> Batch:
    """Captions in ``dtype`` (None: as stored). bf16 -> fp32 is exact, so a bf16 wire gives
    the step the values an fp32 wire gave."""
    text = batch.get("text")
    if dtype is None or text is None or text.dtype == dtype or not text.is_floating_point():
        return batch
    return {**batch, "text": text.to(dtype)}
