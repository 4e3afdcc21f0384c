"""torch.library.opcheck on every implemented op of torch.ops.glm5: schema,
fake (meta) kernel, autograd registration, torch.compile tracing."""
import pytest
import torch

from conftest import DEVICE, fresh

ops = torch.ops.glm5


def _indexer_args(causal=True, with_q_start=False):
    q, w, k = fresh(2, 5, 3, 16), fresh(2, 5, 3).abs(), fresh(2, 40, 16)
    qs = torch.tensor([30, 35], device=DEVICE) if with_q_start else None
    return q, w, k, causal, qs


CASES = {
    "topk_indices": [(fresh(4, 100), 7, False), (fresh(3, 2, 50, dtype=torch.float16), 50, True)],
    "indexer_scores": [_indexer_args(), _indexer_args(False), _indexer_args(True, True)],
    "indexer_topk": [(*_indexer_args()[:3], 9, True, None), (*_indexer_args(True, True)[:3], 40, True,
                                                              torch.tensor([30, 35], device=DEVICE))],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    for args in CASES[name]:
        torch.library.opcheck(getattr(ops, name).default, args)


def test_every_schema_is_declared():
    """All ops of ARCHITECTURE section 3 have schemas, even those later work implements."""
    declared = {"indexer_scores", "topk_indices", "indexer_topk", "block_topk_mask", "sparse_attention_fwd",
                "sparse_attention_bwd", "block_sparse_attention_fwd", "block_sparse_attention_bwd", "moe_route",
                "moe_dispatch", "moe_combine", "fused_moe_fwd", "fused_moe_bwd", "quantize_groupwise", "dequantize"}
    for name in declared:
        assert hasattr(ops, name), name
