"""The case generator: a hypothesis strategy over every target, and the fixed,
seeded corpus drawn from it.

A case is a valid call from ops.py / model_ops.py, then (about two cases in
three) one argument broken by a mutation: wrong rank, size, dtype or Python
type; NaN / inf / huge values; non-contiguous or stride-0 layouts;
out-of-range and negative indices; q_start beyond the keys; 0, negative and
huge ints (k, block sizes, chunk); nan/inf floats. The case records the
argument ("perturbed") so a test can check that an error names it.
"""
from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing as mp
import os
from pathlib import Path

import hypothesis

from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings
from hypothesis import strategies as st

from . import model_ops, ops
from .spec import DTYPES, tensor

HUGE_INTS = [2**31 - 1, 2**31, 2**40, 2**63 - 1]
BAD_INTS = [0, -1, -7, -2**31] + HUGE_INTS + [True, 1.5, "3", None]
BAD_FLOATS = [{"float": "nan"}, {"float": "inf"}, {"float": "-inf"}, -1.0, 0.0, 1e308, "x", None, True]
BAD_BOOLS = [2, None, "yes", 1.5]
BAD_STRS = ["bogus", "", 3, None]
MUST_RAISE = {"rank", "size", "dtype", "type", "oob", "negative", "bad_int", "bad_float", "bad_str", "bad_bool"}

# (target, weight): how often each target is drawn. Backward and model
# entry points cost more per case, so they come less often.
BACKEND_WEIGHTS = (("cpp", 12), ("reference", 7), ("triton", 1))


def _targets():
    out = [(f"glm5_ops.{n}", 3) for n in ops.PUBLIC]
    out += [(f"glm5_ops.{n}.backward", 2) for n in ops.BACKWARD]
    out += [(f"torch.ops.glm5.{n}", 2) for n in ops.RAW]
    out += [(f"model.{n}", 1) for n in model_ops.MODEL]
    return [name for name, w in out for _ in range(w)]


TARGETS = _targets()


def builder(target: str):
    kind, _, rest = target.partition(".")
    if kind == "model":
        return model_ops.MODEL[rest], False
    if target.startswith("torch.ops.glm5."):
        return ops.RAW[target[len("torch.ops.glm5."):]], True
    # ".backward": the forward call's arguments; the worker runs backward through it
    return ops.PUBLIC[rest.removesuffix(".backward")][0], False


# --------------------------------------------------------------- mutations --

def _tensor_mutation(draw, arg: ops.Arg):
    t = copy.deepcopy(arg.value["tensor"])
    options = ["rank", "dtype", "type", "layout"] + (["size"] if t["shape"] else [])
    if arg.kind == "float_t":
        options += ["values", "values"]
    elif arg.kind == "int8_t":        # int8 weights: every value is valid, -128 the one quantize_int8 never makes
        options += ["values"]
    else:
        options += ["oob", "oob", "negative"]
    how = draw(st.sampled_from(options))
    if how == "rank":
        t["shape"] = t["shape"][:-1] if t["shape"] and draw(st.booleans()) else t["shape"] + [2]
    elif how == "size":
        i = draw(st.integers(0, len(t["shape"]) - 1))
        t["shape"][i] = max(0, t["shape"][i] + draw(st.sampled_from([-1, 1, 3])))
    elif how == "dtype":
        t["dtype"] = draw(st.sampled_from([n for n in DTYPES if n != t["dtype"]]))
        if arg.kind == "float_t" and t["dtype"] in ("float16", "bfloat16", "float32", "float64"):
            how = "dtype_float"    # another float dtype: valid for some arguments
    elif how == "type":
        return how, draw(st.sampled_from([{"list": [1.0, 2.0]}, 3, "tensor", None]))
    elif how == "layout":
        t["layout"] = draw(st.sampled_from(["noncontig", "transposed", "expanded"]))
    elif how == "values" and arg.kind == "int8_t":
        t["fill"] = "randint:-128:-127"
    elif how == "values":
        t["fill"] = draw(st.sampled_from(["nan", "inf", "huge", "zeros"]))
    elif how == "oob":
        hi = arg.bound
        t["fill"] = draw(st.sampled_from([f"randint:{hi}:{hi + 5}", f"randint:{2**31 - 3}:{2**31 - 1}"]))
        if arg.value["tensor"]["dtype"] == "uint8":
            how = "values"         # every byte is a valid packed code
    else:  # negative
        t["fill"] = draw(st.sampled_from(["randint:-5:-1", f"randint:{-2**31}:{-2**31 + 3}"]))
    return how, {"tensor": t}


