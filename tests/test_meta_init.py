"""Meta-device initialisation (training/meta_init.py): every mesh's processes,
each materialising only its own shards, end up with exactly the parameters
of the eager single-process model of the same seed, and a process's peak
allocation while building is below the eager build's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gloo_pool import GlooPool
from models.glm5.config import preset
from parallel_jobs import init_job, merged
from training.distributed_train import Trainer
from training.parallelize import ParallelDims

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

MESHES = [dict(dp_shard=2, tp=2), dict(tp=2, pp=2), dict(pp=2, ep=2)]   # strided DTensor shards, draws for another stage, ep slices


@pytest.fixture(scope="module")
def pool4():
    pool = GlooPool(4)
    yield pool
    pool.close()


def _eager_params(seed: int = 0) -> dict:
    return Trainer(preset("tiny"), ParallelDims(), None, seed=seed, meta_init=False).full_parameters()


def test_meta_init_single_process_equals_eager():
    meta = Trainer(preset("tiny"), ParallelDims(), None, seed=3, meta_init=True).full_parameters()
    eager = _eager_params(seed=3)
    assert meta.keys() == eager.keys()
    assert all(torch.equal(meta[n], eager[n]) for n in eager)
    assert not torch.equal(meta["lm_head.weight"], _eager_params(seed=4)["lm_head.weight"])


@pytest.mark.parametrize("dims", MESHES, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_meta_init_equals_eager_on_every_mesh(pool4, dims):
    got = merged(pool4.run(init_job, dims=dims, meta_init=True), "params")
    want = _eager_params()
    assert got.keys() == want.keys()
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, differ


def test_meta_init_peak_below_eager(pool4):
    meta = pool4.run(init_job, dims=dict(dp_shard=4), meta_init=True, track=True)
    eager = pool4.run(init_job, dims=dict(dp_shard=4), meta_init=False, track=True)
    full_bytes = sum(t.numel() * 4 for t in _eager_params().values())
    for m, e in zip(meta, eager):
        # eager: the whole model (and its constructors' draws) in every process;
        # meta: a quarter of it plus one whole parameter at a time
        assert e["peak_bytes"] >= full_bytes
        assert m["peak_bytes"] < 0.5 * e["peak_bytes"], (m["peak_bytes"], e["peak_bytes"])
