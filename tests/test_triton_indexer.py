"""The Triton indexer's shared-memory plan (glm5_ops/triton/indexer.py
_scores_config) and the paths it opens: heads in chunks and fewer stages give
the reference's scores; a shape that fits nowhere raises NotImplementedError
naming it; an OutOfResources at launch becomes a NotImplementedError too
(glm5_ops/triton/_limits.py). The numbers are sm_90's (227 KiB a program),
checked against sm_90 compiles with triton 3.6 (see _scores_smem).
"""
import pytest
import torch

pytest.importorskip("triton")

from conftest import DEVICE, fresh  # noqa: E402
from glm5_ops import reference  # noqa: E402
from glm5_ops.triton import _limits  # noqa: E402
from glm5_ops.triton import indexer as X  # noqa: E402

SM90 = _limits.SM90_SMEM


def _item(dtype):
    return torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,D", [(3, 20), (8, 576), (32, 128), (64, 128), (160, 64), (256, 128), (128, 256),
                                 (512, 128), (64, 576), (32, 1024), (1024, 64)])
def test_scores_config_fits_sm90(dtype, H, D):
    cfg = X._scores_config(D, H, dtype, SM90)
    est = X._scores_smem(cfg["D_PAD"], cfg["H_CHUNK"], cfg["BLOCK_T"], _item(dtype), cfg["num_stages"])
    assert est <= SM90
    assert cfg["H_CHUNK"] >= 16 and cfg["BLOCK_T"] >= 16 and cfg["H_PAD"] % cfg["H_CHUNK"] == 0


def test_scores_config_keeps_the_glm5_tiles():
    # GLM-5's indexer (bf16, 32 heads of 128): all heads at once, 3 stages, 128 keys, as before.
    cfg = X._scores_config(128, 32, torch.bfloat16, SM90)
    assert cfg == dict(H_PAD=32, D_PAD=128, H_CHUNK=32, BLOCK_T=128, num_stages=3, num_warps=4)
    # The suite's fp32 D=576 case needed 262,656 bytes with 3 stages: 2 now (197,120 measured).
    cfg = X._scores_config(576, 8, torch.float32, SM90)
    assert (cfg["num_stages"], cfg["H_CHUNK"], cfg["BLOCK_T"]) == (2, 16, 32)


def test_scores_config_names_a_shape_that_fits_nowhere():
    with pytest.raises(NotImplementedError, match=r"D=4096 \(H=8\) in float32.*shared memory"):
        X._scores_config(4096, 8, torch.float32, SM90)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="forces a tiny shared-memory budget: interpreter only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_chunks_and_fewer_stages_match_reference(monkeypatch, dtype):
    """A 20 KB budget forces head chunks (16 or 32 of H=40: the last one partial),
    32- or 64-key blocks and 2 stages: scores and the fused top-k still match the oracle."""
    budget = 20 * 1024
    monkeypatch.setattr(X, "smem_limit", lambda device: budget)
    cfg = X._scores_config(64, 40, dtype, budget)
    assert cfg["H_CHUNK"] < cfg["H_PAD"]
    B, S, H, D, T = 2, 19, 40, 64, 70
    q = fresh(B, S, H, D, dtype=dtype, seed=1) * D ** -0.5
    w = fresh(B, S, H, seed=2) * H ** -0.5
    k = fresh(B, T, D, dtype=dtype, seed=3)
    ref = reference.indexer_scores(q, w, k, causal=True)
    out = X.indexer_scores(q, w, k, True, None)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[fin], ref[fin], rtol=tol, atol=tol)
    idx = X.indexer_topk(q, w, k, 8, True, None)
    want = reference.topk_indices(ref, 8, sorted=True)
    got_vals = ref.reshape(-1, T).gather(-1, idx.reshape(-1, 8).long().clamp_min(0))
    want_vals = ref.reshape(-1, T).gather(-1, want.reshape(-1, 8).long().clamp_min(0))
    valid = want.reshape(-1, 8) >= 0
    assert torch.equal(idx.reshape(-1, 8) >= 0, valid)
    gv = torch.where(valid, got_vals, -torch.inf).sort(-1, descending=True).values
    wv = torch.where(valid, want_vals, -torch.inf)
    torch.testing.assert_close(gv, wv, rtol=0, atol=5 * tol * ref[fin].abs().max().item())


def test_launch_guard_names_the_shape():
    with pytest.raises(NotImplementedError, match=r"triton op: q \(1, 2\).*out of resource: shared memory"):
        with _limits.launch_guard(lambda: "triton op: q (1, 2)"):
            raise _limits.OutOfResources(262656, 232448, "shared memory")
    with pytest.raises(ValueError):      # anything else passes through unchanged
        with _limits.launch_guard("x"):
            raise ValueError("not a resource error")
