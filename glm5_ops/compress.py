"""Activation compression: group-wise quantisation and the saved-tensor hooks
that apply it to what autograd keeps for backward.

Layouts (glm5_ops/reference.py is the spec, bit for bit):
  x       [..., C]  fp32 | fp16 | bf16   read in C order, cut into G = numel / group_size
                                         groups of consecutive elements (group_size divides C)
  packed  [numel * bits / 8]  uint8      element n in byte n // (8/bits), bits (n % (8/bits))*bits
                                         upwards: 8-bit one code a byte, 4-bit two, 2-bit four,
                                         first element in the lowest bits
  scale   [G] fp32, zero [G] fp32        x ≈ zero[g] + q * scale[g], q in [0, 2^bits - 1]
                                         zero = group min, scale = (max - min) / (2^bits - 1)

Rounding: half to even (error <= scale/2), or stochastic: floor(v + u), u from
a counter-based hash of (seed, element index), the same in the C++, CUDA and
Triton kernels, so a seed gives one result whatever the thread count or
backend (the reference draws u with torch.rand instead).

    packed, scale, zero = quantize_groupwise(x, bits=4, group_size=128)
    y = dequantize(packed, scale, zero, 4, 128, x.shape, dtype=x.dtype)

    with compressed_activations(bits=8, params=model):   # compress what backward keeps
        loss = model(batch)
    loss.backward()

    with SavedTensorMeter() as meter:                     # bytes saved for backward, by op
        loss = model(batch)
    print(meter.table())
"""
from __future__ import annotations

import math
import operator
import weakref
from collections import defaultdict
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from . import _checks as check
from . import reference
from ._backend import _C, cpp_ops, dispatch, triton_module

BITS = (8, 4, 2)


def _check_bits_group(bits, group_size):
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    per = 8 // bits
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % per:
        raise ValueError(f"group_size must be a positive int, a multiple of {per} for {bits}-bit packing "
                         f"(every group starts on a byte), got {group_size!r}")


def _check_seed(seed) -> int:
    if seed is None:  # drawn from torch's global RNG, so torch.manual_seed makes it reproducible
        return int(torch.randint(0, 2**62, ()).item())
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63:
        raise ValueError(f"seed must be None or an int64, got {seed!r}")
    return seed