def _q_start_mutation(draw, arg: ops.Arg):
    B, T = arg.extra["B"], arg.extra["T"]
    options = [("beyond", tensor([B], "int64", f"randint:{T + 1}:{T + 100}")),
               ("negative", tensor([B], "int64", "randint:-9:-1")),
               ("size", tensor([B + 1], "int64", "randint:0:1")),
               ("dtype", tensor([B], "float32", "zeros")),
               ("huge", tensor([B], "int64", f"randint:{2**40}:{2**40 + 1}"))]
    if arg.kw:  # the public API also takes an int
        options += [("beyond", T + 50), ("negative", -3), ("huge", 2**62), ("type", 1.5)]
    return draw(st.sampled_from(options))


def _scalar_mutation(draw, arg: ops.Arg):
    table = {"int": ("bad_int", BAD_INTS), "float": ("bad_float", BAD_FLOATS), "bool": ("bad_bool", BAD_BOOLS),
             "str": ("bad_str", BAD_STRS),
             "none": ("type", [3, "x", {"list": [1.0, 2.0]}]),      # an optional tensor left out
             "shape": ("bad_shape", [[-1], [], [2, -3], "x", [1.5], [2**40]]),
             "dtype": ("dtype", [{"dtype": "int32"}, {"dtype": "float64"}, "float32", None])}
    how, values = table[arg.kind]
    return how, draw(st.sampled_from(values))


def mutate(draw, args: list):
    """Breaks one argument of args in place; returns (name, mutation)."""
    arg = draw(st.sampled_from(args))
    if arg.kind == "mask":
        num, idx = arg.extra["parts"]
        part = draw(st.sampled_from([num, idx, "block_size"]))
        parts = [num.value, idx.value, arg.value["tuple"][2]]
        if part == "block_size":
            how, parts[2] = "bad_int", draw(st.sampled_from(BAD_INTS))
            name = "block_size"
        else:
            how, new = _tensor_mutation(draw, part)
            parts[0 if part is num else 1] = new
            name = part.name
        arg.value = {"tuple": parts}
        return name, how
    if arg.kind in ("float_t", "index_t", "int8_t"):
        how, arg.value = _tensor_mutation(draw, arg)
    elif arg.kind == "q_start":
        how, arg.value = _q_start_mutation(draw, arg)
    else:
        how, arg.value = _scalar_mutation(draw, arg)
    return arg.name, how


# ------------------------------------------------------------------- cases --

def _dense(arg: ops.Arg) -> None:
    specs = [p.value for p in arg.extra.get("parts", ())] if arg.kind == "mask" else [arg.value]
    for spec in specs:
        if isinstance(spec, dict) and "tensor" in spec:
            spec["tensor"]["layout"] = "contig"
    if arg.kind == "mask":
        arg.value = {"tuple": [p.value for p in arg.extra["parts"]] + [arg.value["tuple"][2]]}


