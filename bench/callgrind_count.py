"""Instruction counts (valgrind callgrind) of one measured call in a checkout of
this repository: a noise-free before/after comparison where timings on a shared
host scatter by more than the change being judged.

The child runs under `valgrind --tool=callgrind --instr-atstart=no`: imports,
weight loading and warm-up run uninstrumented; the measured calls sit between
callgrind client requests (start instrumentation, zero, dump), issued through a
small C helper compiled with callgrind.h. One thread (OMP_NUM_THREADS=1), so
the count does not include spin-waits and is the same run to run.

    python bench/callgrind_count.py --checkout CHECKOUT --case topk --out runs/cg/before-topk.json
    python bench/callgrind_count.py --checkout CHECKOUT --case prefill --ckpt DIR --n 2048 --chunk 512
    python bench/callgrind_count.py --checkout CHECKOUT --case decode --ckpt DIR --n 2048

`--ckpt` is a checkpoint written by bench/model_vs_transformers.write_checkpoint
(the same directory for both sides). The JSON holds the measured instructions
in total, per shared object (self cost), and inclusive in the kernel symbols
matched by --symbol.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MARKERS_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_stop(void) { CALLGRIND_DUMP_STATS_AT("measured"); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def build_markers(directory: str) -> str:
    src, lib = os.path.join(directory, "cg_markers.c"), os.path.join(directory, "cg_markers.so")
    with open(src, "w") as f:
        f.write(MARKERS_C)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", src, "-o", lib], check=True)
    return lib


def child(case: str, markers: str, ckpt: str | None, n: int, chunk: int, reps: int) -> None:
    """Runs under valgrind, with PYTHONPATH set to the checkout."""
    import ctypes

    import torch
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    cg = ctypes.CDLL(markers)
    import glm5_ops
    if case == "topk":
        x = torch.randn(8, 262144, generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            glm5_ops.topk_indices(x, 2048)
        cg.cg_start()
        for _ in range(reps):
            glm5_ops.topk_indices(x, 2048)
        cg.cg_stop()
        return
    from models.glm5 import GLM5ForCausalLM
    model = GLM5ForCausalLM.from_pretrained(ckpt, verbose=False)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    if case == "prefill":
        warm = model.new_cache(1, 64)
        model.prefill(ids[:, :32], warm, chunk=chunk)
        cache = model.new_cache(1, n + 1)
        cg.cg_start()
        model.prefill(ids, cache, chunk=chunk)
        cg.cg_stop()
        return
    cache = model.new_cache(1, n + reps + 2)
    logits, _ = model.prefill(ids, cache, chunk=chunk)
    nxt = logits.argmax(-1)[:, None]
    nxt = model(nxt, cache)[:, -1].argmax(-1)[:, None]   # warm-up step
    cg.cg_start()
    for _ in range(reps):
        nxt = model(nxt, cache)[:, -1].argmax(-1)[:, None]
    cg.cg_stop()


def parse(path: str, symbols: list) -> dict:
    """Self cost per object and inclusive cost of functions matching `symbols`
    (regexes) from a callgrind dump with the single event Ir."""
    names, per_object, total = {}, {}, 0
    inclusive = {s: 0 for s in symbols}
    ob = fn = None
    in_call = False
    fn_matches = {}
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            m = re.match(r"^(c?ob|c?fn|c?fi|c?fl|fe)=\((\d+)\)(?: (.*))?$", line)
            if m:
                kind, ident, name = m.groups()
                base = kind.lstrip("c")
                key = ("fl" if base in ("fi", "fe") else base, ident)   # fl, fi, fe share one id space
                if name is not None:
                    names[key] = name
                if kind == "ob":
                    ob = names[key]
                elif kind == "fn":
                    fn = names[key]
                    if fn not in fn_matches:
                        fn_matches[fn] = [s for s in symbols if re.search(s, fn)]
                continue
            if line.startswith("calls="):
                in_call = True
                continue
            if not line or not (line[0].isdigit() or line[0] in "+-*"):
                continue
            cost = int(line.split()[-1])
            if in_call:   # a call's inclusive cost: counts for the caller's inclusive total only
                in_call = False
                for s in fn_matches.get(fn, ()):
                    inclusive[s] += cost
                continue
            total += cost
            per_object[ob] = per_object.get(ob, 0) + cost
            for s in fn_matches.get(fn, ()):
                inclusive[s] += cost
    top = dict(sorted(per_object.items(), key=lambda kv: -kv[1])[:8])
    return {"total_Ir": total, "self_Ir_by_object": top, "inclusive_Ir": inclusive}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", required=True, help="repository checkout whose glm5_ops/models are measured")
    ap.add_argument("--case", required=True, choices=["topk", "prefill", "decode"])
    ap.add_argument("--ckpt", help="checkpoint directory (prefill, decode)")
    ap.add_argument("--n", type=int, default=2048, help="prefill length / decode context")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--reps", type=int, default=3, help="measured topk calls / decode steps")
    ap.add_argument("--symbol", action="append", default=[],
                    help="regex of a function whose inclusive count to report (repeatable)")
    ap.add_argument("--out", required=True, help="JSON written here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.n < 1 or args.chunk < 1:
        raise ValueError(f"--reps, --n and --chunk must be >= 1, got {args.reps}, {args.n}, {args.chunk}")
    if args.child:
        child(args.case, args.child, args.ckpt, args.n, args.chunk, args.reps)
        return 0
    if args.case != "topk" and not (args.ckpt and os.path.isdir(args.ckpt)):
        raise ValueError(f"--ckpt must be an existing checkpoint directory for case {args.case}, got {args.ckpt!r}")
    ckpt = os.path.abspath(args.ckpt) if args.ckpt else None   # the child runs in the checkout
    checkout = os.path.abspath(args.checkout)
    if not os.path.isdir(os.path.join(checkout, "glm5_ops")):
        raise ValueError(f"--checkout must be a repository checkout (no glm5_ops/ in {checkout})")
    with tempfile.TemporaryDirectory() as tmp:
        markers = build_markers(tmp)
        dump = os.path.join(tmp, "callgrind.out")
        env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dump}.%p",
               sys.executable, os.path.abspath(__file__), "--checkout", checkout, "--case", args.case,
               "--n", str(args.n), "--chunk", str(args.chunk), "--reps", str(args.reps),
               "--out", args.out, "--child", markers] + (["--ckpt", ckpt] if ckpt else [])
        subprocess.run(cmd, cwd=checkout, env=env, check=True)
        dumps = sorted(f for f in os.listdir(tmp) if f.startswith("callgrind.out"))
        measured = [os.path.join(tmp, d) for d in dumps if re.fullmatch(r"callgrind\.out\.\d+\.1", d)]
        if len(measured) != 1:
            raise RuntimeError(f"expected one 'measured' dump (callgrind.out.<pid>.1), found {dumps}")
        result = {"checkout": checkout, "case": args.case, "n": args.n, "chunk": args.chunk, "reps": args.reps,
                  **parse(measured[0], args.symbol)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
