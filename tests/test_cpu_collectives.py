"""FSDP2's memory on CPU processes: the in-place gloo collectives
(training/cpu_collectives.py) equal gloo's own and free what they are done
with; the embedding and LM head are FSDP units of their own; the Trainer's
fixed mmap threshold (training/allocator.py) returns freed memory."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from gloo_pool import GlooPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def collectives_job() -> dict:
    from training.comm_meter import CommMeter
    from training.cpu_collectives import InplaceAllGather, InplaceReduceScatter
    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(1000, generator=gen)
    want_gather = torch.empty(world * 1000)
    dist.all_gather_into_tensor(want_gather, shard)
    out = {}
    gather = InplaceAllGather()
    flat = gather.allocate((world * 1000,), dtype=torch.float32, device=torch.device("cpu"))
    flat.view(world, -1)[rank].copy_(shard)
    with CommMeter() as comm:
        gather(flat, flat.view(world, -1)[rank], g, async_op=True).wait()
        grads = torch.randn(world * 1000, generator=gen)
        want_sum, want_avg = torch.empty(1000), torch.empty(1000)
        dist.reduce_scatter_tensor(want_sum, grads.clone())
        dist.reduce_scatter_tensor(want_avg, grads.clone(), op=dist.ReduceOp.AVG)
        scatter = InplaceReduceScatter()
        got_sum, got_avg, inp = torch.empty(1000), torch.empty(1000), grads.clone()
        scatter(got_sum, inp, g, dist.ReduceOp.SUM)
        scatter(got_avg, grads.clone(), g, dist.ReduceOp.AVG)
    out["gather_equal"] = torch.equal(flat, want_gather)
    out["sum_err"] = (got_sum - want_sum).abs().max().item()
    out["avg_err"] = (got_avg - want_avg).abs().max().item()
    out["input_freed"] = inp.untyped_storage().nbytes() == 0
    out["counts"] = dict(comm.counts)
    return out


def units_job() -> dict:
    from torch.distributed.fsdp import FSDPModule

    from models.glm5.config import preset
    from training.distributed_train import Trainer
    from training.parallelize import ParallelDims
    dims = ParallelDims(dp_shard=2)
    trainer = Trainer(preset("tiny"), dims, dims.build_mesh("cpu"), mmap_threshold=None)
    m = trainer.model
    return dict(embed=isinstance(m.model.embed_tokens, FSDPModule), head=isinstance(m.lm_head, FSDPModule),
                comm=type(m.lm_head._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm).__name__)


def experts_units_job() -> dict:
    """The collectives each FSDP unit issues in a backward, in order, and the parameter names."""
    from torch.distributed.fsdp import FSDPModule

    from models.glm5.config import preset
    from training.cpu_collectives import InplaceAllGather, InplaceReduceScatter
    from training.distributed_train import Trainer
    from training.parallelize import ParallelDims
    events = []

    class Gather(InplaceAllGather):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, *args, **kwargs):
            events.append(("gather", self.name))
            return super().__call__(*args, **kwargs)

    class Reduce(InplaceReduceScatter):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, *args, **kwargs):
            events.append(("reduce", self.name))
            return super().__call__(*args, **kwargs)

    dims = ParallelDims(dp_shard=2)
    trainer = Trainer(preset("tiny"), dims, dims.build_mesh("cpu"), mmap_threshold=None)
    m = trainer.model
    for name, unit in m.named_modules():
        if isinstance(unit, FSDPModule) and unit is not m:
            unit.set_custom_all_gather(Gather(name))
            unit.set_custom_reduce_scatter(Reduce(name))
    x = torch.randint(0, 256, (4, 33))
    loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    events.clear()
    loss.backward()
    experts = [n for n, u in m.named_modules() if isinstance(u, FSDPModule) and n.endswith("mlp.experts")]
    return dict(events=events, experts=experts, names=sorted(n for n, _ in m.named_parameters()))


@pytest.fixture(scope="module")
def pool2():
    pool = GlooPool(2)
    yield pool
    pool.close()


def test_inplace_collectives_equal_gloos_and_free_their_input(pool2):
    for r in pool2.run(collectives_job):
        assert r["gather_equal"]
        assert r["sum_err"] <= 1e-6 and r["avg_err"] <= 1e-6, r
        assert r["input_freed"]
        # The meter sees each as one all-gather / reduce-scatter (gloo's two reduce-scatters
        # above count too), not as the broadcasts and reduces they are made of.
        assert r["counts"] == {"all_gather": 1, "reduce_scatter": 4}, r["counts"]


def test_embedding_and_head_are_units_with_inplace_collectives(pool2):
    for r in pool2.run(units_job):
        assert r == dict(embed=True, head=True, comm="InplaceReduceScatter"), r


def test_mmap_threshold_refuses_bad_values():
    from training.allocator import set_mmap_threshold
    for bad in (-1, 2**40, 1.5, True):
        with pytest.raises(ValueError, match="mmap_threshold"):
            set_mmap_threshold(bad)


_RETAINED = textwrap.dedent("""
    import sys, torch
    from training.allocator import set_mmap_threshold
    if sys.argv[1] == "fixed":
        set_mmap_threshold(64 * 1024)
    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
    big = torch.ones(16 * 2**18)
    del big                               # a 16 MiB block freed: glibc's dynamic threshold rises above 1 MiB
    before = rss()
    blocks = [torch.ones(2**18) for _ in range(300)]   # 300 x 1 MiB
    keep = blocks.pop()                   # the last one stays: the heap cannot shrink past it
    del blocks
    print(rss() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_fixed_mmap_threshold_returns_freed_memory():
    def retained(mode):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        out = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, check=True,
                             cwd=ROOT, env=env)
        return float(out.stdout.split()[-1])
    dynamic, fixed = retained("dynamic"), retained("fixed")
    assert dynamic > 200, f"glibc's default kept only {dynamic:.0f} MiB of 300 freed: the premise changed"
    assert fixed < 20, f"{fixed:.0f} MiB of 300 freed MiB still resident with the threshold fixed"


def test_experts_are_units_gathered_one_at_a_time_in_backward(pool2):
    """Each MoE layer's routed experts are an FSDP unit inside the layer's (names
    unchanged); in backward no experts unit is gathered while another one's
    gradients are pending, and the next experts' gather is issued before the
    layer's own reduction, i.e. it overlaps the attention's backward."""
    from models.glm5 import GLM5ForCausalLM
    from models.glm5.config import preset
    want_names = sorted(n for n, _ in GLM5ForCausalLM(preset("tiny")).named_parameters()
                        if ".mtp." not in n)   # the Trainer does not train MTP
    for r in pool2.run(experts_units_job):
        assert r["names"] == want_names
        assert len(r["experts"]) >= 2, r["experts"]
        seq = [e for e in r["events"] if e[1].endswith("mlp.experts")]
        want = [(kind, name) for name in reversed(r["experts"]) for kind in ("gather", "reduce")]
        assert seq == want, seq
        for later, earlier in zip(reversed(r["experts"]), list(reversed(r["experts"]))[1:]):
            layer = later.removesuffix(".mlp.experts")
            assert r["events"].index(("gather", earlier)) < r["events"].index(("reduce", layer)), r["events"]
