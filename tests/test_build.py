"""The build: CPU kernels always; CUDA kernels compiled in whenever torch is a
CUDA build and nvcc exists, even on a machine without a GPU."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import glm5_ops
from conftest import CPU_ONLY_OPS

OPS = ["indexer_scores", "topk_indices", "indexer_topk", "sparse_attention_fwd", "sparse_attention_bwd",
       "block_sparse_attention_fwd", "block_sparse_attention_bwd", "block_topk_mask",
       "moe_route", "moe_dispatch", "moe_combine", "fused_moe_fwd", "fused_moe_bwd",
       "quantize_groupwise", "dequantize",
       "int8_quantize_rows", "int8_linear", "int8_linear_heads", "w8a8_linear", "fused_moe_int8"]
# One implementation for every device (data movement: index_copy_ behind a mutating schema).
COMPOSITE_OPS = ["cache_write"]


def _nvcc_present():
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


@pytest.mark.parametrize("op", OPS + sorted(CPU_ONLY_OPS))
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


def test_a_cpp_error_reaches_python():
    """An op's TORCH_CHECK becomes a Python exception. With a private static
    libstdc++ in the extension (the GPU machines' g++ links one unless setup.py
    names the shared one) the throw killed the process with SIGSEGV instead; run
    apart so that such a build fails this test rather than the whole session."""
    code = ("import torch, glm5_ops\n"
            "try:\n    torch.ops.glm5.cpu_lane_costs(0, 64)\n"
            "except ValueError as e:\n    print('raised:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "raised:" in out.stdout, (out.returncode, out.stderr[-2000:])


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="reads the ELF dynamic section with readelf (Linux)")
def test_extension_needs_the_shared_cxx_runtime():
    needed = subprocess.run(["readelf", "-d", glm5_ops._backend._C.__file__], capture_output=True, text=True,
                            check=True).stdout
    assert "libstdc++.so" in needed, "the extension carries a static libstdc++ (setup.py shared_libstdcxx)"
