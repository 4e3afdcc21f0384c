"""The GLM-5 activation-memory policy (training/activation_policy.py): recomputation
leaves the gradients as they are, 8-bit saving stays close, names are checked."""
from __future__ import annotations

import pytest
import torch

from models.glm5.config import preset
from training.activation_policy import apply_activation_policy
from training.distributed_train import Trainer
from training.parallelize import ParallelDims


def _grads(policy: str) -> tuple[float, dict]:
    rows = torch.randint(0, preset("tiny").vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(preset("tiny"), ParallelDims(), None, memory_policy=policy)
    loss = trainer.backward(rows[:, :-1], rows[:, 1:])
    return loss, trainer.full_gradients()


def _worst(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b)


def test_recompute_and_compress8_gradients():
    loss, base = _grads("none")
    loss_r, rec = _grads("recompute")
    assert loss_r == loss and _worst(rec, base) < 1e-5
    _, c8 = _grads("compress8")
    assert 0 < _worst(c8, base) < 0.1   # lossy, but close: 8-bit groups of the saved activations


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="memory policy"):
        apply_activation_policy(torch.nn.Module(), "compress3")
