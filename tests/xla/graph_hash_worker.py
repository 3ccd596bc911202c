"""One simulated rank of a data-parallel world: trace two optimizer steps, print their graph hashes.

Run as a subprocess with RANK / WORLD_SIZE set (as torchrun would): the objective and the
loader's data come from that rank, while the XLA runtime is one PJRT CPU device (XLA
collectives across processes do not work on PJRT CPU: they return wrong values, silently;
with one device the gradient all-reduce is a no-op). What differs between real ranks apart from collectives,
i.e. rank-dependent values in the traced program, differs here too.

Prints one JSON line: {"rank", "hashes": [step 0, step 1], "compile": compile_stats}.
With XLA_PERSISTENT_CACHE_PATH set, torch-xla's on-disk compile cache is used (the stand-in
for the Neuron persistent cache in the compile-count measurement).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")
RANK, WORLD = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
    os.environ.pop(key, None)

import torch  # noqa: E402

from training.backends.neuron import NeuronBackend  # noqa: E402
from training.backends.neuron_config import NeuronConfig  # noqa: E402
from training.loop import train_step  # noqa: E402
from training.model.build import ModelConfig, build_model  # noqa: E402
from training.objective import ObjectiveConfig, RectifiedFlow  # noqa: E402
from training.optim.factory import OptimConfig, build_scheduler, optimizer_factory  # noqa: E402
from training.smoke.trn import step_graph_hash, step_graph_tensors  # noqa: E402


def main() -> None:
    zero1 = "--zero1" in sys.argv
    backend = NeuronBackend(NeuronConfig(zero1=zero1), precision="fp32")
    backend.init()
    torch.manual_seed(0)
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
    optim = OptimConfig(lr=1e-3, warmup_steps=0, max_grad_norm=1.0)
    optimizer = backend.build_optimizer(model, optimizer_factory(optim, model))
    scheduler = build_scheduler(optimizer, optim, max_steps=10)
    tokens, dim, batch = 8, 8, 2
    objective = RectifiedFlow(ObjectiveConfig(caption_dropout=0.5), vae_scaling_factor=1.0,
                              null_text=torch.zeros(tokens, dim).to(backend.device),
                              null_mask=torch.ones(tokens, dtype=torch.long).to(backend.device),
                              rank=RANK, world_size=WORLD)
    gen = torch.Generator().manual_seed(100 + RANK)  # each rank's own data, as the loader gives

    def batches():
        while True:
            yield {"latents": torch.randn(batch, 4, 8, 8, generator=gen),
                   "text": torch.randn(batch, tokens, dim, generator=gen),
                   "text_mask": torch.ones(batch, tokens, dtype=torch.long)}

    device_batches = backend.device_batches(batches())
    hashes = []
    for _ in range(2):
        loss, norm = train_step(model, optimizer, scheduler, objective, device_batches, backend, optim)
        hashes.append(step_graph_hash(step_graph_tensors(model, optimizer, loss, norm)))
        backend.sync()
    import torch_xla.debug.metrics as met

    stats = {**backend.compile_stats(), "persistent_cache_hits": int(met.counter_value("PersistentCacheHit") or 0),
             "persistent_cache_misses": int(met.counter_value("PersistentCacheMiss") or 0)}
    print(json.dumps({"rank": RANK, "world_size": WORLD, "hashes": hashes, "compile": stats}), flush=True)
    backend.close()


if __name__ == "__main__":
    main()
