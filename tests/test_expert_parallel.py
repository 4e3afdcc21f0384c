"""Expert parallelism (glm5_ops/expert_parallel.py): a 2-process gloo run,
launched with torchrun exactly as the README says, must give the
single-process layer's output and gradients (dx, dweights, and each rank's
expert weight grads) within 1e-5; its self-check exits non-zero otherwise."""
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import glm5_ops
from conftest import fresh
from glm5_ops.expert_parallel import ep_fused_moe, expert_range

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(glm5_ops.__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_two_rank_gloo_matches_single_process():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")  # gloo on CPU even on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "glm5_ops.expert_parallel"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "expert_parallel self-check: 2 ranks (gloo)" in res.stdout


def test_expert_range_and_one_rank_group():
    assert [expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match=r"num_experts=6 must be a multiple of the world size 4"):
        expert_range(6, 0, 4)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        x, wgu, wd = fresh(9, 8, seed=1), fresh(4, 6, 8, seed=2), fresh(4, 8, 3, seed=3)
        w, ids = fresh(9, 2, seed=4), torch.randint(0, 4, (9, 2), dtype=torch.int32, device=x.device)
        torch.testing.assert_close(ep_fused_moe(x, wgu, wd, w, ids, num_experts=4),
                                   glm5_ops.fused_moe(x, wgu, wd, w, ids), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"ids must hold global expert ids of num_experts=4"):
            # every id out of range: ids + 1 left it in range whenever the unseeded draw held no 3
            ep_fused_moe(x, wgu, wd, w, ids + 4, num_experts=4)
        with pytest.raises(ValueError, match=r"w_gate_up_local must hold this rank's 4 experts"):
            ep_fused_moe(x, wgu[:2], wd[:2], w, ids, num_experts=4)
    finally:
        dist.destroy_process_group()
