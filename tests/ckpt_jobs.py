"""What the checkpoint tests run on every process of a gloo pool: train on
one mesh and save, or load under another mesh and take the next step."""
from __future__ import annotations

from models.glm5.config import preset
from parallel_jobs import batches
from training.checkpoint import Checkpointer
from training.distributed_train import Trainer
from training.parallelize import ParallelDims

LR = 1e-3


def _trainer(dims: dict | None) -> Trainer:
    d = ParallelDims(**(dims or {}))
    mesh = d.build_mesh("cpu") if d.world_size > 1 else None
    return Trainer(preset("tiny"), d, mesh, lr=LR)


def train_and_save(dims: dict, root: str, steps: int = 2, *, async_save: bool = False) -> list[float]:
    """`steps` steps, a checkpoint after them, then the next step's loss (which
    a resumed run must reproduce); returns every loss."""
    trainer = _trainer(dims)
    data = batches(steps + 1, 8, 32)
    losses = [trainer.step(*data[i]) for i in range(steps)]
    ckpt = Checkpointer(root, trainer, async_save=async_save)
    ckpt.save(steps)
    losses.append(trainer.step(*data[steps]))   # trains while an async save is still writing
    ckpt.close()
    return losses


def load_and_step(dims: dict | None, root: str, steps: int = 2) -> float:
    """A fresh trainer under `dims`, loaded from the newest checkpoint, then one step: its loss."""
    trainer = _trainer(dims)
    extra = Checkpointer(root, trainer).load()
    assert extra["step"] == steps, extra
    return trainer.step(*batches(steps + 1, 8, 32)[steps])
