"""DCP checkpoints (training/checkpoint.py): resharding dp_shard=2 x tp=2 ->
dp_shard=4 and -> one process (next loss within 1e-6 relative; bit-identical
on the saving mesh, saved asynchronously while training went on), an
unfinished save never loaded, incremental saves of a LoRA-only stage, and
bad arguments named. The SIGKILL trials: tests/test_checkpoint_crash.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ckpt_jobs import load_and_step, train_and_save
from gloo_pool import GlooPool
from models.glm5.config import preset
from parallel_jobs import batches
from training.checkpoint import MANIFEST, Checkpointer, complete_checkpoints, latest_checkpoint, read_manifest
from training.distributed_train import Trainer
from training.lora import LoraConfig
from training.parallelize import ParallelDims

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_resharding_dp2xtp2_to_dp4_and_one_process(tmp_path):
    root = str(tmp_path / "ckpt")
    pool = GlooPool(4)
    try:
        saved = pool.run(train_and_save, dims=dict(dp_shard=2, tp=2), root=root, async_save=True)[0]
        same_mesh = pool.run(load_and_step, dims=dict(dp_shard=2, tp=2), root=root)[0]
        dp4 = pool.run(load_and_step, dims=dict(dp_shard=4), root=root)[0]
    finally:
        pool.close()
    one = load_and_step(None, root)
    want = saved[-1]   # the step the saving run took after its (asynchronous) save
    print(f"\nnext loss: saving run {want!r}, dp2xtp2 {same_mesh!r}, dp4 {dp4!r}, one process {one!r}")
    assert same_mesh == want
    for got in (dp4, one):
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def _trainer(seed=0, lora=None):
    return Trainer(preset("tiny"), ParallelDims(), None, lr=1e-3, seed=seed, lora=lora)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_unfinished_save_is_never_loaded(tmp_path):
    root = str(tmp_path)
    trainer, data = _trainer(), batches(4, 4, 32)
    ckpt = Checkpointer(root, trainer, keep=5)
    for step in range(3):
        trainer.step(*data[step])
        ckpt.save(step + 1)
        if step == 1:
            at_two = _params(trainer)
    # a save killed halfway: data files cut short, no manifest (a stray temporary one)
    killed = os.path.join(root, "step_000000003")
    os.remove(os.path.join(killed, MANIFEST))
    for name in os.listdir(killed):
        if name.endswith(".distcp"):
            with open(os.path.join(killed, name), "r+b") as f:
                f.truncate(100)
    open(os.path.join(killed, MANIFEST + ".tmp"), "w").write("{")
    assert latest_checkpoint(root).endswith("step_000000002")
    fresh = _trainer(seed=1)
    assert Checkpointer(root, fresh).load()["step"] == 2
    assert all(torch.equal(p, at_two[n]) for n, p in _params(fresh).items())
    assert not os.path.exists(killed)   # a resume deletes unfinished saves
    # both continue identically: the optimizer state came back too
    assert fresh.step(*data[2]) == _trainer_from(root).step(*data[2])


def _trainer_from(root):
    t = _trainer(seed=2)
    Checkpointer(root, t).load()
    return t


def test_incremental_saves_of_a_lora_stage(tmp_path):
    """Frozen weights are written once (the full checkpoint); the increments
    hold the adapters, their Adam state and the extras, and a resume composes
    base + newest increment, even into a model initialised differently."""
    root = str(tmp_path)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_a_proj", "kv_a_proj_with_mqa", "o_proj"],
                     target_parameters=["mlp.gate.weight"])
    trainer, data = _trainer(lora=cfg), batches(5, 4, 32)
    ckpt = Checkpointer(root, trainer, incremental=True, keep=1)
    for step in range(4):
        trainer.step(*data[step])
        ckpt.save(step + 1, {"data_rng": torch.arange(3)})
    done = complete_checkpoints(root)
    kinds = [(s, m["kind"], m["base"]) for s, _, m in done]
    assert kinds == [(1, "full", None), (4, "incremental", "step_000000001")], kinds   # keep=1 keeps its base
    full, inc = done[0][2]["bytes"], done[1][2]["bytes"]
    print(f"\nfull {full} bytes, incremental {inc} bytes ({100 * inc / full:.1f}%)")
    assert inc <= 0.25 * full
    fresh = _trainer(seed=3, lora=cfg)
    extra = Checkpointer(root, fresh).load()
    assert extra["step"] == 4 and torch.equal(extra["data_rng"], torch.arange(3))
    want = _params(trainer)
    assert all(torch.equal(p, want[n]) for n, p in _params(fresh).items())
    assert fresh.step(*data[4]) == trainer.step(*data[4])


def test_bad_arguments_are_named(tmp_path):
    trainer = _trainer()
    with pytest.raises(ValueError, match="keep must be a positive int"):
        Checkpointer(str(tmp_path), trainer, keep=0)
    ckpt = Checkpointer(str(tmp_path), trainer)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ckpt.save(-1)
    os.makedirs(tmp_path / "step_000000007")
    with pytest.raises(ValueError, match="is not a complete checkpoint"):
        ckpt.load(str(tmp_path / "step_000000007"))
    assert ckpt.load() is None and read_manifest(str(tmp_path / "step_000000007")) is None
