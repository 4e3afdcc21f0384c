"""Named ranges for profilers: `with nvtx_range("layer3/attn/core"): ...`.

The model and the ops mark every component with a range named like the
architecture (docs/ARCHITECTURE.md, "NVTX ranges"), so an Nsight Systems timeline or a
torch.profiler trace reads like the network. Ranges cost one flag check while
recording is off (the default); `profiling/` switches recording on.

When on, each range is
  - an NVTX range in domain "glm5" through the `nvtx` package when it is
    installed, else torch.cuda.nvtx when CUDA is available, else none; and
  - a torch.profiler `record_function` of the same name, so CPU traces carry
    the same names (the component table of `glm5-lab profile` is built from them).

This module sits at the bottom of the stack (glm5_ops): models import it,
it imports nothing of the lab.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_recording = False
# The names of the ranges open on this thread, innermost last: lets an
# observer (profiling's FLOP counter) attribute each op to its component.
_open = threading.local()


def _nvtx_backend():
    """(push, pop) for the best NVTX available, or None."""
    try:
        import nvtx  # the NVIDIA `nvtx` package: domains, works without a GPU driver (no-op)

        domain = nvtx.get_domain("glm5")

        def push(name):
            domain.push_range(domain.get_event_attributes(message=name))

        return push, domain.pop_range, "nvtx"
    except Exception:  # not installed, or a build that cannot load
        pass
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop, "torch.cuda.nvtx"
    return None


_backend = None  # resolved on first enable(): importing nvtx is not free


def backend_name() -> str:
    """Which NVTX implementation the ranges use: "nvtx", "torch.cuda.nvtx" or "none"."""
    global _backend
    if _backend is None:
        _backend = _nvtx_backend() or False
    return _backend[2] if _backend else "none"


def enable(on: bool = True) -> None:
    """Switch recording of ranges on or off for the whole process."""
    global _recording
    backend_name()
    _recording = bool(on)


def is_enabled() -> bool:
    return _recording


@contextlib.contextmanager
def recording(on: bool = True):
    """Context manager form of enable(): restores the previous state on exit."""
    previous = _recording
    enable(on)
    try:
        yield
    finally:
        enable(previous)


class _Range:
    __slots__ = ("name", "_rf")

    def __init__(self, name: str):
        self.name = name
        self._rf = None

    def __enter__(self):
        if _backend:
            _backend[0](self.name)
        self._rf = torch.profiler.record_function(self.name)
        self._rf.__enter__()
        _stack().append(self.name)
        return self

    def __exit__(self, *exc):
        _stack().pop()
        self._rf.__exit__(*exc)
        if _backend:
            _backend[1]()
        return False


def _stack() -> list:
    names = getattr(_open, "names", None)
    if names is None:
        names = _open.names = []
    return names


def current_ranges() -> tuple:
    """The ranges open on this thread, outermost first (empty while recording is off)."""
    return tuple(_stack())


_NULL = contextlib.nullcontext()


def nvtx_range(name: str):
    """A range named `name` while recording is on; a shared no-op context otherwise."""
    return _Range(name) if _recording else _NULL
