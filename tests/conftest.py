"""Shared test set-up.

Triton kernels run on CPU tensors through Triton's interpreter when no GPU is
present; TRITON_INTERPRET must be set before triton is first imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import glm5_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE.type == "cuda"
# Whether Triton kernels run in its interpreter (no bf16 math there); on a CUDA
# machine they compile, unless TRITON_INTERPRET=1 was set by hand.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    try:
        from glm5_ops.triton import indexer  # noqa: F401
    except ImportError:
        return False
    return True


# Every backend runs every correctness test; Triton under the interpreter on
# CPU is slow, so tests shrink their largest shapes for it (see big_ok).
BACKENDS = ["cpp", "reference"] + (["triton"] if triton_available() else [])


@pytest.fixture(params=BACKENDS)
def backend(request):
    with glm5_ops.use_backend(request.param):
        yield request.param


def float_dtypes(backend: str = "triton") -> list:
    """The float dtypes a test runs on `backend`: fp32, fp16 and bf16, except
    bf16 for Triton under the interpreter (it has no bf16 math). The default
    is the strictest case, for files that test the Triton kernels directly."""
    interpreted = backend == "triton" and INTERPRETED
    return [torch.float32, torch.float16] + ([] if interpreted else [torch.bfloat16])


def low_precision(backend: str = "triton") -> list:
    return [d for d in float_dtypes(backend) if d != torch.float32]


def pytest_report_header(config):
    from glm5_ops._backend import _C
    ext = "missing" if _C is None else ("with CUDA" if getattr(_C, "WITH_CUDA", 0) else "CPU only")
    tri = "not installed" if not triton_available() else ("interpreted" if INTERPRETED else "compiled")
    return (f"glm5: device {DEVICE} ({torch.cuda.get_device_name() if CUDA else 'no CUDA'}), torch "
            f"{torch.__version__}, glm5_ops._C {ext}, backends {BACKENDS}, triton {tri}")


# Decode-time kernels with no CUDA counterpart (glm5_ops runs torch there: docs/OPS.md).
CPU_ONLY_OPS = {"gemv", "rms_norm", "rope"}

# fp16/bf16 results may be at most this many times further from the fp32 truth than
# the reference run in that precision. The CUDA kernels round differently from
# torch (tensor-core tiles, bf16 probabilities before P @ V, fp32 sums in another
# order): on an H100 (2026-12-06) block-sparse dq reached 2.2x and fused_moe 2.4x.
LOW_PRECISION_FACTOR = 3.0 if CUDA else 2.0


def big_ok(backend: str) -> bool:
    """Whether a large shape is affordable on this backend here."""
    return not (backend == "triton" and INTERPRETED)


@pytest.fixture
def poisoned():
    """Uninitialised outputs are filled with NaN / INT_MAX, so any element a
    kernel forgets to write fails the checks instead of passing by luck."""
    old_det = torch.are_deterministic_algorithms_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old_det)
    torch.utils.deterministic.fill_uninitialized_memory = old_fill


def fresh(*shape, dtype=torch.float32, seed=None, scale=1.0):
    """Fresh random normal data on the test device (never zeros)."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)
