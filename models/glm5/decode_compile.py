"""How GLM5ForCausalLM.compile_decode() compiles the decode step: torch.compile's
options, and the function it compiles.

A step's fixed costs around its kernels decide batch-1 decode on a CPU (the
int8 `small` step reads ~110 MB in ~6 ms). Two of them are Dynamo's:

- Guards. Before each call Dynamo checks that the model still looks as it did
  when traced: ~4,800 guards for `small`, most on the modules (their types,
  attribute dicts, and ~270 parameters' dtypes, shapes and strides). They ran
  ~0.6 ms a step: the weights streamed through the caches in between, so each
  check misses (91 us when the same check runs hot). The compiled step drops the
  guards on module attributes (torch.compiler.skip_guard_on_all_nn_modules_unsafe)
  and keeps those on its inputs (ids, positions, the cache and its view).
  In-process A/B, each side its own graph: -0.59 ms a step, 11 of 12 blocks
  faster (bench/RESULTS.md, "Compiled decode, 2026-12-06").
- Per-op calls from Python: on the CPU the graph's wrapper is C++ (inductor's
  cpp_wrapper), see decode_compile_options.

What dropping the module guards means, and how it stays correct:
- The step is specialised to the model as it is at compile_decode(): its
  structure (quantised layers, attention mode, `record`) and the weights
  derived from kv_b_proj. After changing any of these, call compile_decode()
  again. Weights changed in place, or parameters replaced by ones of the same
  shape and dtype, are read at each step as before (the graph takes them as
  inputs; tests/test_compiled_decode.py).
- Dynamo keys its compiled graphs by code object, so each compile_decode() call
  compiles its own copy of GLM5ForCausalLM._layers' code: no other model, and
  no later compile_decode() of this one, can be handed a graph traced for
  another structure (without module guards nothing else would tell them apart).
  A replaced copy is freed with its graphs.
"""
from __future__ import annotations

import itertools
import types

import torch

_copies = itertools.count()


def decode_compile_options(options: dict, device: torch.device) -> dict:
    """torch.compile's arguments for compile_decode(): the caller's, plus the guard
    filter above, and on the CPU inductor's C++ wrapper. A decode step calls ~120
    opaque ops (gemv, int8_linear, attention, MoE); from the Python wrapper each call
    goes through OpOverload.__call__, from the C++ one straight to the dispatcher:
    0.2-0.5 ms less of a 6-7 ms int8 `small` step (24/25 and 21/25 interleaved blocks
    faster, bench/RESULTS.md "Compiled decode, 2026-12-06"), for ~3 s more compiling
    per graph. The caller's own options["cpp_wrapper"] and options["guard_filter_fn"] win."""
    defaults = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if device.type == "cpu":
        defaults["cpp_wrapper"] = True
    return {**options, "options": {**defaults, **options.get("options", {})}}


def compile_layers(model, options: dict):
    """torch.compile of a fresh copy of type(model)._layers' code, bound to `model`
    (the module docstring says why a copy)."""
    f = type(model)._layers
    name = f"_layers_compiled_{next(_copies)}"
    code = f.__code__.replace(co_name=name, co_qualname=f"{type(model).__name__}.{name}")
    copy = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
    device = model.model.embed_tokens.weight.device
    return torch.compile(types.MethodType(copy, model), **decode_compile_options(options, device))
