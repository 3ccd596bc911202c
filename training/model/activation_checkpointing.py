"""Activation checkpointing per transformer block: none | full | every_n | selective.

diffusers' ``SanaTransformer2DModel.forward`` calls ``self._gradient_checkpointing_func(block,
*args)`` for every block once ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``
is set (diffusers ``models/modeling_utils.py``, ``models/transformers/sana_transformer.py``).
The policy lives in that function, so parameter names, state dicts and the per-block
``torch.compile`` / ``fully_shard`` units stay exactly as without checkpointing:

- ``full``: every block recomputed in backward (least memory, ~+33% FLOPs: one extra forward).
- ``every_n``: only blocks n-1, 2n-1, ... are checkpointed; the others keep their activations
  (torchtitan's ``ac_freq``: torchtitan/distributed/activation_checkpoint.py
  ``_apply_layer_sac``). Memory and recompute both scale by ~1/n.
- ``selective``: every block is checkpointed, but the outputs of matmuls, convolutions and
  attention are saved (``CheckpointPolicy.MUST_SAVE``) and only the cheap elementwise ops /
  norms are recomputed: torchtitan's op-level SAC (``_op_sac_save_list`` in
  torchtitan/models/llama3/infra/parallelize.py, policy built with
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``). Recompute costs a few
  percent instead of a third; memory sits between none and full.

The checkpoint function is replaceable: Trainium passes torch_xla's ``checkpoint`` (which adds
the optimization barrier XLA needs) for ``full`` / ``every_n``; ``selective`` needs a
TorchDispatchMode seeing each aten op in eager, which XLA's lazy tracing does not run per op
(torch-xla's ``torch_xla/utils/checkpoint.py`` takes no ``context_fn``), so Trainium refuses
it (``refuse_unsupported``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from training.errors import UserError

MODES = ("none", "full", "every_n", "selective")

#: aten ops whose outputs selective checkpointing keeps (the compute-heavy ones); the rest of a
#: block (norms, adaLN modulation, activations, residual adds) is recomputed. torchtitan saves
#: mm + the SDPA kernels; Sana's Linear layers have biases (addmm), its Mix-FFN has convolutions,
#: and the linear attention is bmm/matmul, so those are saved as well.
SAC_SAVE_OPS: frozenset[Any] = frozenset(
    op
    for op in (
        getattr(torch.ops.aten, "mm", None),
        getattr(torch.ops.aten, "addmm", None),
        getattr(torch.ops.aten, "bmm", None),
        getattr(torch.ops.aten, "baddbmm", None),
        getattr(torch.ops.aten, "convolution", None),
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    )
    if op is not None
)
_SAVE_OVERLOADS = frozenset(o.default for o in SAC_SAVE_OPS if hasattr(o, "default"))

CheckpointFn = Callable[..., Any]


def _torch_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    # Non-reentrant: works with torch.compile and FSDP2 and accepts inputs without grad.
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _SAVE_OVERLOADS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # https://docs.pytorch.org/docs/stable/checkpoint.html (create_selective_checkpoint_contexts):
    # the policy is consulted for every op in forward and again in recomputation.
    ctx = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=ctx)


def checkpointed_blocks(num_blocks: int, mode: str, every_n: int) -> list[int]:
    """Indices of the transformer blocks a mode recomputes."""
    if mode == "none":
        return []
    if mode == "every_n":
        return [i for i in range(num_blocks) if (i + 1) % every_n == 0]
    return list(range(num_blocks))


def apply_activation_checkpointing(
    model: nn.Module, mode: str, *, every_n: int = 2, checkpoint_fn: CheckpointFn | None = None
) -> None:
    """Install the checkpoint policy on a diffusers transformer (in place).

    Args:
        model: a model with ``transformer_blocks`` and diffusers' ``enable_gradient_checkpointing``.
        mode: one of ``MODES``; "none" disables checkpointing.
        every_n: for "every_n", checkpoint every n-th block.
        checkpoint_fn: ``fn(callable, *args)`` recomputing ``callable`` in backward (default:
            torch.utils.checkpoint, non-reentrant); ignored for "selective".
    """
    if mode not in MODES:
        raise UserError(f"model.activation_checkpointing: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        model.disable_gradient_checkpointing()
        return
    blocks = list(getattr(model, "transformer_blocks", []))
    keep = {id(blocks[i]) for i in checkpointed_blocks(len(blocks), mode, every_n)}
    ckpt = _selective_checkpoint if mode == "selective" else (checkpoint_fn or _torch_checkpoint)

    inside: set[int] = set()  # blocks whose compiled forward checkpoints itself (compile.py)

    def gradient_checkpointing_func(block: nn.Module, *args: Any) -> Any:
        if id(block) in keep and id(block) not in inside:
            return ckpt(block.__call__, *args)
        return block(*args)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=gradient_checkpointing_func)
    model._activation_checkpointing = mode  # read back by backends (e.g. to swap checkpoint_fn)
    model._checkpoint_every_n = every_n
    model._checkpoint_fn = ckpt
    model._checkpoint_keep = keep
    model._checkpoint_inside = inside


def checkpointed_forward(model: nn.Module, block: nn.Module) -> Callable[..., Any]:
    """``block.forward``, or for a block the policy checkpoints, a function running it under
    the checkpoint, for ``torch.compile`` to trace: torchtitan's order (AC wrapper inside,
    torch.compile around it), so dynamo captures the checkpoint region and applies the SAC
    policy inside the compiled graph instead of around an opaque compiled call. The block is
    then no longer checkpointed from the outside."""
    forward = block.forward
    if id(block) not in getattr(model, "_checkpoint_keep", ()):
        return forward
    ckpt = model._checkpoint_fn
    model._checkpoint_inside.add(id(block))

    def run(*args: Any) -> Any:
        return ckpt(forward, *args)

    return run


def mode_of(model: nn.Module) -> str:
    """The mode ``apply_activation_checkpointing`` installed ("none" when never applied)."""
    if not getattr(model, "gradient_checkpointing", False):
        return "none"
    return getattr(model, "_activation_checkpointing", "full")


def refuse_unsupported(mode: str, supported: tuple[str, ...], backend: str) -> None:
    """One line naming the modes a backend supports."""
    if mode not in supported:
        raise UserError(
            f"model.activation_checkpointing: {mode!r} is not supported on the {backend} backend; "
            f"use one of {', '.join(supported)}"
        )
