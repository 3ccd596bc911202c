"""The Trainium backend's optimizer: state created before step 0, and ZeRO-1.

Two things the backend class (training/backends/neuron.py) delegates here, because both are
about the optimizer's state rather than the device or the step:

- ``init_adam_state``: Adam/AdamW/CAME state exists before the first step, so step 0 traces
  the same graph as every later step (one neuronx-cc compile, not two).
- ``Zero1``: torch_xla's ``ZeroRedundancyOptimizer`` over the backend's optimizer. Each rank's
  base optimizer holds an fp32 shard (rows [r*n/N, (r+1)*n/N) of the zero-padded first
  dimension) of every parameter and the optimizer state of that shard. The gradients are
  reduce-scattered in fp32 (``higher_cc_precision``) whatever the weights' dtype: a bf16 sum
  over 32+ ranks loses the low bits of every gradient, where Sana's GPU training all-reduces
  fp32 gradients (its AMP keeps fp32 master weights). CAME (NVlabs Sana's optimizer) runs
  sharded too: its factored statistics shard by rows, and the sums over rows it needs are
  all-reduced over the ZeRO group (training/optim/came.py ``CAME.shard``). ``Zero1`` also
  moves that sharded state into and out of checkpoints: gathered to full tensors on rank 0
  (format ``full``) or written by each rank as its own rows (format ``sharded``,
  training/optim/sharding.py), and sliced back into shards on restore.

Nothing here adds an op to the training step's graph: the state is filled with host zeros
and device transfers, and restores swap ``.data`` instead of tracing a copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from training.optim.sharding import param_names, zero1_rows_of


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW (or CAME) state now, as zeros on the device, exactly as its first
    step would.

    Without this, step 0 traces a different graph (it creates the moments) from every later
    step: two neuronx-cc compiles of the full training graph instead of one (minutes each for
    600M). Filling the state up front makes step 0 run the steady graph. Other optimizers are
    left alone (they compile twice, correctly).
    """
    from training.optim.came import CAME

    if isinstance(optimizer, CAME):
        optimizer.init_state()
        return
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam in torch >= 2.6
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            return  # their step counter lives on the device: let torch create it
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            # Host zeros + one transfer: device data, not a traced fill op in the first graph.
            state = {"step": torch.tensor(0.0, dtype=scalar),
                     "exp_avg": torch.zeros(p.shape, dtype=p.dtype).to(p.device),
                     "exp_avg_sq": torch.zeros(p.shape, dtype=p.dtype).to(p.device)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
            optimizer.state[p] = state


def _flush() -> None:
    """Materialise pending work before reading tensors (not a step sync)."""
    import torch_xla

    torch_xla.sync()


class Zero1:
    """ZeRO-1 over ``optimizer``'s parameters of ``model``: the wrapper (``self.optimizer``, what
    the loop steps) and its sharded state. Collective methods run on every rank."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *, bucket_mb: int,
                 device: torch.device, world_size: int) -> None:
        from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

        # ZeRO-1 takes an optimizer *class*; ``optimizer`` is an instance. Its param_groups carry
        # every hyper-parameter (lr, betas, eps, weight_decay, ...), so passing them as groups
        # rebuilds the same optimizer over the shards. It holds no state yet, so nothing is lost.
        # grad_clipping stays on so the wrapper computes the global norm over the reduced shards;
        # the backend's clip_and_step sets max_norm per call (inf = measure only).
        # Collectives as NxD configures its NeuronZero1Optimizer (a subclass of this one):
        # pin_layout=False (neuronx-distributed docs, api_guide "Neuron Zero1 Optimizer"), and
        # coalesced reduce-scatter / all-gather in trainium.zero1_bucket_mb buckets instead of
        # one collective per parameter (torch_xla zero_redundancy_optimizer.py: a cap > 0
        # turns on coalesce_cc_reduce_scatter / coalesce_cc_all_gather).
        # higher_cc_precision: the reduce-scatter runs in optimizer_dtype (fp32), not in the
        # gradients' bf16 (zero_redundancy_optimizer.py _reduce_gradients casts the padded
        # gradient before the collective); see the module docstring.
        self.optimizer = ZeroRedundancyOptimizer(
            [dict(group) for group in optimizer.param_groups], type(optimizer),
            optimizer_dtype=torch.float32, grad_clipping=True, max_norm=float("inf"),
            pin_layout=False, save_master_weights=False, higher_cc_precision=True,
            bucket_cap_mb_all_gather=bucket_mb, bucket_cap_mb_reduce_scatter=bucket_mb)
        #: the model the wrapper was built over (a state load into another model leaves it alone)
        self.model = model
        self.device = device
        self.world_size = world_size
        from training.optim.came import CAME

        if isinstance(self.optimizer.base_optimizer, CAME):
            self._shard_came()
        init_adam_state(self.optimizer.base_optimizer)

    def pairs(self, model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(name, full parameter, this rank's fp32 shard) for every parameter the wrapper steps."""
        names = param_names(model)
        zero = self.optimizer
        return [(names[id(p)], p, s)
                for group, sgroup in zip(zero.param_groups, zero.base_optimizer.param_groups, strict=True)
                for p, s in zip(group["params"], sgroup["params"], strict=True)]

    def _shard_came(self) -> None:
        """Tell ZeRO's base CAME which rows of which full parameter each shard holds (real-row
        masks as graph inputs) and how to sum over the ZeRO group: one all-reduce per phase."""
        import torch_xla.core.xla_model as xm

        from training.optim.came import flat_reduce, row_shards

        zero = self.optimizer
        groups = zero.sharding_groups
        shards = row_shards(((param, shard) for _n, param, shard in self.pairs(self.model)),
                            zero._shard_tensor, self.device)
        zero.base_optimizer.shard(shards, flat_reduce(
            lambda flat: xm.all_reduce(xm.REDUCE_SUM, flat, groups=groups, pin_layout=False)))

    # ----- master weights ---------------------------------------------------------------
    def gathered_masters(self, model: nn.Module, *, is_main: bool) -> dict[str, torch.Tensor]:
        """With bf16 weights the shards are the fp32 master copy; a checkpoint gets that (full,
        on rank 0) instead of the bf16 weights, so a resume restores the master shards exactly
        (``reshard``) and a bf16 model loading it just casts. Collective."""
        import torch_xla.core.xla_model as xm

        pieces = [(name, param, xm.all_gather(shard.detach(), dim=0) if self.world_size > 1 else shard.detach())
                  for name, param, shard in self.pairs(model)]
        _flush()
        if not is_main:
            return {}
        # slice the zero-padding off on the host: a device slice would be one more graph
        return {name: full.cpu()[: param.shape[0]].clone() for name, param, full in pieces}

    def reshard(self, model: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
        """Refresh the fp32 master shards from a loaded full state (else the next step would
        all-gather the stale shards over the loaded weights)."""
        for name, _param, shard in self.pairs(model):
            piece = self.optimizer._shard_tensor(full[name].detach().to(torch.float32))
            shard.data = piece.to(self.device)

    # ----- optimizer state, full (checkpoint format "full") -------------------------------
    def gathered_state(self, model: nn.Module, *, is_main: bool) -> dict[str, Any]:
        """Every shard's state as full, name-keyed CPU tensors on rank 0 (``{}`` elsewhere), as
        ``to_named_optimizer_state`` gives without ZeRO. Collective."""
        import torch_xla.core.xla_model as xm

        zero = self.optimizer
        base = zero.base_optimizer
        state: dict[str, dict[str, Any]] = {}
        for name, param, shard in self.pairs(model):
            entry = base.state.get(shard)
            if not entry:
                continue
            full_entry: dict[str, Any] = {}
            for key, value in entry.items():
                if zero1_rows_of(key, value):
                    gathered = xm.all_gather(value, dim=0) if self.world_size > 1 else value
                    value = gathered[: param.shape[0]]
                full_entry[key] = value
            state[name] = full_entry
        _flush()
        out: dict[str, Any] = {}
        if is_main:
            names = param_names(model)
            out = {"state": {n: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                 for k, v in e.items()} for n, e in state.items()},
                   "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                     "params": [names[id(p)] for p in g["params"]]}
                                    for g in zero.param_groups]}
        return out

    def load_full_state(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        """Inverse of ``gathered_state``, given the full state on every rank."""
        # Hyper-parameters go to the wrapper (the scheduler drives its param_groups); each rank
        # slices its own rows of every full moment tensor into the base optimizer's state.
        zero = self.optimizer
        for group, saved in zip(zero.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        base = zero.base_optimizer
        for name, _param, shard in self.pairs(model):
            saved = state["state"].get(name)
            if not saved:
                continue
            entry: dict[str, Any] = {}
            for key, value in saved.items():
                if zero1_rows_of(key, value):
                    value = zero._shard_tensor(value.to(torch.float32)).to(self.device)
                elif torch.is_tensor(value) and value.dim() > 0:  # CAME's column statistics: whole
                    value = value.to(torch.float32).to(self.device)
                entry[key] = value
            base.state[shard] = entry
        init_adam_state(base)
        zero._sync_param_groups(zero.param_groups, base.param_groups)
        _flush()

    # ----- sharded checkpoints (training/checkpoint/sharded.py) ---------------------------
    def sharded_state(self, model: nn.Module, *, rank: int, master_weights: bool) -> Any:
        """This rank's rows of model and optimizer state, never all-gathered (the layout logic
        is training/optim/sharding.py's)."""
        from training.optim.sharding import zero1_sharded_state

        _flush()  # materialise the step's pending updates before the host copies
        zero = self.optimizer
        return zero1_sharded_state(self.pairs(model), zero.base_optimizer.state, model,
                                   zero.param_groups, rank, self.world_size, master_weights=master_weights)

    def load_sharded_state(self, model: nn.Module, read: Any, *, rank: int, keys: set[str],
                           values: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """Each rank reads its own rows of every tensor from the shard files (``read``)."""
        from training.optim.sharding import zero1_load_sharded_state

        zero = self.optimizer
        # Hyper-parameters from the checkpoint; the implementation keys (fused, foreach) stay this
        # process's: a GPU checkpoint saved with fused AdamW must not ask XLA for a fused kernel.
        from training.optim.factory import IMPLEMENTATION_KEYS

        for group, saved in zip(zero.param_groups, param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params" and k not in IMPLEMENTATION_KEYS})
        zero1_load_sharded_state(self.pairs(model), zero.base_optimizer.state, model, read, rank,
                                 self.world_size, keys=keys, values=values, device=self.device)
        init_adam_state(zero.base_optimizer)
        zero._sync_param_groups(zero.param_groups, zero.base_optimizer.param_groups)
        _flush()
