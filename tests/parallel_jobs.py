"""What the parallelism tests run: one training run on every process of a
gloo pool (train_job), and the same run in one process (reference)."""
from __future__ import annotations

import torch

from models.glm5.config import preset
from training.comm_meter import CommMeter
from training.distributed_train import Trainer
from training.parallelize import ParallelDims

VOCAB = preset("tiny").vocab_size


def batches(steps: int, batch: int, seq: int, seed: int = 0):
    """The global batches (x, y) [batch, seq] of `steps` steps: random tokens, the same on every process."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def train_job(dims: dict, *, micro_batches: int = 1, schedule: str = "1f1b", steps: int = 3, batch: int = 8,
              seq: int = 32, lr: float = 1e-4, overlap: bool = True, attn: str = "dsa",
              save_to: str | None = None) -> dict:
    """losses and gradient collectives per step, and (from one process per
    pipeline stage) the stage's whole gradients after the first backward and
    whole parameters at the end."""
    d = ParallelDims(**dims)
    mesh = d.build_mesh("cpu")
    trainer = Trainer(preset("tiny"), d, mesh, micro_batches=micro_batches, schedule=schedule, lr=lr,
                      overlap=overlap, attn=attn)
    losses, grad_collectives, grads = [], [], None
    for x, y in batches(steps, batch, seq):
        with CommMeter() as comm:
            losses.append(trainer.backward(x, y))
        grad_collectives.append(comm.gradient_collectives())
        if grads is None:
            grads = trainer.full_gradients()
        trainer.optimizer_step()
    params = trainer.full_parameters()
    if save_to is not None:
        trainer.save_pretrained(save_to)
    owner = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    return dict(losses=losses, grad_collectives=grad_collectives, grads=grads if owner else None,
                params=params if owner else None)


def reference(*, steps: int = 3, batch: int = 8, seq: int = 32, lr: float = 1e-4, attn: str = "dsa") -> dict:
    """The single-process run of the same global batches (one thread: tiny
    ops on threads that other processes share spend their time at barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(preset("tiny"), ParallelDims(), None, lr=lr, attn=attn)
        losses, grads = [], None
        for x, y in batches(steps, batch, seq):
            losses.append(trainer.backward(x, y))
            if grads is None:
                grads = trainer.full_gradients()
            trainer.optimizer_step()
        return dict(losses=losses, grads=grads, params=trainer.full_parameters())
    finally:
        torch.set_num_threads(threads)


def merged(results: list[dict], key: str) -> dict:
    """The stages' parameters (key "params") or first-step gradients ("grads")
    as one dict: stages hold disjoint names."""
    out = {}
    for r in results:
        if r[key] is not None:
            out.update(r[key])
    return out


def worst_rel(a: dict, b: dict) -> tuple[float, str]:
    """max over tensors of |a - b| / |b| (Frobenius norms), and the tensor's name."""
    if set(a) != set(b):
        raise AssertionError(f"parameter names differ: only parallel {sorted(set(a) - set(b))}, "
                             f"only reference {sorted(set(b) - set(a))}")
    errs = [(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)), n) for n in b]
    return max(errs)


def init_job(dims: dict, *, meta_init: bool, track: bool = False) -> dict:
    """The whole parameters right after construction (from one process per
    stage) and, with `track`, the peak bytes MemTracker saw allocated while
    constructing (it slows every op down: only where the test needs it)."""
    import contextlib

    from torch.distributed._tools.mem_tracker import MemTracker
    d = ParallelDims(**dims)
    mesh = d.build_mesh("cpu")
    tracker = MemTracker() if track else None
    with tracker if track else contextlib.nullcontext():
        trainer = Trainer(preset("tiny"), d, mesh, micro_batches=d.pp, meta_init=meta_init)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] if track else None
    params = trainer.full_parameters()
    owner = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    return dict(params=params if owner else None, peak_bytes=peak)
