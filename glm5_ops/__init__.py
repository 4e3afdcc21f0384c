"""glm5_ops: GLM-5's sparse-attention and MoE kernels behind one Python API.

    import glm5_ops
    idx = glm5_ops.indexer_topk(q, w, k, topk=2048)          # DSA selection
    with glm5_ops.use_backend("triton"): ...                  # or "cpp", "reference"

Layouts and semantics: each family's module docstring and glm5_ops/reference.py;
the argument contract and degenerate shapes: docs/OPS.md.
"""
from . import reference
from ._backend import BACKENDS, current_backend, use_backend
from .attention import BlockMask, block_sparse_attention, block_topk_mask, sparse_attention
from .compress import SavedTensorMeter, compressed_activations, dequantize, quantize_groupwise
from .indexer import indexer_scores, indexer_topk, topk_indices
from .int8 import fused_moe_int8, int8_linear, int8_linear_heads, quantize_int8, w8a8_linear
from . import linear as linear_module
from .linear import gemv, gemv_heads, linear, linear_heads, takes_gemv as linear_takes_gemv
from .moe import fused_moe, moe_combine, moe_dispatch, moe_route
from .moe_plan import MoEPlan
from .paged import cache_write
from .recall import AttentionRecall, attention_recall
from .token_ops import rms_norm, rope

__all__ = ["BACKENDS", "current_backend", "use_backend", "reference",
           "indexer_scores", "topk_indices", "indexer_topk",
           "sparse_attention", "block_topk_mask", "block_sparse_attention", "BlockMask",
           "attention_recall", "AttentionRecall",
           "moe_route", "moe_dispatch", "moe_combine", "fused_moe", "MoEPlan",
           "quantize_groupwise", "dequantize", "compressed_activations", "SavedTensorMeter",
           "quantize_int8", "int8_linear", "int8_linear_heads", "w8a8_linear", "fused_moe_int8",
           "gemv", "gemv_heads", "linear", "linear_heads", "linear_takes_gemv", "rms_norm", "rope", "cache_write"]
