#!/usr/bin/env python3
"""Compiles every Triton kernel specialisation the tests launch for a Hopper GPU
(sm_90), on a machine without one: the pre-flight check before a device run.

The interpreter (TRITON_INTERPRET=1, how the suite runs Triton on the CPU) does
not type-check a kernel, so code it runs can still fail to compile: the first
device run (2026-12-06) found two such kernels (an int8 tl.dot without
out_dtype under Triton 3.6, and a loop-carried name whose shape changed in a
branch). Two steps, two processes:

    python bench/triton_compile_check.py record launches.jsonl [pytest args]
    python bench/triton_compile_check.py compile launches.jsonl

`record` runs pytest (default: the Triton tests) under the interpreter with the
GPU's tile choices (glm5_ops.triton's `_interpreted` answers False) and writes
each distinct launch: kernel, argument dtypes and integer values, constexprs
and launch options. `compile` imports the kernels compiled (no interpreter),
points Triton at an sm_90 target, and compiles each recorded launch (fp16 ones
once more in bf16, which the interpreter cannot run) with ptxas from Triton's
wheel; no kernel runs. It exits 1 when any launch fails to compile. Run it with
the Triton the GPU machine has (3.6 there: `pip install --target DIR
triton==3.6.0`, then PYTHONPATH=DIR) and with this machine's.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every file with Triton tests: about 5 minutes here (2026-12-06: 64 s and 239 s in two halves)
DEFAULT_TESTS = ["tests/test_opcheck.py", "tests/test_triton_attention.py", "tests/test_triton_indexer.py",
                 "tests/test_triton_moe.py", "tests/test_triton_quantize.py", "tests/test_int8.py",
                 "tests/test_device_attention.py", "tests/test_moe_fused.py", "tests/test_topk.py",
                 "tests/test_compress.py", "-k", "triton"]
# The modules whose tile choices ask `_interpreted` (defined in moe, imported by int8)
TILE_MODULES = ("glm5_ops.triton.moe", "glm5_ops.triton.int8")
HOPPER = ("cuda", 90, 32)


def _spec(v):
    """A JSON description of one kernel argument (tensors by dtype only)."""
    import torch
    import triton.language as tl
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, tl.dtype):
        return {"tl_dtype": v.name}
    if isinstance(v, tl.constexpr):
        return _spec(v.value)
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"value": v}
    raise TypeError(f"cannot record a kernel argument of type {type(v).__name__}")


def _constexpr_params(fn) -> set:
    """Positions of fn's tl.constexpr parameters (their values are compiled in)."""
    import inspect
    params = inspect.signature(fn).parameters.values()
    return {i for i, p in enumerate(params) if "constexpr" in str(p.annotation)}


def _specialised(spec: dict) -> dict:
    """What Triton compiles a runtime scalar as: an int by its type (i32 or i64),
    whether it is 1 and whether 16 divides it; a float by nothing but its type.
    One representative per class keeps the launches to compile few."""
    v = spec.get("value")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return spec
    if isinstance(v, float):
        return {"value": 1.5}
    base = 2 ** 32 if not -2 ** 31 <= v < 2 ** 31 else 0
    return {"value": 1 if v == 1 else base + (16 if v % 16 == 0 else 17)}


def record(path: str, pytest_args: list) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)
    import pytest
    import triton.runtime.interpreter as interp
    launches, run = {}, interp.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        constexpr = _constexpr_params(fn)
        entry = {"module": fn.__module__, "name": fn.__name__,
                 "args": [_spec(a) if i in constexpr else _specialised(_spec(a)) for i, a in enumerate(args)],
                 "kwargs": {k: _spec(v) for k, v in sorted(kwargs.items())}}
        key = json.dumps(entry, sort_keys=True)
        if key not in launches:
            launches[key] = entry
            out.write(key + "\n")
            out.flush()
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    out = open(path, "w")   # JSON lines, written as they come: an interrupted run keeps what it saw

    interp.InterpretedFunction.run = recording_run
    for name in TILE_MODULES:   # the tiles a GPU would get, not the interpreter's small ones
        importlib.import_module(name)._interpreted = lambda t: False
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", *pytest_args])
    out.close()
    print(f"recorded {len(launches)} distinct launches of "
          f"{len({(e['module'], e['name']) for e in launches.values()})} kernels into {path} (pytest exit {rc})")
    return 0


class _HopperDriver:
    """Just enough of a Triton driver for JITFunction.run(warmup=True): an sm_90
    target, no device behind it."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget(*HOPPER)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


def _value(spec, dtype_map):
    import torch
    import triton.language as tl
    if "tensor" in spec:
        dtype = dtype_map.get(spec["tensor"], spec["tensor"])
        return torch.empty(64, dtype=getattr(torch, dtype))   # 16-byte aligned, as a GPU allocation is
    if "tl_dtype" in spec:
        return getattr(tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(
            spec["tl_dtype"], spec["tl_dtype"]))
    return spec["value"]


def compile_all(path: str) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("triton_compile_check compile: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")
    sys.path.insert(0, ROOT)
    import triton
    from triton.runtime import driver
    driver.set_active(_HopperDriver())
    with open(path) as f:
        launches = [json.loads(line) for line in f if line.strip()]
    jobs = []
    for e in launches:
        jobs.append((e, {}))
        if any(a.get("tensor") == "float16" for a in e["args"]):
            jobs.append((e, {"float16": "bfloat16"}))
    print(f"triton {triton.__version__}: compiling {len(jobs)} launches for sm_{HOPPER[1]} "
          f"({len(launches)} recorded, fp16 ones once more in bf16)", flush=True)
    failures, t0 = [], time.time()
    for i, (e, dtype_map) in enumerate(jobs):
        fn = getattr(importlib.import_module(e["module"]), e["name"])
        args = [_value(a, dtype_map) for a in e["args"]]
        kwargs = {k: _value(v, dtype_map) for k, v in e["kwargs"].items()}
        label = f"{e['name']}{' bf16' if dtype_map else ''} " + ",".join(
            f"{k}={v['value'] if 'value' in v else v}" for k, v in e["kwargs"].items())
        try:
            fn.run(*args, grid=(1, 1, 1), warmup=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure is listed, the first line of each
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            where = traceback.extract_tb(cause.__traceback__)[-1] if cause.__traceback__ else None
            failures.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                            f"<- {type(cause).__name__}: {str(cause)[:300]}"
                            + (f" ({os.path.basename(where.filename)}:{where.lineno}: {where.line})" if where else ""))
            print("FAIL", failures[-1], flush=True)
        if (i + 1) % 25 == 0:
            print(f"  {i + 1}/{len(jobs)} in {time.time() - t0:.0f}s", flush=True)
    print(f"{len(jobs) - len(failures)} of {len(jobs)} launches compiled for sm_{HOPPER[1]} with triton "
          f"{triton.__version__} in {time.time() - t0:.0f}s; {len(failures)} failed")
    return 1 if failures else 0


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "compile"):
        sys.exit(__doc__)
    if sys.argv[1] == "record":
        return record(sys.argv[2], sys.argv[3:] or DEFAULT_TESTS)
    return compile_all(sys.argv[2])


if __name__ == "__main__":
    sys.exit(main())
