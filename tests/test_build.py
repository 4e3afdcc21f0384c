"""The build: CPU kernels always; CUDA kernels compiled in whenever torch is a
CUDA build and nvcc exists, even on a machine without a GPU."""
import os
import shutil

import pytest
import torch

import glm5_ops

OPS = ["indexer_scores", "topk_indices", "indexer_topk", "sparse_attention_fwd", "sparse_attention_bwd",
       "block_sparse_attention_fwd", "block_sparse_attention_bwd", "block_topk_mask",
       "moe_route", "moe_dispatch", "moe_combine", "fused_moe_fwd", "fused_moe_bwd",
       "quantize_groupwise", "dequantize",
       "int8_quantize_rows", "int8_linear", "int8_linear_heads", "w8a8_linear", "fused_moe_int8"]
# Decode-time kernels with no CUDA counterpart (glm5_ops runs torch there: docs/OPS.md).
CPU_ONLY_OPS = ["gemv", "rms_norm", "rope"]
# One implementation for every device (data movement: index_copy_ behind a mutating schema).
COMPOSITE_OPS = ["cache_write"]


def _nvcc_present():
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


@pytest.mark.parametrize("op", OPS + CPU_ONLY_OPS)
def test_cpu_kernels_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"glm5::{op}", "CPU")


@pytest.mark.parametrize("op", COMPOSITE_OPS)
def test_composite_ops_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"glm5::{op}", "CompositeExplicitAutograd")


@pytest.mark.skipif(torch.version.cuda is None or not _nvcc_present() or os.environ.get("GLM5_BUILD_CUDA") == "0",
                    reason="CPU-only torch or no nvcc: the CUDA sources are not compiled")
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compiled_in(op):
    assert glm5_ops._backend._C.WITH_CUDA == 1, "torch is a CUDA build and nvcc exists, but _C has no CUDA kernels"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"glm5::{op}", "CUDA")
