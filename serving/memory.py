"""The KV pool's size from a memory budget ("2GiB", "512MiB", "1.5GB", or bytes)."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name: str = "kv_cache_memory") -> int:
    """An int of bytes, or a string like "2GiB" / "512MiB" / "1.5GB"."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int of bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must look like '2GiB', '512MiB', '1.5GB' or a byte count, got {value!r}")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise TypeError(f"{name} must be an int of bytes or a string like '2GiB', got {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