def quantize_groupwise(x: torch.Tensor, bits: int, group_size: int = 128, stochastic: bool = False,
                       seed: int | None = None):
    """(packed uint8 [numel*bits/8], scale fp32 [G], zero fp32 [G]) for floating x [..., C];
    group_size must divide C (a group never spans two rows) and be a multiple of 8/bits.
    Deterministic rounding is half to even; stochastic=True rounds up with probability
    equal to the fractional part (unbiased), drawing from `seed` (None: from torch's RNG)."""
    check.tensor(x, "x", "[..., C]")
    if x.dim() == 0:
        raise ValueError("x must have shape [..., C] (rank >= 1, groups run along the last dimension), "
                         "got a 0-d tensor")
    _check_bits_group(bits, group_size)
    if x.shape[-1] % group_size:
        raise ValueError(f"group_size must divide the last dimension of x (shape {tuple(x.shape)}), "
                         f"got {group_size}")
    seed = _check_seed(seed) if stochastic else 0
    x = x.detach().contiguous()
    return dispatch("quantize_groupwise", x.device, {
        "cpp": lambda: cpp_ops().quantize_groupwise(x, bits, group_size, bool(stochastic), seed),
        "triton": lambda: triton_module("quantize", x.device).quantize_groupwise(x, bits, group_size, stochastic, seed),
        "reference": lambda: reference.quantize_groupwise(x, bits, group_size, bool(stochastic), seed=seed),
    })


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
               shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat [shape] of `dtype` (fp32/fp16/bf16) = zero[g] + q * scale[g], computed in
    fp32 and written straight in `dtype` (no fp32 intermediate tensor)."""
    _check_bits_group(bits, group_size)
    try:   # operator.index: ints only (a str or a float is not silently converted)
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"shape must be the non-empty shape that was quantised, got {shape}")
    if shape[-1] % group_size:
        raise ValueError(f"group_size must divide the last dimension of shape {shape}, got {group_size}")
    if dtype not in check.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    numel = math.prod(shape)
    G = numel // group_size
    check.tensor(packed, "packed", f"[{numel * bits // 8}] uint8", rank=1, dtypes=(torch.uint8,))
    check.tensor(scale, "scale", f"[G={G}] fp32", rank=1, dtypes=(torch.float32,))
    check.tensor(zero, "zero", f"[G={G}] fp32", rank=1, dtypes=(torch.float32,))
    check.dim(packed, "packed", f"[{numel * bits // 8}] uint8 (shape {shape} at {bits} bits)", 0,
              numel * bits // 8, "bytes")
    check.dim(scale, "scale", f"[G={G}] fp32", 0, G, "G")
    check.dim(zero, "zero", f"[G={G}] fp32", 0, G, "G")
    device = check.same_device(packed=packed, scale=scale, zero=zero)
    packed, scale, zero = packed.contiguous(), scale.contiguous(), zero.contiguous()
    return dispatch("dequantize", device, {
        "cpp": lambda: cpp_ops().dequantize(packed, scale, zero, bits, group_size, list(shape), dtype),
        "triton": lambda: triton_module("quantize", device).dequantize(packed, scale, zero, bits, group_size, shape,
                                                                       dtype),
        "reference": lambda: reference.dequantize(packed, scale, zero, bits, group_size, shape, dtype),
    })


if _C is not None:

    @torch.library.register_fake("glm5::quantize_groupwise")
    def _quantize_groupwise_fake(x, bits, group_size, stochastic, seed):
        n = x.numel()
        return (x.new_empty((n * bits // 8,), dtype=torch.uint8), x.new_empty((n // group_size,), dtype=torch.float32),
                x.new_empty((n // group_size,), dtype=torch.float32))

    @torch.library.register_fake("glm5::dequantize")
    def _dequantize_fake(packed, scale, zero, bits, group_size, shape, dtype):
        return packed.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------
# Saved-tensor hooks
# --------------------------------------------------------------------------

class Packed:
    """A saved tensor in compressed form (what autograd holds instead of it)."""
    __slots__ = ("packed", "scale", "zero", "bits", "group_size", "shape", "dtype", "__weakref__")

    def __init__(self, packed, scale, zero, bits, group_size, shape, dtype):
        self.packed, self.scale, self.zero = packed, scale, zero
        self.bits, self.group_size, self.shape, self.dtype = bits, group_size, shape, dtype

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes

    def unpack(self) -> torch.Tensor:
        numel = math.prod(self.shape)  # groups run over the flattened tensor
        return dequantize(self.packed, self.scale, self.zero, self.bits, self.group_size, (numel,),
                          self.dtype).view(self.shape)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _param_storages(params) -> set:
    if params is None:
        return set()
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters()) + list(params.buffers())
    elif isinstance(params, torch.Tensor):
        params = [params]
    return {_storage_key(p) for p in params if p.numel() > 0}


def _is_param(t: torch.Tensor, storages: set, given: bool) -> bool:
    """Storage of a given parameter/buffer, an nn.Parameter or a view of one (W.t() saved by
    a matmul); when no parameters were given, also any leaf that requires grad."""
    if _storage_key(t) in storages:
        return True
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (not given and base.is_leaf and base.requires_grad)


class _OpNames(TorchFunctionMode):
    """Remembers the top-level torch function running now, to name saved tensors by op."""

    def __init__(self):
        super().__init__()
        self.current = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        prev, self.current = self.current, getattr(func, "__name__", str(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = prev


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward: totals, and by op (the torch
    function that saved them: linear, silu, scaled_dot_product_attention, ...;
    "(checkpoint inputs)" for what torch.utils.checkpoint keeps to recompute from).

    As a context manager it installs pass-through hooks (nothing compressed) and
    records every saved tensor; compressed_activations(meter=...) blocks nested
    inside it report into it too, so nesting both gives one account. Bytes are
    what stays allocated: a saved view keeps its whole storage, each storage (or
    compressed copy) counts once, parameters and buffers (`params`) are not
    counted. Op names come from a TorchFunctionMode, which costs Python time per
    op: meter one step, not every step.

        with SavedTensorMeter(params=model) as m:
            loss = model(x)
        m.saved_bytes, m.by_op(), print(m.table())
    """

    def __init__(self, params=None):
        self._params, self._given = _param_storages(params), params is not None
        self._names = _OpNames()
        self._hooks = None
        self.active = False
        self.reset()

    def reset(self):
        self.records = []           # (op, kind, logical bytes, stored bytes)
        self._seen = set()          # storage keys / handle ids already counted

    def op_name(self) -> str:
        return self._names.current or "(checkpoint inputs)"

    def record(self, t: torch.Tensor, kind: str, handle=None):
        logical = t.numel() * t.element_size()
        if handle is not None:
            key, stored = ("h", id(handle)), handle.nbytes
        else:
            key, stored = ("s", _storage_key(t)), t.untyped_storage().nbytes()
        if kind != "param" and key in self._seen:
            stored = 0              # already held for another save
        self._seen.add(key)
        self.records.append((self.op_name(), kind, logical, stored))

    def _pack(self, t):
        param = _is_param(t, self._params, self._given)
        self.record(t, "param" if param else "raw")
        return t

    def __enter__(self):
        self._names.__enter__()
        self.active = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.active = False
        self._names.__exit__(*exc)
        return False

    @property
    def saved_bytes(self) -> int:
        """Bytes held for backward (parameters excluded)."""
        return sum(r[3] for r in self.records if r[1] != "param")

    @property
    def logical_bytes(self) -> int:
        """Bytes the saved tensors would take uncompressed (parameters excluded)."""
        return sum(r[2] for r in self.records if r[1] != "param")

    def by_op(self) -> dict:
        out = defaultdict(lambda: dict(count=0, logical=0, stored=0, compressed=0))
        for op, kind, logical, stored in self.records:
            if kind == "param":
                continue
            e = out[op]
            e["count"] += 1
            e["logical"] += logical
            e["stored"] += stored
            e["compressed"] += kind == "compressed"
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["stored"]))

    def table(self) -> str:
        lines = ["| op | saves | compressed | logical MiB | held MiB |", "|---|---|---|---|---|"]
        for op, e in self.by_op().items():
            lines.append(f"| {op} | {e['count']} | {e['compressed']} | {e['logical'] / 2**20:.2f} | "
                         f"{e['stored'] / 2**20:.2f} |")
        lines.append(f"| total | {sum(r[1] != 'param' for r in self.records)} | | "
                     f"{self.logical_bytes / 2**20:.2f} | {self.saved_bytes / 2**20:.2f} |")
        return "\n".join(lines)