@st.composite
def cases(draw, targets=None):
    """One JSON case (spec.py) for a target drawn from `targets` (default: all)."""
    target = draw(st.sampled_from(targets or TARGETS))
    backend = "cpp"
    if target.startswith("glm5_ops."):
        backend = draw(st.sampled_from([b for b, w in BACKEND_WEIGHTS for _ in range(w)]))
    elif target.startswith("model."):
        backend = draw(st.sampled_from(["cpp", "cpp", "cpp", "reference"]))
    fn, raw = builder(target)
    mutating = bool(draw(st.integers(0, 2)))
    # A case to mutate starts from a plainly valid call (no empty dims, dense
    # layouts), so the error it gets is about the mutated argument.
    args = fn(draw, ops.Dims(draw, small=backend == "triton", nonzero=mutating), raw)
    perturbed = mutation = None
    extra = {}
    if mutating:
        for a in args:
            _dense(a)
        perturbed, mutation = mutate(draw, args)
        # a mismatch may be reported by its partner's name; so may a size-defining int
        if mutation in ("size", "dtype_float", "rank") or perturbed in ("block_size", "group_size", "num_experts"):
            names = [a.name for a in args] + [p.name for a in args for p in a.extra.get("parts", ())]
            extra["or_names"] = [n for n in names if n != perturbed]
    return {**extra, "target": target, "backend": backend, "seed": draw(st.integers(0, 2**31 - 1)),
            "args": [a.value for a in args if not a.kw], "kwargs": {a.name: a.value for a in args if a.kw},
            "perturbed": perturbed, "mutation": mutation}


CHUNK = 500          # cases per hypothesis run; chunks are drawn in parallel, each from its own seed
SPARE = 25
TOP_UPS = 5
CACHE_DIR = Path(__file__).resolve().parents[2] / "build" / "fuzz_corpus"


def corpus(n: int, seed: int = 0, targets=None) -> list:
    """n distinct cases drawn by hypothesis from a fixed seed: the same list
    every run (for one hypothesis version), in the order drawn. Kept under
    build/fuzz_corpus/, keyed by everything that shapes it (the generator's
    sources, hypothesis's version, n, seed, targets), since drawing takes a
    while and CI runs the corpus twice (tests, then the sanitizer job)."""
    sources = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")) if p.stem in
                       ("cases", "ops", "model_ops", "spec"))
    key = hashlib.sha256(sources + repr((hypothesis.__version__, n, seed, targets)).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"{n}-{seed}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    # each chunk draws a few spare cases: chunks may repeat one another's
    chunks = [(min(CHUNK, n - i) + SPARE, seed * 100_000 + i // CHUNK, targets) for i in range(0, n, CHUNK)]
    with mp.get_context("spawn").Pool(min(len(chunks), os.cpu_count() or 1, 4)) as pool:
        parts = pool.starmap(_draw, chunks)
    out, seen = [], set()
    for (count, _, _), part in zip(chunks, parts):
        fresh = [c for c in part if json.dumps(c, sort_keys=True) not in seen][: count - SPARE]
        seen.update(json.dumps(c, sort_keys=True) for c in fresh)
        out += fresh
    # Large corpora repeat more across chunks than SPARE covers: top up from
    # seeds no chunk uses (a corpus that needed no top-up is unchanged).
    for extra in range(TOP_UPS):
        if len(out) >= n:
            break
        part = _draw(n - len(out) + SPARE, seed * 100_000 + 90_000 + extra, targets)
        fresh = [c for c in part if json.dumps(c, sort_keys=True) not in seen][: n - len(out)]
        seen.update(json.dumps(c, sort_keys=True) for c in fresh)
        out += fresh
    if len(out) < n:
        raise RuntimeError(f"drew only {len(out)} distinct cases of {n}: the case space of "
                           f"{targets or 'all targets'} is too small for that many")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)
    return out


def _draw(n: int, seed: int, targets) -> list:
    out, seen, rounds = [], set(), 0
    while len(out) < n and rounds < 20:   # hypothesis repeats some draws: top up from derived seeds
        drawn = []

        @hyp_seed(seed * 100 + rounds)
        @settings(max_examples=n - len(out), database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases(targets))
        def collect(case):
            drawn.append(case)

        collect()
        rounds += 1
        for case in drawn:
            key = json.dumps(case, sort_keys=True)
            if key not in seen and len(out) < n:
                seen.add(key)
                out.append(case)
    return out
