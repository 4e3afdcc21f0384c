"""A case's arguments as JSON, and how a worker turns them into Python values.

A case is a JSON object (so a failing case replays from one line):
  {"target": "glm5_ops.indexer_topk", "backend": "cpp", "seed": 7,
   "args": [...], "kwargs": {...}, "perturbed": "q" | null, "mutation": "rank" | null}
Argument values are JSON scalars, or one-key objects:
  {"tensor": {"shape": [2, 3], "dtype": "float32", "fill": "randn", "layout": "contig"}}
  {"float": "nan"|"inf"|"-inf"}  {"tuple": [...]}  {"list": [...]}  {"dtype": "bfloat16"}
Fills: randn, zeros, nan, inf, huge (randn with a quarter of the entries replaced),
randint:LO:HI (uniform ints in [LO, HI)), rows:N (each row of the last dim: distinct
picks from range(N) then -1 padding; what selection indices look like).
Layouts: contig, noncontig (every other element of the last dim), transposed (the
first two dims swapped in memory), expanded (dim 0 broadcast with stride 0).
"""
from __future__ import annotations

import math

# Names only: the case generator runs without torch (it is imported by the workers).
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8", "bool")


def tensor(shape, dtype="float32", fill="randn", layout="contig") -> dict:
    """The JSON spec of a tensor argument (the hypothesis side builds these)."""
    return {"tensor": {"shape": list(shape), "dtype": dtype, "fill": fill, "layout": layout}}


def _values(shape, dtype, fill: str, g):
    import torch
    n = math.prod(shape)
    if fill.startswith("randint:"):
        lo, hi = (int(v) for v in fill.split(":")[1:])
        return torch.randint(lo, max(hi, lo + 1), shape, generator=g, dtype=torch.int64).to(dtype)
    if fill.startswith("rows:"):
        N = int(fill.split(":")[1])
        rows = n // shape[-1] if shape and shape[-1] else 0
        out = torch.full((rows, shape[-1] if shape else 1), -1, dtype=torch.int64)
        for r in range(rows):
            pick = torch.randperm(max(N, 0), generator=g)[: shape[-1]]
            out[r, : pick.numel()] = pick
        return out.reshape(shape).to(dtype)
    x = torch.randn(shape, generator=g) if n else torch.empty(shape)
    if fill == "zeros":
        x = torch.zeros(shape)
    elif fill in ("nan", "inf", "huge"):
        special = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}[fill]
        mask = torch.rand(shape, generator=g) < 0.25
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        x = torch.where(mask, sign * special, x)
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return (x * 4).clamp(-2**31, 2**31 - 1).nan_to_num(0).to(torch.int64).to(dtype)
    return x.to(dtype)


def make_tensor(spec: dict, g, device):
    import torch
    shape, dtype, layout = list(spec["shape"]), getattr(torch, spec["dtype"]), spec.get("layout", "contig")
    x = _values(shape, dtype, spec.get("fill", "randn"), g)
    if layout == "noncontig" and shape:
        wide = torch.zeros(shape[:-1] + [2 * shape[-1]], dtype=dtype)
        wide[..., ::2] = x
        x = wide.to(device)[..., ::2]
    elif layout == "transposed" and len(shape) >= 2:
        x = x.transpose(0, 1).contiguous().to(device).transpose(0, 1)
    elif layout == "expanded" and shape:
        x = x[:1].to(device).expand(shape) if shape[0] else x.to(device)
    else:
        x = x.to(device)
    return x


def build(value, g, device):
    """A Python argument from its JSON spec (tensors drawn from g, on device)."""
    if isinstance(value, dict):
        (kind, body), = value.items()
        if kind == "tensor":
            return make_tensor(body, g, device)
        if kind == "float":
            return float(body)
        if kind == "tuple":
            return tuple(build(v, g, device) for v in body)
        if kind == "list":
            return [build(v, g, device) for v in body]
        if kind == "dtype":
            import torch
            return getattr(torch, body)
        raise ValueError(f"unknown argument spec {kind!r}")
    return value


def build_call(case: dict, device="cpu"):
    """(args, kwargs) of a case, the same every time for the same case."""
    import torch
    g = torch.Generator().manual_seed(int(case.get("seed", 0)))
    args = [build(v, g, device) for v in case.get("args", [])]
    kwargs = {k: build(v, g, device) for k, v in case.get("kwargs", {}).items()}
    return args, kwargs