class compressed_activations(torch.autograd.graph.saved_tensors_hooks):
    """Compresses what autograd saves for backward inside this block, and
    dequantises it straight into the saved dtype when backward needs it.

    Left alone (saved as is): parameters and buffers of `params` (a module or
    tensors; compared by storage, so views such as W.t() count), any
    nn.Parameter, and, when `params` is None, any leaf that requires grad;
    non-floating tensors (indices, masks); tensors with
    fewer than `min_numel` elements or whose numel group_size does not divide;
    tensors for which skip(t) is True. A tensor saved twice (by two ops, or by
    an op and a checkpoint) is compressed once. Groups run over the flattened
    tensor; the result is contiguous.

    Composes with torch.utils.checkpoint (use_reentrant=False): the inputs a
    checkpoint keeps to recompute from pass through these hooks and are
    compressed; what the checkpointed region saves is recomputed, not stored.
    Nested blocks: the innermost one applies. `meter` (a SavedTensorMeter)
    receives an account of every save made while it is entered."""

    def __init__(self, bits: int = 8, group_size: int = 128, *, min_numel: int = 4096,
                 skip: Callable[[torch.Tensor], bool] | None = None, params=None, stochastic: bool = False,
                 meter: SavedTensorMeter | None = None):
        _check_bits_group(bits, group_size)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {min_numel!r}")
        self.bits, self.group_size, self.min_numel = bits, group_size, min_numel
        self.skip, self.stochastic, self.meter = skip, stochastic, meter
        self._params, self._given = _param_storages(params), params is not None
        self._cache = {}
        # stochastic rounding: one draw from torch's RNG per block, then a counter per tensor
        self._seed, self._count = (_check_seed(None) if stochastic else 0), 0
        super().__init__(self._pack, self._unpack)

    def _why_not(self, t: torch.Tensor) -> str | None:
        if not t.is_floating_point() or t.dtype not in check.FLOAT_DTYPES:
            return "int"
        if _is_param(t, self._params, self._given):
            return "param"
        if t.numel() < max(self.min_numel, 1) or t.numel() % self.group_size:
            return "small"
        if t.device.type not in ("cpu", "cuda") or (self.skip is not None and self.skip(t)):
            return "skip"
        return None

    def _pack(self, t: torch.Tensor):
        why = self._why_not(t)
        if why is not None:
            if self.meter is not None and self.meter.active:
                self.meter.record(t, "param" if why == "param" else "raw")
            return t
        key = (_storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        hit = self._cache.get(key)
        handle = hit[1]() if hit is not None and hit[0]() is not None else None
        if handle is None:
            self._count += 1
            packed, scale, zero = quantize_groupwise(t.detach().reshape(-1), self.bits, self.group_size,
                                                     self.stochastic, (self._seed + self._count) % 2**63)
            handle = Packed(packed, scale, zero, self.bits, self.group_size, tuple(t.shape), t.dtype)
            self._cache[key] = (weakref.ref(t), weakref.ref(handle))
        if self.meter is not None and self.meter.active:
            self.meter.record(t, "compressed", handle)
        return handle

    @staticmethod
    def _unpack(obj):
        return obj.unpack() if isinstance(obj, Packed) else obj

    def __exit__(self, *exc):
        self._cache.clear()
        return super().__exit__(*exc)
