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
INTERPRETED = DEVICE.type == "cpu"


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
