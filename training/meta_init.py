"""Meta-device initialisation (torchtitan's way): the model is built on the
meta device, split, parallelized and sharded there, and only then does each
process allocate and fill its own shards. No process ever holds the whole
model; the largest full tensor alive at once is one parameter.

    plan = record_init(meta_model)         # before keep_layers: every draw of init_weights, in order
    keep_layers(...); parallelize(...)
    materialize(model, plan, seed, device) # to_empty, then this process's slice of each draw

The values equal the eager model's (`seeded_init`: the same seed, then
GLM5ForCausalLM.init_weights): `materialize` replays init_weights' draws in
the same order from the same generator, each as the whole tensor, keeps the
slice this process holds (the experts of its ep rank, then its DTensor
shard) and drops the rest, draws for layers another pipeline stage holds
included, so every stage's generator stays in step with the eager one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

INIT_OPS = {torch.Tensor.normal_: "normal_", torch.Tensor.fill_: "fill_", torch.Tensor.zero_: "zero_"}


@dataclass(frozen=True)
class Draw:
    name: str               # parameter or buffer name in the whole model
    shape: tuple[int, ...]
    op: str                 # normal_ | fill_ | zero_
    args: tuple


class _Recorder(TorchFunctionMode):
    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names, self.draws = names, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in INIT_OPS and id(args[0]) in self.names:
            t = args[0]
            self.draws.append(Draw(self.names[id(t)], tuple(t.shape), INIT_OPS[func], tuple(args[1:])
                                   + tuple(kwargs.values())))
        return func(*args, **kwargs)


def record_init(model: nn.Module) -> list[Draw]:
    """What model.init_weights() does, tensor by tensor in order, recorded on a
    meta-device model (nothing is allocated or drawn)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    if not all(t.is_meta for t in tensors.values()):
        raise ValueError("record_init needs a model built on the meta device")
    with _Recorder({id(t): n for n, t in tensors.items()}) as rec:
        model.init_weights()
    missing = set(tensors) - {d.name for d in rec.draws}
    if missing:   # a tensor init_weights leaves alone would stay uninitialised memory after to_empty
        raise ValueError(f"init_weights does not initialise {sorted(missing)}")
    return rec.draws


def seeded_init(model: nn.Module, seed: int) -> None:
    """The eager path's values: the generator seeded, then init_weights."""
    torch.manual_seed(seed)
    model.init_weights()


def _local_slice(full: torch.Tensor, target: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """The part of the whole tensor `full` that `target` (this process's copy) holds."""
    ep_range = getattr(owner, "ep_range", None)
    if ep_range is not None:   # routed experts: this ep rank's experts, before any data-parallel shard
        full = full[ep_range[0]:ep_range[1]]
    if isinstance(target, DTensor):
        mesh = target.device_mesh
        whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return whole.redistribute(mesh, target.placements).to_local()   # Replicate -> Shard: a local slice
    return full


@torch.no_grad()
def materialize(model: nn.Module, plan: list[Draw], seed: int, device) -> None:
    """Allocates this process's shards of `model` (built on meta, then split and
    parallelized) on `device` and fills them with the eager model's values."""
    model.to_empty(device=device)
    owners = {}
    for mname, module in model.named_modules():
        for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            owners[f"{mname}.{pname}" if mname else pname] = (module, pname)
    seen = set()
    torch.manual_seed(seed)
    for d in plan:
        module, pname = owners.get(d.name, (None, None))
        target = getattr(module, pname) if module is not None else None
        whole = target is not None and not isinstance(target, DTensor) and getattr(module, "ep_range", None) is None
        if whole:   # this process holds all of it: drawn in place, as the eager model does
            getattr(target, d.op)(*d.args)
        else:
            full = getattr(torch.empty(d.shape, device=device), d.op)(*d.args)
            if target is None:   # another pipeline stage holds it: drawn only to keep the generator in step
                continue
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(_local_slice(full, target, module))
            del full
        seen.add(d.name)
    left = set(owners) - seen
    if left:
        raise ValueError(f"no initialisation recorded for {sorted(left)}")
