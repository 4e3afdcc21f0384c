"""Backend selection: "cpp" (the C++ CPU or CUDA kernels of glm5_ops._C, by
device), "triton" (glm5_ops/triton, GPU, or CPU tensors under
TRITON_INTERPRET=1) and "reference" (glm5_ops/reference.py).

The default for every device is "cpp", the fastest one measured (bench/RESULTS.md).
A backend that lacks an op raises NotImplementedError naming both; nothing
falls back silently to another backend.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os

import torch

BACKENDS = ("cpp", "triton", "reference")
_DEFAULT = {"cpu": "cpp", "cuda": "cpp"}
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("glm5_backend", default=None)

try:
    from . import _C  # noqa: F401  (importing it registers torch.ops.glm5.*)
    _C_ERROR: Exception | None = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    _C = None
    _C_ERROR = e


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops in this block on backend `name` ("cpp", "triton", "reference")."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)


def current_backend(device: torch.device) -> str:
    return _override.get() or _DEFAULT.get(device.type, "reference")


def cpu_inference_kernel_applies(*tensors) -> bool:
    """Whether an inference-only CPU kernel (gemv, rms_norm, rope) may take
    these tensors (None entries: absent optional arguments): all plain CPU
    tensors (no subclass such as DTensor), none requiring grad while autograd
    records, the "cpp" backend current and the extension built. Otherwise
    the caller runs torch's differentiable path."""
    present = [t for t in tensors if t is not None]
    if _C is None or not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
                             for t in present):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    return current_backend(present[0].device) == "cpp"


def cpp_ops():
    """torch.ops.glm5, or a clear error when the extension is not built."""
    if _C is None:
        raise ImportError("glm5_ops._C is not built or failed to load "
                          f"({_C_ERROR}); build it with: pip install --no-build-isolation -e .")
    return torch.ops.glm5


def triton_ready(device: torch.device) -> None:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton backend runs CPU tensors only under TRITON_INTERPRET=1 "
                           "(set it before importing glm5_ops); use a CUDA tensor or another backend")


def triton_module(name: str, device: torch.device):
    """glm5_ops.triton.<name>, imported on first use, once the device can run it."""
    triton_ready(device)
    return importlib.import_module(f"{__package__}.triton.{name}")


def dispatch(op: str, device: torch.device, impls: dict, *args, **kwargs):
    """Calls impls[backend](*args, **kwargs) for the current backend of `device`."""
    backend = current_backend(device)
    impl = impls.get(backend)
    if impl is None:
        raise NotImplementedError(f"glm5_ops.{op} has no {backend!r} backend yet")
    try:
        return impl(*args, **kwargs)
    except NotImplementedError as e:
        raise NotImplementedError(f"glm5_ops.{op}: the {backend!r} backend has no kernel for "
                                  f"{device.type} tensors ({str(e).splitlines()[0]})") from e


# ---------------------------------------------------------- op registration --
# The Triton kernels are ops too (namespace glm5_triton), so every backend's
# fake kernels and autograd go through torch.library alike.

TRITON_NAMESPACE = "glm5_triton"
OP_NAMESPACES = ("glm5", TRITON_NAMESPACE)


def _run_triton(family: str, name: str, *args):
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return getattr(triton_module(family, device), name)(*args)


def define_triton_ops(family: str, names) -> None:
    """glm5_triton::<name> for each name: the schema of glm5::<name> (its one
    home is csrc/ops.cpp), the kernel glm5_ops.triton.<family>.<name>, imported
    at the first call (so importing glm5_ops never needs triton)."""
    for name in names:
        schema = str(getattr(cpp_ops(), name).default._schema)
        torch.library.custom_op(f"{TRITON_NAMESPACE}::{name}", functools.partial(_run_triton, family, name),
                                mutates_args=(), schema=schema[schema.index("("):])


def triton_ops(device: torch.device):
    """torch.ops.glm5_triton, once the device can run the Triton kernels."""
    triton_ready(device)
    cpp_ops()   # the glm5_triton ops are defined with glm5's schemas
    return getattr(torch.ops, TRITON_NAMESPACE)


def register_op(name: str, fake, make_backward=None, setup_context=None, namespaces=OP_NAMESPACES) -> None:
    """register_fake (and, for a differentiable op, register_autograd) of
    <ns>::<name> in each namespace; make_backward(torch.ops.<ns>) returns the
    backward, which calls that namespace's backward ops."""
    for ns in namespaces:
        torch.library.register_fake(f"{ns}::{name}", fake)
        if make_backward is not None:
            torch.library.register_autograd(f"{ns}::{name}", make_backward(getattr(torch.ops, ns)),
                                            setup_context=setup_context)
