#!/usr/bin/env python3
"""The prepared GPU check-and-time run (one H200 window): every CUDA and Triton
path against glm5_ops.reference, then the key benchmarks. Under 8 minutes.

    PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py 2>&1 | tee $OUT/suite.log
    python3 bench/gpu_suite.py --device cpu --quick      # dry run on the CPU kernels

Flow:
1. Build, IN THE BACKGROUND: if glm5_ops._C is missing or was built without
   CUDA, builds the extension (python setup.py build_ext --build-lib
   build/gpu_suite_lib, MAX_JOBS = cores, TORCH_CUDA_ARCH_LIST=9.0a) and renames
   it into glm5_ops/ once complete (pip install --no-build-isolation --no-deps
   -e . if that fails). The sections that need it (every cpp one, Triton's
   quantize) wait for it; the others start at once, niced while it runs.
2. Checks, CONCURRENTLY: one child process per (family, backend[, dtype]),
   at most --jobs at a time (default min(12, cores - 2): 12 on the device's
   16 cores; 2 on a CPU dry run), longest first, each with its own CUDA
   context, time limit (--section-s, 240 s) and JSON file. Families: topk,
   indexer (scores, fused top-k), attention-sparse, attention-block (block-
   sparse forward/backward), attention-mask (block_topk_mask), moe-route (router,
   dispatch + combine), moe-fused (fused experts forward/backward), quantize
   (quantize_groupwise / dequantize, deterministic and stochastic); the big
   families get one section per dtype (fp32 / bf16 / fp16). Triton JIT-compiles
   ~200 kernels on a cold cache (0.2-10 s of one core each), which is why the
   sections run in parallel. Meanwhile one "warm:" child per Triton timing
   section calls each timed Triton op once (compiling it, timing nothing), so the
   timing phase finds its kernels cached. No section starts after the phase's
   --check-phase-s (330 s) and none runs past it. Each check compares with the
   oracle on fresh random inputs (seed logged), NaN-poisoned outputs; each is its
   own try/except.
3. Timings, ONE SECTION AT A TIME (the GPU to itself): CUDA events after an L2
   flush (zero a 256 MB buffer before every call), median of several calls.
   "timings": top-k vs torch.topk; indexer_topk / indexer_scores vs the unfused
   torch chain (plus a correctness check at the bench shape); quantize_groupwise
   and dequantize of a bf16 [16384, 6144] activation vs the measured copy
   bandwidth; DSA sparse attention in GLM-5's MLA shape (target 300 TFLOP/s)
   and block-sparse per computed block vs dense SDPA (target >= 60%).
   "moe-timings": fused_moe forward at GLM-5 scale vs the measured bf16 matmul
   peak (target 50%), dispatch + combine share (target <= 10%).
4. A markdown summary: checks passed per backend, one line per distinct
   failure, a table of sections (checks, seconds, how it ended) and the timings
   table; all results as JSON in --json (default $OUT/gpu_suite.json).

Output: the parent's own lines and every child line as it comes, stamped with
the suite's clock and prefixed with its section, e.g.
    [ 41.3s] attention-sparse[float32]/triton | PASS attention.sparse_fwd/triton: ...
A crash, a sticky CUDA error or a hang costs its section only (the child's
checks up to then are kept: it rewrites its JSON after every record).

Expected wall time on the device (H200, 16 cores, bare: no extension, cold
Triton cache), about 4-5 minutes, --quick about 3.5:
- build ~1.5 min, in the background: 15 files compile in parallel, so the
  slowest bounds it (topk.cu 59 s, the other .cu 39-48 s, the .cpp 20-29 s,
  each on one core here); the niced Triton sections take the idle cores;
- checks ~2 min in all, build included: the cpp sections (a few seconds to
  ~20 s each) start once it is done; Triton compiles ~400 core-seconds of
  kernels (measured here for sm_90 with triton 3.6, cold cache, no launch:
  attention-sparse fp32 48 s for its 16 kernels, bf16 23 s; block 41 s,
  MoE 85 s, indexer + top-k 120 s, block_topk_mask 5 s for every dtype),
  spread over 12 processes, the longest section about a minute;
- timings ~1.5-2.5 min: four sections of tens of timed calls each (most are
  microseconds to milliseconds: one second each at most), whose Triton
  kernels were compiled during the checks.
Assumes the device's cores are about as fast as this 2-core machine's
(Xeon); the check phase stops starting sections at 330 s and the section
limits (240 s checks, 200/180 s timings) bound a hang.

Options: --quick (fewer cases and shapes), --skip-build, --skip-checks,
--skip-timings, --backends cpp,triton, --only NAME[,NAME] (substrings of check
or timing names: runs only those, and only the sections they can come from, e.g.
--only attention,indexer,topk or --only moe), --device cpu (the checks on the
CPU kernels, Triton through its interpreter; no timings), --jobs N.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
T0 = time.time()


CHILD = os.environ.get("GLM5_SUITE_CHILD") == "1"   # a section's process: the parent stamps and tags its lines


def log(msg: str) -> None:
    print(msg if CHILD else f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- build

def cuda_build_present() -> bool:
    code = "import glm5_ops._C as c, sys; sys.exit(0 if getattr(c, 'WITH_CUDA', 0) else 3)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True).returncode == 0


class Build:
    """Builds glm5_ops._C with CUDA in a background thread, while the Triton check
    sections (which do not need it) run. The extension is built outside the
    package (build_ext --build-lib build/gpu_suite_lib) and renamed into
    glm5_ops/ when complete, so a section importing glm5_ops meanwhile sees
    either no extension or the whole new one, never a half-written file."""

    def __init__(self):
        self.done = threading.Event()
        self.ok = False

    def start(self) -> "Build":
        if cuda_build_present():
            log("glm5_ops._C already has CUDA kernels")
            self.ok = True
            self.done.set()
        else:
            threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self.ok = self._build()
        except Exception as e:  # noqa: BLE001 - reported; the sections that need it are skipped
            log(f"build failed: {type(e).__name__}: {e}")
        finally:
            self.done.set()

    @staticmethod
    def _build() -> bool:
        import glob
        env = dict(os.environ)
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
        env["GLM5_BUILD_CUDA"] = "1"
        if "CUDA_HOME" not in env:
            for cand in ("/usr/local/cuda", "/usr/local/cuda-13.0"):
                if os.path.exists(os.path.join(cand, "bin", "nvcc")):
                    env["CUDA_HOME"] = cand
                    break
        log(f"building glm5_ops._C with CUDA in the background (CUDA_HOME={env.get('CUDA_HOME')}, "
            f"MAX_JOBS={env['MAX_JOBS']}) ...")
        t = time.time()
        lib = os.path.join(ROOT, "build", "gpu_suite_lib")
        r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", lib], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        built = glob.glob(os.path.join(lib, "glm5_ops", "_C*.so"))
        if r.returncode == 0 and built:
            os.replace(built[0], os.path.join(ROOT, "glm5_ops", os.path.basename(built[0])))   # atomic
        else:
            print(r.stdout[-6000:], r.stderr[-6000:], sep="\n", flush=True)
            log("build_ext failed; trying pip install --no-build-isolation --no-deps -e .")
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."],
                               cwd=ROOT, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout[-6000:], r.stderr[-6000:], sep="\n", flush=True)
                log(f"build failed after {time.time() - t:.0f}s: the sections that need glm5_ops._C are skipped")
                return False
        warn = [ln for ln in (r.stdout + r.stderr).splitlines() if "warning" in ln.lower()]
        log(f"built in {time.time() - t:.0f}s ({len(warn)} warning lines)")
        for ln in warn[:10]:
            print("   ", ln[:300], flush=True)
        if not cuda_build_present():
            log("the built glm5_ops._C does not load with CUDA kernels: the sections that need it are skipped")
            return False
        return True


# --------------------------------------------------------------------------- checks

RESULTS: dict = {"checks": [], "timings": []}
ONLY: list = []  # --only: run just the checks / timings whose name contains one of these
JSON_OUT: list = []  # a child's --json path: results are rewritten there after every record
WARM: list = []  # a prewarm child: run each timed call of its backends once (JIT compile), record nothing


def wanted(name: str) -> bool:
    return not ONLY or any(o in name for o in ONLY)


def save_json() -> None:
    """Child: rewrite the results file (atomically), so that a section killed at
    its time limit still reports every check it finished."""
    if JSON_OUT:
        tmp = JSON_OUT[0] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(RESULTS, f)
        os.replace(tmp, JSON_OUT[0])


def record_check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"].append({"name": name, "ok": ok, "detail": detail})
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    save_json()


def run_check(name: str, fn) -> None:
    if not wanted(name) or WARM:
        return
    try:
        ok, detail = fn()
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the suite
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if not isinstance(e, (NotImplementedError, ImportError, ModuleNotFoundError)):
            traceback.print_exc(limit=3)
    record_check(name, ok, detail)


def topk_ok(torch, scores, idx, k, sorted_):
    """Exact check: same multiset of values as the reference, -1 padding last."""
    from glm5_ops import reference
    ref = reference.topk_indices(scores, k, sorted=True)
    if idx.dtype != torch.int32 or tuple(idx.shape) != tuple(ref.shape):
        return False, f"got {idx.dtype} {tuple(idx.shape)}, want int32 {tuple(ref.shape)}"
    s = scores.float().reshape(-1, scores.shape[-1])
    i = idx.reshape(-1, k).long()
    r = ref.reshape(-1, k).long()
    valid, rvalid = i >= 0, r >= 0
    if not torch.equal(valid.sum(-1), rvalid.sum(-1)):
        bad = (valid.sum(-1) != rvalid.sum(-1)).nonzero()[:3].flatten().tolist()
        return False, f"number of selected entries differs (rows {bad})"
    n = valid.sum(-1, keepdim=True)
    pos = torch.arange(k, device=i.device)[None, :]
    if not torch.equal(valid, pos < n):
        return False, "-1 slots are not last"
    if (i >= s.shape[-1]).any():
        return False, "index out of range"
    # uniqueness: sort indices per row, neighbours must differ among the valid ones
    si = torch.where(valid, i, torch.full_like(i, -1 - s.shape[-1])).sort(-1).values
    dup = (si[:, 1:] == si[:, :-1]) & (si[:, 1:] >= 0)
    if dup.any():
        return False, "duplicate indices"
    v = torch.where(valid, s.gather(-1, i.clamp_min(0)), torch.full_like(s[:, :k], -math.inf))
    rv = torch.where(rvalid, s.gather(-1, r.clamp_min(0)), torch.full_like(s[:, :k], -math.inf))
    if torch.isnan(v).any():
        return False, "a NaN was selected"
    vs = v.sort(-1, descending=True).values
    if not torch.equal(vs, rv):
        row = (vs != rv).any(-1).nonzero()[0].item()
        return False, f"selected values differ from the reference (row {row})"
    if sorted_ and not torch.equal(v, vs):
        return False, "sorted=True but slots are not in descending order"
    return True, f"{tuple(scores.shape)} k={k}"


def scores_ok(torch, out, ref, tol):
    if out.dtype != torch.float32 or out.shape != ref.shape:
        return False, f"got {out.dtype} {tuple(out.shape)}, want float32 {tuple(ref.shape)}"
    ninf, rninf = torch.isneginf(out), torch.isneginf(ref)
    if not torch.equal(ninf, rninf):
        return False, f"-inf pattern differs ({(ninf != rninf).sum().item()} entries)"
    fin = ~rninf
    if torch.isnan(out[fin]).any() or torch.isinf(out[fin]).any():
        return False, "non-finite values where the reference is finite"
    a, b = out[fin].double(), ref[fin].double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0
    return err <= tol, f"rel err {err:.2e} (tol {tol:.0e})"


def indexer_topk_ok(torch, idx, q, w, k, topk, causal, q_start):
    """Values at the chosen indices (on the reference scores) match the reference's
    top-k values up to rounding; same number of -1 slots, last."""
    from glm5_ops import reference
    ref_s = reference.indexer_scores(q, w, k, causal=causal, q_start=q_start)
    ref = reference.topk_indices(ref_s, topk, sorted=True)
    if idx.dtype != torch.int32 or tuple(idx.shape) != tuple(ref.shape):
        return False, f"got {idx.dtype} {tuple(idx.shape)}, want int32 {tuple(ref.shape)}"
    T = ref_s.shape[-1]
    s = ref_s.reshape(-1, T)
    i = idx.reshape(-1, topk).long()
    r = ref.reshape(-1, topk).long()
    valid, rvalid = i >= 0, r >= 0
    if not torch.equal(valid.sum(-1), rvalid.sum(-1)):
        return False, "number of selected entries differs"
    pos = torch.arange(topk, device=i.device)[None, :]
    if not torch.equal(valid, pos < valid.sum(-1, keepdim=True)):
        return False, "-1 slots are not last"
    si = torch.where(valid, i, torch.full_like(i, -1 - T)).sort(-1).values
    if ((si[:, 1:] == si[:, :-1]) & (si[:, 1:] >= 0)).any():
        return False, "duplicate indices"
    v = s.gather(-1, i.clamp(0, T - 1))
    if (torch.isneginf(v) & valid).any():
        return False, "a masked (-inf) key was selected"
    # -1 slots are last in both and equally many per row: sort the chosen values
    # with the padding at the end and compare the valid prefix only
    v = torch.where(valid, v, torch.full_like(v, -math.inf)).sort(-1, descending=True).values
    rv = s.gather(-1, r.clamp_min(0))
    zero = torch.zeros_like(v)
    vs = torch.where(rvalid, v, zero)
    rv = torch.where(rvalid, rv, zero)
    scale = s[torch.isfinite(s)].abs().max().item() if torch.isfinite(s).any() else 1.0
    diff = (vs - rv).abs().max().item()
    tol = 2e-3 * scale
    return diff <= tol, f"{tuple(q.shape)} T={T} topk={topk}: max |value diff| {diff:.2e} (tol {tol:.1e})"


def _generator(torch, dev):
    """A generator with a fresh seed, logged so that a failure can be rerun."""
    seed = int(time.time() * 1000) & 0xFFFFFF
    log(f"random seed {seed}")
    return torch.Generator(device=dev).manual_seed(seed)


def _interpreted(backend, dev) -> bool:
    """Triton kernels on CPU tensors run in Triton's interpreter, which has no bf16 math."""
    return backend == "triton" and dev == "cpu"


def topk_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    g = _generator(torch, dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    # ---- topk_indices cases: (name, builder, k, sorted)
    def plain(rows, T, dtype):
        return lambda: randn(rows, T, dtype=dtype)

    def specials(rows, T):
        def build():
            x = randn(rows, T)
            m = torch.rand(rows, T, device=dev, generator=g)
            x[m < 0.05] = float("nan")
            x[(m >= 0.05) & (m < 0.10)] = -math.inf
            x[(m >= 0.10) & (m < 0.11)] = math.inf
            return x
        return build

    def mostly_masked(rows, T, keep):
        def build():
            x = torch.full((rows, T), -math.inf, device=dev)
            x[:, :keep] = randn(rows, keep)
            x[0, :] = float("nan")  # a row with nothing selectable
            return x
        return build

    def ties(rows, T, levels):
        return lambda: torch.randint(0, levels, (rows, T), device=dev, generator=g).float()

    def one_bin(rows, T):  # > 4096 entries in one coarse (fp16) bin: the global-memory refine path
        return lambda: 1.0 + randn(rows, T) * 1e-4

    cases = [
        ("fp32 [1,131072] k=2048", plain(1, 131072, torch.float32), 2048, False),
        ("fp32 [64,32768] k=2048", plain(64, 32768, torch.float32), 2048, False),
        ("bf16 [8,32768] k=2048 sorted", plain(8, 32768, torch.bfloat16), 2048, True),
        ("fp16 [4,10000] k=300 sorted", plain(4, 10000, torch.float16), 300, True),
        ("fp32 [3,1000] k=17", plain(3, 1000, torch.float32), 17, False),
        ("fp32 [2,3,777] k=777 (k=T)", lambda: randn(2, 3, 777), 777, True),
        ("fp32 [5,1] k=1", plain(5, 1, torch.float32), 1, False),
        ("fp32 [4,4099] odd T k=1000", plain(4, 4099, torch.float32), 1000, False),
        ("fp32 NaN/-inf/+inf [16,20000] k=2048", specials(16, 20000), 2048, True),
        ("fp32 mostly -inf [4,9000] k=512 (-1 fill)", mostly_masked(4, 9000, 300), 512, True),
        ("fp32 heavy ties [8,50000] k=2048", ties(8, 50000, 7), 2048, False),
        ("fp32 one fp16 bin [2,300000] k=1000 (overflow path)", one_bin(2, 300000), 1000, True),
        ("fp32 [2,70000] k=5000 sorted (host sort path)", plain(2, 70000, torch.float32), 5000, True),
        ("bf16 heavy ties [4,16384] k=4096 sorted", lambda: randn(4, 16384).round().to(torch.bfloat16), 4096, True),
    ]
    if quick:
        cases = cases[:2] + cases[8:12]
    for backend in backends:
        for name, build, k, srt in cases:
            if _interpreted(backend, dev) and "bf16" in name:
                continue
            def one(build=build, k=k, srt=srt, backend=backend):
                x = build()
                with glm5_ops.use_backend(backend):
                    idx = glm5_ops.topk_indices(x, k, sorted=srt)
                sync()
                return topk_ok(torch, x, idx, k, srt)
            run_check(f"topk_indices/{backend}: {name}", one)


def indexer_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    g = _generator(torch, dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    # ---- indexer_scores / indexer_topk cases: (B, S, H, D, T, causal, q_start, topk)
    icases = [
        (2, 37, 32, 128, 300, True, None, 64),
        (1, 5, 3, 20, 77, True, None, 10),             # odd H and D (D % 8 != 0)
        (1, 3, 160, 64, 129, True, None, 16),          # H > 128: several M tiles
        (1, 4, 8, 576, 200, False, None, 50),          # D = 576, not causal
        (2, 33, 8, 40, 513, True, "tensor", 100),      # q_start per batch element; short horizons -> -1
        (1, 64, 32, 128, 2048, True, None, 2048),      # topk = T for the last queries
        (3, 17, 64, 128, 1000, True, "int", 128),
    ]
    if quick:
        icases = icases[:3] + icases[4:5]
    for backend in backends:
        for dtype in _dtypes(torch, dtypes):
            for (B, S, H, D, T, causal, qsk, topk) in icases:
                tag = f"{str(dtype).replace('torch.', '')} B={B} S={S} H={H} D={D} T={T} causal={causal} q_start={qsk}"

                def make(B=B, S=S, H=H, D=D, T=T, qsk=qsk, dtype=dtype):
                    q = randn(B, S, H, D, dtype=dtype) * D ** -0.5
                    w = randn(B, S, H) * H ** -0.5
                    k = randn(B, T, D, dtype=dtype)
                    qs = None
                    if qsk == "tensor":
                        qs = torch.tensor([0, T - S - 20][:B] + [T - S] * max(0, B - 2), device=dev)
                    elif qsk == "int":
                        qs = T // 2
                    return q, w, k, qs

                def one_scores(make=make, causal=causal, backend=backend, dtype=dtype):
                    from glm5_ops import reference
                    q, w, k, qs = make()
                    with glm5_ops.use_backend(backend):
                        out = glm5_ops.indexer_scores(q, w, k, causal=causal, q_start=qs)
                    sync()
                    ref = reference.indexer_scores(q, w, k, causal=causal, q_start=qs)
                    return scores_ok(torch, out, ref, 2e-3 if dtype == torch.float32 else 1e-2)

                def one_topk(make=make, causal=causal, topk=topk, backend=backend):
                    q, w, k, qs = make()
                    with glm5_ops.use_backend(backend):
                        idx = glm5_ops.indexer_topk(q, w, k, topk, causal=causal, q_start=qs)
                    sync()
                    return indexer_topk_ok(torch, idx, q, w, k, topk, causal, qs)

                run_check(f"indexer_scores/{backend}: {tag}", one_scores)
                run_check(f"indexer_topk/{backend}: {tag} topk={topk}", one_topk)


# --------------------------------------------------------------------------- timing

class Timer:
    def __init__(self, torch):
        self.torch = torch
        self.flush_buf = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")

    def __call__(self, fn, reps=None, budget_s=1.0):
        """Median ms of fn() over reps calls, each after an L2 flush."""
        torch = self.torch
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t = time.time()
        fn()
        torch.cuda.synchronize()
        one = max(time.time() - t, 1e-5)
        if reps is None:
            reps = int(min(50, max(3, budget_s / one)))
        times = []
        for _ in range(reps):
            self.flush_buf.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        times.sort()
        return times[len(times) // 2]


def record_time(group, impl, ms, flops=None, nbytes=None, base_ms=None, note=""):
    row = {"group": group, "impl": impl, "ms": ms,
           "tflops": (flops / ms / 1e9) if (flops and ms) else None,
           "gbs": (nbytes / ms / 1e6) if (nbytes and ms) else None,
           "speedup": (base_ms / ms) if (base_ms and ms) else None, "note": note}
    RESULTS["timings"].append(row)
    save_json()
    extra = []
    if row["tflops"]:
        extra.append(f"{row['tflops']:.1f} TFLOP/s")
    if row["gbs"]:
        extra.append(f"{row['gbs']:.0f} GB/s")
    if row["speedup"]:
        extra.append(f"x{row['speedup']:.2f} vs baseline")
    log(f"TIME {group} | {impl}: {ms:.4f} ms " + " ".join(extra) + (f" ({note})" if note else ""))


def timed(timer, group, impl, fn, **kw):
    if not wanted(f"{group} | {impl}"):
        return None
    if WARM:   # prewarm: compile the backends' kernels for this call, skip the baselines
        if any(impl.startswith(be) for be in WARM):
            t = time.time()
            try:
                fn()
                timer.torch.cuda.synchronize()
                log(f"warm {group} | {impl}: {time.time() - t:.1f}s")
            except Exception as e:  # noqa: BLE001 - the timing section reports it
                log(f"warm {group} | {impl}: {type(e).__name__}: {str(e)[:200]}")
        return None
    try:
        ms = timer(fn)
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        RESULTS["timings"].append({"group": group, "impl": impl, "ms": None, "note": msg})
        log(f"TIME {group} | {impl}: failed ({msg})")
        return None
    record_time(group, impl, ms, **kw)
    return ms


def unfused_chain(torch, q, w, k, topk, causal):
    """einsum -> relu -> weighted head sum -> causal mask -> torch.topk (the way
    a plain PyTorch implementation does it, materialising [B,S,H,T])."""
    logits = torch.einsum("bshd,btd->bsht", q, k)
    logits.relu_()
    scores = torch.einsum("bsht,bsh->bst", logits, w.to(logits.dtype)).float()
    del logits
    if causal:
        B, S, T = scores.shape
        pos = (T - S) + torch.arange(S, device=q.device)
        scores.masked_fill_(torch.arange(T, device=q.device)[None, None, :] > pos[None, :, None], -math.inf)
    return torch.topk(scores, topk, dim=-1, sorted=False).indices


def timings(torch, glm5_ops, backends, quick):
    timer = Timer(torch)
    dev = "cuda"

    for rows, T, k in ([(1, 131072, 2048), (64, 32768, 2048)] + ([] if quick else [(128, 8192, 2048), (8, 262144, 2048)])):
        x = torch.randn(rows, T, device=dev)
        group = f"topk fp32 [{rows},{T}] k={k}"
        nbytes = rows * T * 4
        base = timed(timer, group, "torch.topk(sorted=False)", lambda: torch.topk(x, k, dim=-1, sorted=False),
                     nbytes=nbytes)
        for be in backends:
            def f(be=be):
                with glm5_ops.use_backend(be):
                    return glm5_ops.topk_indices(x, k)
            timed(timer, group, be, f, nbytes=nbytes, base_ms=base)
        if not quick:
            def fs(be="cpp"):
                with glm5_ops.use_backend(be):
                    return glm5_ops.topk_indices(x, k, sorted=True)
            timed(timer, group, "cpp sorted=True", fs, nbytes=nbytes, base_ms=base)

    shapes = [(1, 1024, 16384, 32, 128, 2048)]
    if not quick:
        shapes += [(1, 4096, 65536, 32, 128, 2048), (8, 1, 65536, 32, 128, 2048)]
    for (B, S, T, H, D, topk) in shapes:
        q = (torch.randn(B, S, H, D, device=dev) * D ** -0.5).bfloat16()
        w = torch.randn(B, S, H, device=dev) * H ** -0.5
        k = torch.randn(B, T, D, device=dev).bfloat16()
        flops = 2.0 * B * S * T * H * D
        group = f"indexer bf16 B={B} S={S} T={T} H={H} D={D} topk={topk} causal"
        nbytes = (q.numel() + k.numel()) * 2 + w.numel() * 4 + B * S * topk * 4
        big = B * S * H * T * 2 > 40e9
        base = None
        if not big:
            base = timed(timer, group, "unfused chain (torch)", lambda: unfused_chain(torch, q, w, k, topk, True),
                         flops=flops)
        for be in backends:
            def f(be=be):
                with glm5_ops.use_backend(be):
                    return glm5_ops.indexer_topk(q, w, k, topk)
            timed(timer, group, f"{be} indexer_topk", f, flops=flops, nbytes=nbytes, base_ms=base)
            if B * S * T * 4 <= 2e9:
                def g(be=be):
                    with glm5_ops.use_backend(be):
                        return glm5_ops.indexer_scores(q, w, k)
                timed(timer, group, f"{be} indexer_scores", g, flops=flops, nbytes=nbytes + B * S * T * 4)
        # one correctness check at the benchmark size (exercises the workspace groups)
        if not quick or S * T <= 2 ** 24:
            for be in backends:
                def chk(be=be):
                    with glm5_ops.use_backend(be):
                        idx = glm5_ops.indexer_topk(q, w, k, topk)
                    torch.cuda.synchronize()
                    return indexer_topk_ok(torch, idx, q, w, k, topk, True, None)
                run_check(f"indexer_topk/{be}: bench shape B={B} S={S} T={T}", chk)
                if B * S * T * 4 <= 2e9:
                    def det(be=be):  # no atomics in the scores path: two runs must agree bit for bit
                        with glm5_ops.use_backend(be):
                            a = glm5_ops.indexer_scores(q, w, k)
                            b = glm5_ops.indexer_scores(q, w, k)
                        torch.cuda.synchronize()
                        same = torch.equal(a, b)
                        return same, "two runs bit-identical" if same else \
                            f"runs differ in {(a != b).sum().item()} entries (race?)"
                    run_check(f"indexer_scores/{be}: repeatable at B={B} S={S} T={T}", det)
        del q, w, k
        torch.cuda.empty_cache()

    quantize_timings(torch, glm5_ops, backends, quick, timer)
    attention_timings(torch, glm5_ops, backends, quick, timer)


# --------------------------------------------------------------------------- attention
# Checks and timings of sparse_attention, block_sparse_attention (forward and
# backward) and block_topk_mask. Every check name starts with "attention." so
# that --only attention selects this section. Outputs are poisoned (NaN-filled
# empty tensors), the oracle runs in float64 on the same (rounded) inputs.

ATT_TOL = {"float32": (2e-5, 1e-4), "bfloat16": (1.5e-2, 2.5e-2), "float16": (2e-3, 5e-3)}  # (fwd, bwd) rel err


def _rel(torch, a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0


def attention_out_ok(torch, out, lse, ref_out, ref_lse, tol):
    """Same shape/dtype, same -inf lse pattern, finite where the reference is,
    relative error of out and max |lse diff| within tolerance."""
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape or lse.dtype != torch.float32:
        return False, f"got out {tuple(out.shape)} lse {lse.dtype} {tuple(lse.shape)}, want {tuple(ref_out.shape)}"
    ninf, rninf = torch.isneginf(lse), torch.isneginf(ref_lse)
    if not torch.equal(ninf, rninf):
        return False, f"lse -inf pattern differs in {(ninf != rninf).sum().item()} rows (empty-row handling?)"
    if not torch.isfinite(out).all():
        return False, f"{(~torch.isfinite(out)).sum().item()} non-finite outputs (unwritten or NaN)"
    if ninf.any() and out[ninf].abs().max().item() != 0:
        return False, "rows with no key must output zeros"
    fin = ~rninf
    dl = (lse[fin].double() - ref_lse[fin].double()).abs().max().item() if fin.any() else 0.0
    err = _rel(torch, out, ref_out)
    return err <= tol and dl <= 20 * tol, f"out rel err {err:.1e}, max |dlse| {dl:.1e} (tol {tol:.0e})"


def grads_ok(torch, got, want, tol):
    msgs, ok = [], True
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        if b is None:
            continue
        if a is None or a.shape != b.shape:
            return False, f"{name}: missing or wrong shape"
        if not torch.isfinite(a).all():
            return False, f"{name}: {(~torch.isfinite(a)).sum().item()} non-finite entries"
        e = _rel(torch, a, b)
        ok &= e <= tol
        msgs.append(f"{name} {e:.1e}")
    return ok, ", ".join(msgs) + f" (tol {tol:.0e})"


def _rand_indices(torch, B, S, T, topk, g, dev, skip=0.1, empty_row=True):
    """int32 [B,S,topk]: distinct positions per query (random order), some -1
    slots, and (empty_row) one query whose slots are all -1."""
    idx = torch.rand(B, S, T, device=dev, generator=g).topk(topk, dim=-1).indices
    drop = torch.rand(B, S, topk, device=dev, generator=g) < skip
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    if empty_row:
        idx[0, S // 2] = -1
    return idx.to(torch.int32)


def _rand_block_mask(torch, B, H, S, T, bs, g, dev):
    """A mask with random, unsorted rows of distinct blocks and garbage (-7)
    past kv_num_blocks; one empty row."""
    Qb, Kb = -(-S // bs), -(-T // bs)
    num = torch.randint(0, Kb + 1, (B, H, Qb), device=dev, generator=g, dtype=torch.int32)
    order = torch.rand(B, H, Qb, Kb, device=dev, generator=g).argsort(-1).to(torch.int32)
    used = torch.arange(Kb, device=dev) < num[..., None]
    idx = torch.where(used, order, torch.full_like(order, -7))
    num[0, 0, 0] = 0
    return num, idx


def _kv(torch, randn, B, T, Hkv, Dk, Dv, dtype, alias):
    """k, v with non-trivial strides: alias -> v = k[..., :Dv] (MLA); else k is a
    view into a wider buffer and v a separate tensor."""
    if alias:
        k = randn(B, T, Hkv, Dk + 8, dtype=dtype)[..., :Dk]
        return k, k[..., :Dv]
    k = randn(B, T, Hkv, Dk, dtype=dtype)
    v = randn(B, T, 2 * Hkv, Dv, dtype=dtype)[:, :, ::2]
    return k, v


class _Poisoned:
    """Deterministic mode with fill_uninitialized_memory: empty tensors come
    NaN-filled, so an output element a kernel never writes fails the checks."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        import warnings
        torch = self.torch
        self.old = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        warnings.filterwarnings("ignore", message=".*deterministic.*")
        return self

    def __exit__(self, *exc):
        self.torch.use_deterministic_algorithms(self.old[0], warn_only=True)
        self.torch.utils.deterministic.fill_uninitialized_memory = self.old[1]
        return False


def _attention_env(torch, dev):
    from glm5_ops import reference
    g = _generator(torch, dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    def qstart(kind, B, S, T):
        if kind == "tensor":
            return torch.tensor(([0, T - S - 20] + [T - S] * B)[:B], device=dev)
        return T // 2 if kind == "int" else None
    return g, reference, sync, randn, qstart


def sparse_attention_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    with _Poisoned(torch):
        _sparse_attention_checks(torch, glm5_ops, backends, quick, dev, _dtypes(torch, dtypes))


def _sparse_attention_checks(torch, glm5_ops, backends, quick, dev, dtypes):
    g, reference, sync, randn, qstart = _attention_env(torch, dev)
    # (B, S, T, Hq, Hkv, Dk, Dv, topk, causal, q_start, alias)
    scases = [
        (2, 37, 300, 8, 2, 64, 64, 50, True, None, False),        # GQA G=4, causal
        (1, 5, 77, 3, 1, 20, 20, 10, False, None, False),         # odd Hq, Dk % 8 != 0 (scalar loads)
        (1, 9, 200, 64, 1, 576, 512, 64, True, None, True),       # MLA absorbed: v = k[..., :512], G=64
        (1, 4, 130, 20, 1, 40, 24, 70, False, None, False),       # G=20: M=64 with masked rows, Dv=24
        (2, 33, 513, 16, 16, 128, 128, 100, True, "tensor", False),  # MHA, q_start per batch: empty rows
        (1, 3, 150, 2, 1, 96, 600, 40, True, "int", False),       # Dv > 512: two Dv chunks
        (1, 6, 400, 128, 1, 576, 512, 130, True, None, True),     # G=128: two units per query, topk % 64 != 0
        (1, 4, 100, 8, 1, 576, 512, 64, False, None, False),      # GLM-5 TP8 heads, v not aliased
    ]
    if quick:
        scases = scases[:6]
    for backend in backends:
        for dtype in dtypes:
            dn = str(dtype).replace("torch.", "")
            ftol, btol = ATT_TOL[dn]
            for (B, S, T, Hq, Hkv, Dk, Dv, topk, causal, qsk, alias) in scases:
                tag = (f"{dn} B={B} S={S} T={T} Hq={Hq} Hkv={Hkv} Dk={Dk} Dv={Dv} topk={topk} causal={causal} "
                       f"q_start={qsk}{' v=k[..., :Dv]' if alias else ''}")

                def make(B=B, S=S, T=T, Hq=Hq, Hkv=Hkv, Dk=Dk, Dv=Dv, topk=topk, alias=alias, qsk=qsk, dtype=dtype):
                    q = randn(B, S, Hq, Dk, dtype=dtype)
                    k, v = _kv(torch, randn, B, T, Hkv, Dk, Dv, dtype, alias)
                    return q, k, v, _rand_indices(torch, B, S, T, topk, g, q.device), qstart(qsk, B, S, T)

                def fwd(make=make, causal=causal, backend=backend, tol=ftol):
                    q, k, v, idx, qs = make()
                    with glm5_ops.use_backend(backend):
                        out, lse = glm5_ops.sparse_attention(q, k, v, idx, causal=causal, q_start=qs)
                    sync()
                    ro, rl = reference.sparse_attention(q.double(), k.double(), v.double(), idx,
                                                        scale=q.shape[-1] ** -0.5, causal=causal, q_start=qs)
                    return attention_out_ok(torch, out, lse, ro, rl, tol)

                def bwd(make=make, causal=causal, backend=backend, tol=btol, alias=alias):
                    q, k, v, idx, qs = make()
                    q.requires_grad_(True)
                    k = k.detach().requires_grad_(True)
                    v = k[..., :v.shape[-1]] if alias else v.detach().requires_grad_(True)
                    with glm5_ops.use_backend(backend):
                        out, _ = glm5_ops.sparse_attention(q, k, v, idx, causal=causal, q_start=qs)
                    dout = torch.randn_like(out)
                    got = torch.autograd.grad(out, (q, k) if alias else (q, k, v), dout)
                    sync()
                    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
                    v64 = k64[..., :v.shape[-1]] if alias else v.detach().double().requires_grad_(True)
                    ro, _ = reference.sparse_attention(q64, k64, v64, idx, scale=q.shape[-1] ** -0.5, causal=causal,
                                                       q_start=qs)
                    want = torch.autograd.grad(ro, (q64, k64) if alias else (q64, k64, v64), dout.double())
                    return grads_ok(torch, list(got) + [None] * (3 - len(got)), list(want) + [None] * (3 - len(want)),
                                    tol)

                run_check(f"attention.sparse_fwd/{backend}: {tag}", fwd)
                run_check(f"attention.sparse_bwd/{backend}: {tag}", bwd)


def block_attention_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    with _Poisoned(torch):
        _block_attention_checks(torch, glm5_ops, backends, quick, dev, _dtypes(torch, dtypes))


def _block_attention_checks(torch, glm5_ops, backends, quick, dev, dtypes):
    g, reference, sync, randn, qstart = _attention_env(torch, dev)
    # (B, S, T, Hq, Hkv, D, Dv, block_size, topk_blocks, causal, q_start, alias, mask kind)
    bcases = [
        (2, 200, 200, 4, 2, 64, 64, 32, 3, True, None, False, "predicted"),
        (1, 77, 130, 3, 1, 20, 24, 16, 2, True, "int", False, "random"),     # odd sizes, partial blocks
        (1, 256, 300, 2, 2, 128, 128, 64, 2, True, None, False, "random"),
        (1, 100, 100, 2, 1, 64, 64, 7, 4, False, None, False, "random"),     # tiny blocks pack into key tiles
        (1, 129, 129, 2, 1, 576, 512, 128, 1, True, None, True, "predicted"),  # MLA dims, two row chunks
        (2, 64, 96, 4, 4, 32, 32, 16, 2, True, "tensor", False, "random"),   # q_start: empty causal rows
    ]
    if quick:
        bcases = bcases[:4]
    for backend in backends:
        for dtype in dtypes:
            dn = str(dtype).replace("torch.", "")
            ftol, btol = ATT_TOL[dn]
            for (B, S, T, Hq, Hkv, D, Dv, bs, tb, causal, qsk, alias, kind) in bcases:
                tag = (f"{dn} B={B} S={S} T={T} Hq={Hq} Hkv={Hkv} D={D} Dv={Dv} bs={bs} causal={causal} "
                       f"q_start={qsk} {kind} mask{' v=k[..., :Dv]' if alias else ''}")

                def make(B=B, S=S, T=T, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, bs=bs, tb=tb, causal=causal, qsk=qsk,
                         alias=alias, kind=kind, dtype=dtype):
                    q = randn(B, S, Hq, D, dtype=dtype)
                    k, v = _kv(torch, randn, B, T, Hkv, D, Dv, dtype, alias)
                    qs = qstart(qsk, B, S, T)
                    if kind == "predicted":
                        num, idx = reference.block_topk_mask(q, k, block_size=bs, topk_blocks=tb, causal=causal,
                                                             q_start=qs)
                    else:
                        num, idx = _rand_block_mask(torch, B, Hq, S, T, bs, g, q.device)
                    return q, k, v, glm5_ops.BlockMask(num, idx, bs), qs

                def ref_fn(q, k, v, m, causal, qs):
                    return reference.block_sparse_attention(q, k, v, m.kv_num_blocks, m.kv_indices,
                                                            block_size=m.block_size, scale=q.shape[-1] ** -0.5,
                                                            causal=causal, q_start=qs)

                def fwd(make=make, causal=causal, backend=backend, tol=ftol, ref_fn=ref_fn):
                    q, k, v, m, qs = make()
                    with glm5_ops.use_backend(backend):
                        out, lse = glm5_ops.block_sparse_attention(q, k, v, m, causal=causal, q_start=qs)
                    sync()
                    ro, rl = ref_fn(q.double(), k.double(), v.double(), m, causal, qs)
                    return attention_out_ok(torch, out, lse, ro, rl, tol)

                def bwd(make=make, causal=causal, backend=backend, tol=btol, alias=alias, ref_fn=ref_fn):
                    q, k, v, m, qs = make()
                    Dv_ = v.shape[-1]
                    q.requires_grad_(True)
                    k = k.detach().requires_grad_(True)
                    v = k[..., :Dv_] if alias else v.detach().requires_grad_(True)
                    with glm5_ops.use_backend(backend):
                        out, _ = glm5_ops.block_sparse_attention(q, k, v, m, causal=causal, q_start=qs)
                    dout = torch.randn_like(out)
                    leaves = (q, k) if alias else (q, k, v)
                    got = torch.autograd.grad(out, leaves, dout)
                    sync()
                    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
                    v64 = k64[..., :Dv_] if alias else v.detach().double().requires_grad_(True)
                    ro, _ = ref_fn(q64, k64, v64, m, causal, qs)
                    want = torch.autograd.grad(ro, (q64, k64) if alias else (q64, k64, v64), dout.double())
                    pad = [None] * (3 - len(got))
                    return grads_ok(torch, list(got) + pad, list(want) + pad, tol)

                run_check(f"attention.block_fwd/{backend}: {tag}", fwd)
                run_check(f"attention.block_bwd/{backend}: {tag}", bwd)


def block_mask_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    with _Poisoned(torch):
        _block_mask_checks(torch, glm5_ops, backends, quick, dev)


def _block_mask_checks(torch, glm5_ops, backends, quick, dev):
    g, reference, sync, randn, qstart = _attention_env(torch, dev)
    # block_topk_mask: (B, S, T, H, Hkv, D, block_size, topk_blocks, causal, sink, local, pooling, q_start)
    mcases = [
        (2, 300, 300, 4, 2, 64, 32, 3, True, 1, 1, "mean", None),
        (1, 77, 1000, 3, 1, 20, 16, 5, True, 2, 2, "minmax", "int"),
        (1, 256, 4096, 8, 1, 128, 64, 16, True, 1, 2, "mean", None),
        (2, 100, 130, 2, 2, 32, 7, 4, False, 0, 1, "minmax", "tensor"),
        (1, 64, 64, 2, 1, 16, 16, 10, True, 1, 1, "mean", None),            # topk > candidates: all taken
    ]
    if quick:
        mcases = mcases[:3]
    for backend in backends:
        low = torch.float16 if _interpreted(backend, dev) else torch.bfloat16
        for dtype in ([torch.float32, low] if not quick else [torch.float32]):
            dn = str(dtype).replace("torch.", "")
            for (B, S, T, H, Hkv, D, bs, tb, causal, sink, local, pooling, qsk) in mcases:
                tag = (f"{dn} B={B} S={S} T={T} H={H} Hkv={Hkv} D={D} bs={bs} topk={tb} causal={causal} "
                       f"sink={sink} local={local} {pooling} q_start={qsk}")

                def one(B=B, S=S, T=T, H=H, Hkv=Hkv, D=D, bs=bs, tb=tb, causal=causal, sink=sink, local=local,
                        pooling=pooling, qsk=qsk, dtype=dtype, backend=backend):
                    q, k = randn(B, S, H, D, dtype=dtype), randn(B, T, Hkv, D, dtype=dtype)
                    qs = qstart(qsk, B, S, T)
                    kw = dict(block_size=bs, topk_blocks=tb, causal=causal, sink_blocks=sink, local_blocks=local,
                              pooling=pooling, q_start=qs)
                    with glm5_ops.use_backend(backend):
                        m = glm5_ops.block_topk_mask(q, k, **kw)
                    sync()
                    rnum, ridx = reference.block_topk_mask(q, k, **kw)
                    return block_mask_ok(torch, reference, m.kv_num_blocks, m.kv_indices, rnum, ridx, q, k, bs,
                                         pooling)

                run_check(f"attention.block_topk_mask/{backend}: {tag}", one)


def _block_scores(torch, reference, q, k, bs, pooling):
    """fp32 [B,H,Qb,Kb] block scores exactly as reference.block_topk_mask defines them."""
    G = q.shape[2] // k.shape[2]
    qbar = reference._block_means(q.float(), bs)
    if pooling == "mean":
        kbar = reference._block_means(k.float(), bs).repeat_interleave(G, dim=2)
        return torch.einsum("bihd,bjhd->bhij", qbar, kbar)
    kmax = reference._block_extreme(k.float(), bs, True).repeat_interleave(G, dim=2)
    kmin = reference._block_extreme(k.float(), bs, False).repeat_interleave(G, dim=2)
    return (torch.einsum("bihd,bjhd->bhij", qbar.clamp(min=0), kmax)
            + torch.einsum("bihd,bjhd->bhij", qbar.clamp(max=0), kmin))


def block_mask_ok(torch, reference, num, idx, rnum, ridx, q, k, bs, pooling):
    """Same shapes and counts; rows ascending then 0 padding; the selected set
    equals the reference's, or differs only by blocks of (near-)equal score."""
    if num.dtype != torch.int32 or idx.dtype != torch.int32 or num.shape != rnum.shape or idx.shape != ridx.shape:
        return False, f"got {num.dtype}{tuple(num.shape)} {idx.dtype}{tuple(idx.shape)}, want int32 " \
                      f"{tuple(rnum.shape)} {tuple(ridx.shape)}"
    if not torch.equal(num, rnum):
        return False, f"kv_num_blocks differs in {(num != rnum).sum().item()} rows"
    W = idx.shape[-1]
    used = torch.arange(W, device=idx.device) < num[..., None]
    if W > 1 and ((idx[..., 1:] <= idx[..., :-1]) & used[..., 1:]).any():
        return False, "selected blocks are not strictly ascending"
    if (idx[~used] != 0).any():
        return False, "padding after kv_num_blocks is not 0"
    Kb = -(-k.shape[1] // bs)
    mine = reference._ordered_to_blocks(num, idx, Kb)
    ref = reference._ordered_to_blocks(rnum, ridx, Kb)
    if torch.equal(mine, ref):
        return True, f"{tuple(idx.shape)} identical"
    sc = _block_scores(torch, reference, q, k, bs, pooling)
    only_mine = torch.where(mine & ~ref, sc, torch.zeros_like(sc)).sum(-1)
    only_ref = torch.where(ref & ~mine, sc, torch.zeros_like(sc)).sum(-1)
    diff = (only_mine - only_ref).abs().max().item()
    tol = 1e-4 * max(sc.abs().max().item(), 1e-6)
    return diff <= tol, f"{(mine != ref).any(-1).sum().item()} rows differ; |score diff| {diff:.1e} (tol {tol:.1e}, ties)"


def attention_timings(torch, glm5_ops, backends, quick, timer):
    import torch.nn.functional as F
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    # DSA sparse attention, MLA absorbed form (v = k[..., :512]); Hq=64 is the issue's
    # target shape, Hq=8 is GLM-5 at TP8 (8 heads per GPU).
    B, S, T, Dk, Dv, topk = 1, 4096, 65536, 576, 512, 2048
    kv = torch.randn(B, T, 1, Dk, device=dev, generator=g).bfloat16()
    idx = torch.empty(B, S, topk, dtype=torch.int32, device=dev)
    for s0 in range(0, S, 512):  # distinct random keys per query, in chunks ([512, T] scores at a time)
        idx[0, s0:s0 + 512] = torch.rand(min(512, S - s0), T, device=dev, generator=g).topk(topk, -1).indices
    for Hq in ([64] if quick else [64, 8]):
        q = (torch.randn(B, S, Hq, Dk, device=dev, generator=g) * Dk ** -0.5).bfloat16()
        flops = 2.0 * B * S * topk * Hq * (Dk + Dv)
        nbytes = q.numel() * 2 + B * S * topk * Dk * 2 + B * S * Hq * Dv * 2
        group = f"attention sparse fwd bf16 S={S} T={T} Hq={Hq} Hkv=1 Dk={Dk} Dv={Dv} topk={topk} (v=k[..., :Dv])"
        for be in backends:
            def f(be=be, q=q):
                with glm5_ops.use_backend(be):
                    return glm5_ops.sparse_attention(q, kv, kv[..., :Dv], idx)
            ms = timed(timer, group, be, f, flops=flops, nbytes=nbytes, note="target 300 TFLOP/s" if Hq == 64 else "")
            if ms:
                log(f"    {be}: {flops / ms / 1e9 / 300:.0%} of the 300 TFLOP/s target")
        if not quick or Hq == 64:
            Sb = 128  # backward at a smaller S (SIMT backward with atomics: slow, ~1e9 atomics here)
            qb = q[:, :Sb].clone().requires_grad_(True)
            kb = kv.clone().requires_grad_(True)
            bflops = 2.5 * flops * Sb / S
            for be in backends:
                def fb(be=be, qb=qb, kb=kb):
                    with glm5_ops.use_backend(be):
                        out, _ = glm5_ops.sparse_attention(qb, kb, kb[..., :Dv], idx[:, :Sb])
                    return torch.autograd.grad(out, (qb, kb), torch.ones_like(out))
                timed(timer, f"attention sparse fwd+bwd bf16 S={Sb} T={T} Hq={Hq} Dk={Dk} Dv={Dv} topk={topk}", be,
                      fb, flops=bflops + flops * Sb / S)
            del qb, kb
        del q
    del kv, idx
    torch.cuda.empty_cache()

    # Block-sparse vs dense causal SDPA (flash): throughput per computed block.
    shapes = [(1, 8192, 16, 128, 128, 16)] + ([] if quick else [(1, 16384, 32, 128, 128, 32)])
    for (B, S, H, D, bs, tb) in shapes:
        q = torch.randn(B, S, H, D, device=dev, generator=g).bfloat16()
        k = torch.randn(B, S, H, D, device=dev, generator=g).bfloat16()
        v = torch.randn(B, S, H, D, device=dev, generator=g).bfloat16()
        dense_flops = 4.0 * B * H * S * S * D / 2
        group = f"attention block-sparse bf16 S=T={S} H={H} D={D} bs={bs} topk_blocks={tb} causal"
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        base = timed(timer, group, "dense SDPA causal (flash)",
                     lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), flops=dense_flops)
        for be in backends:
            try:
                with glm5_ops.use_backend(be):
                    mask = glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=tb)
            except Exception as e:  # noqa: BLE001
                log(f"TIME {group} | {be}: block_topk_mask failed ({type(e).__name__}: {str(e)[:200]})")
                continue
            blocks = int(mask.kv_num_blocks.sum())
            flops = 4.0 * blocks * bs * bs * D  # every computed block counted in full

            def fm(be=be):
                with glm5_ops.use_backend(be):
                    return glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=tb)

            def fa(be=be, mask=mask):
                with glm5_ops.use_backend(be):
                    return glm5_ops.block_sparse_attention(q, k, v, mask)
            timed(timer, group, f"{be} block_topk_mask", fm)
            ms = timed(timer, group, f"{be} block_sparse_attention ({blocks} blocks, "
                       f"{mask.density(S, S):.0%} dense)", fa, flops=flops, base_ms=base)
            if ms and base:
                eff = (flops / ms) / (dense_flops / base)
                log(f"    {be}: per computed block {eff:.0%} of dense SDPA throughput (target >= 60%)")
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- sections and scheduling
# Every (family, backend[, dtype]) is one child process with its own CUDA
# context, time limit and JSON file. The check sections run concurrently, the
# longest first (Triton compiles one kernel per specialisation, 1-10 s of CPU
# each on a cold cache: the device's cores do that in parallel); the timing
# sections then run one at a time, with the GPU to themselves.

class Section:
    def __init__(self, family: str, backend: str, dtype: str | None = None, warm: bool = False):
        fam = FAMILIES[family]
        self.family, self.backend, self.dtype, self.warm = family, backend, dtype, warm
        self.timing = fam["kind"] == "timing"
        self.name = family + (f"[{dtype}]" if dtype else "")
        self.tag = ("warm:" if warm else "") + f"{self.name}/{backend}"
        # Longest first: Triton sections compile (fp32 kernels spill, ptxas is slowest there).
        self.weight = 100.0 if warm else fam.get("weight", 1) * (1.0 if backend == "triton" else 0.2) + \
            (1 if dtype == "float32" else 0)
        # The C++/CUDA extension: every cpp section, and Triton's quantize (it compares
        # its stochastic codes with the CUDA kernel's).
        self.needs_build = backend == "cpp" or family == "quantize"
        self.proc = self.path = self.thread = None
        self.t0 = self.wall = 0.0
        self.budget = 0
        self.end = ""


def family_dtypes(family: str, backend: str, dev: str, quick: bool) -> list:
    """The dtype of each section of a family (None: one section, the family picks)."""
    if not FAMILIES[family].get("split"):
        return [None]
    dts = ["float32", "bfloat16"] + ([] if quick else ["float16"])
    if family == "moe-fused":
        dts = ["float32", "float16"] if dev == "cpu" else (["float32", "bfloat16"] if backend == "triton" else dts)
    if dev == "cpu" and backend == "triton":   # the interpreter has no bf16 math: fp16 instead
        dts = [d for d in dts if d != "bfloat16"] + (["float16"] if "float16" not in dts else [])
    return dts


def _dtypes(torch, names):
    return [getattr(torch, n) for n in (names or ["float32", "bfloat16", "float16"])]


def select_sections(sections: list) -> list:
    """--only: the sections whose name or check / timing names an --only term
    matches; a term that matches no section at all (say "float32") keeps every
    section, each then running only the checks whose names contain a term."""
    if not ONLY:
        return sections

    def match(sec, term):   # by family and check-name prefixes (a dtype alone selects no section)
        keys = [sec.family] + FAMILIES[sec.family]["prefixes"]
        return any(term in k or k in term for k in keys)
    if any(not any(match(sec, o) for sec in sections) for o in ONLY):
        return sections
    return [sec for sec in sections if any(match(sec, o) for o in ONLY)]


PRINT_LOCK = threading.Lock()


def _pump(proc, tag: str) -> None:
    """Print a child's output line by line, stamped with the suite's clock and its section."""
    for line in proc.stdout:
        with PRINT_LOCK:
            print(f"[{time.time() - T0:6.1f}s] {tag} | {line.rstrip()}", flush=True)


def _start(args, sec: Section, budget: float, threads: int, nice: bool = False) -> None:
    import tempfile
    fd, sec.path = tempfile.mkstemp(suffix=".json", prefix="gpu_suite_")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--section", sec.family, "--backends", sec.backend,
           "--json", sec.path, "--device", args.device] + (["--dtypes", sec.dtype] if sec.dtype else []) + \
        (["--quick"] if args.quick else []) + (["--only", args.only] if args.only else []) + \
        (["--warm"] if sec.warm else [])
    env = dict(os.environ, GLM5_SUITE_CHILD="1", PYTHONUNBUFFERED="1")
    if args.device == "cpu" and sec.backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if nice:   # started while the extension builds: the build (and the sections waiting for it) go first
        env["GLM5_SUITE_NICE"] = "10"
    sec.budget = int(budget)
    sec.t0 = time.time()
    sec.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
    sec.thread = threading.Thread(target=_pump, args=(sec.proc, sec.tag), daemon=True)
    sec.thread.start()
    log(f"start {sec.tag} (limit {sec.budget}s)")


def _finish(sec: Section, rc) -> None:
    sec.wall = time.time() - sec.t0
    sec.thread.join(timeout=10)
    part = {"checks": [], "timings": []}
    try:
        with open(sec.path) as f:
            part = json.load(f)
    except Exception:  # noqa: BLE001 - the child died before its first record
        pass
    os.unlink(sec.path)
    if sec.warm:   # compile-only run: nothing to merge
        sec.end = "ok" if rc == 0 else f"ended with {rc}"
        log(f"done {sec.tag} in {sec.wall:.0f}s ({sec.end})")
        return
    RESULTS["checks"] += part["checks"]
    RESULTS["timings"] += part["timings"]
    if part.get("meta"):
        RESULTS.setdefault("meta", part["meta"])
    passed = sum(c["ok"] for c in part["checks"])
    sec.end = "ok" if rc == 0 else ("time limit" if rc == "timeout" else f"exit {rc}")
    RESULTS.setdefault("sections", []).append(
        {"section": sec.name, "backend": sec.backend, "wall_s": round(sec.wall, 1), "end": sec.end,
         "checks": len(part["checks"]), "passed": passed, "timings": len(part["timings"])})
    log(f"done {sec.tag} in {sec.wall:.0f}s: {passed}/{len(part['checks'])} checks passed"
        + (f", {len(part['timings'])} timings" if part["timings"] else "") + ("" if rc == 0 else f" ({sec.end})"))
    if rc != 0:
        record_check(f"section {sec.name}/{sec.backend}", False,
                     f"child process ended with {rc} after {sec.wall:.0f}s (crash, sticky CUDA error or time limit "
                     f"{sec.budget}s): the checks after its last line above are missing")


def run_pool(args, sections: list, jobs: int, budget_s: float, phase_s: float | None = None,
             build: "Build | None" = None) -> None:
    """Runs `sections` as child processes, at most `jobs` at a time, longest
    (weight) first; those that need the extension wait for `build` (a Build in
    progress, or None). Each gets `budget_s` seconds, or what is left of the
    phase's `phase_s`; a section that would get under 30 s is not started."""
    import signal
    pending = sorted(sections, key=lambda sec: -sec.weight)
    running: list = []
    start = time.time()
    threads = max(1, (os.cpu_count() or 2) // max(1, jobs))
    while pending or running:
        while pending and len(running) < jobs:
            waiting = build is not None and not build.done.is_set()
            ready = [sec for sec in pending if not (sec.needs_build and waiting)]
            if not ready:
                break
            left = budget_s if phase_s is None else min(budget_s, phase_s - (time.time() - start))
            if left < 30:
                for sec in pending:
                    if not sec.warm:
                        record_check(f"section {sec.name}/{sec.backend}", False,
                                     f"not started: the phase's {phase_s:.0f}s were spent")
                pending = []
                break
            sec = ready[0]
            pending.remove(sec)
            if sec.needs_build and build is not None and not build.ok:
                record_check(f"section {sec.name}/{sec.backend}", False,
                             "not run: glm5_ops._C did not build with CUDA (see the build's output above)")
                continue
            _start(args, sec, left, threads, nice=build is not None and not build.done.is_set())
            running.append(sec)
        time.sleep(0.2)
        for sec in list(running):
            rc = sec.proc.poll()
            if rc is None and time.time() - sec.t0 > sec.budget:
                os.killpg(sec.proc.pid, signal.SIGKILL)   # the child and its compilers (its own session)
                sec.proc.wait()
                rc = "timeout"
            if rc is not None:
                running.remove(sec)
                _finish(sec, rc)


def summary() -> None:
    fails = [c for c in RESULTS["checks"] if not c["ok"]]
    print("\n## GPU suite summary\n")
    print(f"checks: {len(RESULTS['checks']) - len(fails)}/{len(RESULTS['checks'])} passed; "
          f"total {time.time() - T0:.0f}s")
    by_backend = {}
    for c in RESULTS["checks"]:
        be = c["name"].split(":")[0].split("/")[-1]
        by_backend.setdefault(be, [0, 0])
        by_backend[be][0] += c["ok"]
        by_backend[be][1] += 1
    for be, (p, n) in by_backend.items():
        print(f"- {be}: {p}/{n}")
    by_detail = {}  # one line per distinct failure (a missing backend fails every check the same way)
    for c in fails:
        by_detail.setdefault(c["detail"][:160], []).append(c["name"])
    for detail, names in list(by_detail.items())[:25]:
        more = f" (+{len(names) - 1} more like it)" if len(names) > 1 else ""
        print(f"- FAIL {names[0]}: {detail}{more}")
    if RESULTS.get("sections"):
        print("\n| section | backend | checks passed | timings | s | end |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        for r in RESULTS["sections"]:
            print(f"| {r['section']} | {r['backend']} | {r['passed']}/{r['checks']} | {r['timings']} | "
                  f"{r['wall_s']:.0f} | {r['end']} |")
    if not RESULTS["timings"]:
        return
    print("\n| case | impl | ms | TFLOP/s | GB/s | vs baseline |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    seen = set()
    for r in RESULTS["timings"]:
        if (r["group"], r["impl"]) in seen:  # baselines are timed once per backend section
            continue
        seen.add((r["group"], r["impl"]))
        fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
        ms = fmt(r.get("ms"), "%.4f") if r.get("ms") is not None else ("fail: " + r.get("note", ""))[:60]
        print(f"| {r['group']} | {r['impl']} | {ms} | {fmt(r.get('tflops'), '%.1f')} | {fmt(r.get('gbs'), '%.0f')} | "
              f"{fmt(r.get('speedup'), 'x%.2f')} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer checks and shapes")
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-timings", action="store_true")
    ap.add_argument("--backends", default="cpp,triton")
    ap.add_argument("--device", default="cuda", help="cpu: dry-run the checks on the CPU kernels (no timings)")
    ap.add_argument("--only", default="", help="comma list of substrings: run only the checks and timings "
                    "whose names contain one (e.g. 'topk_indices,topk fp32' or 'indexer'), and only the "
                    "sections they can come from")
    ap.add_argument("--jobs", type=int, default=0,
                    help="check sections at a time (default: CUDA min(12, cores - 2), CPU min(2, cores))")
    ap.add_argument("--section-s", type=int, default=0,
                    help="time limit of one check section (default 240 s, 180 with --quick; CPU 4x)")
    ap.add_argument("--check-phase-s", type=int, default=0,
                    help="the check phase ends by then: no section starts later, none runs past it "
                         "(default 330 s, 270 with --quick; CPU none)")
    ap.add_argument("--section", choices=list(FAMILIES), help=argparse.SUPPRESS)
    ap.add_argument("--dtypes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "gpu_suite.json") if os.environ.get("OUT") else None)
    args = ap.parse_args()
    cpu = args.device == "cpu"
    ONLY.extend(o for o in args.only.split(",") if o)
    backends = [b for b in args.backends.split(",") if b]

    if args.section:  # child: one section, results to --json
        if os.environ.get("GLM5_SUITE_NICE"):
            os.nice(int(os.environ["GLM5_SUITE_NICE"]))
        import torch
        import glm5_ops
        name = "cpu" if cpu else torch.cuda.get_device_name()
        RESULTS["meta"] = {"torch": torch.__version__, "device": name, "quick": args.quick}
        if args.json:
            JSON_OUT.append(args.json)
        if args.warm:
            WARM.extend(backends)
        dtypes = [d for d in args.dtypes.split(",") if d] or None
        try:
            FAMILIES[args.section]["fn"](torch, glm5_ops, backends, args.quick, args.device, dtypes)
        finally:
            save_json()
        return

    import torch
    name = "cpu" if cpu else torch.cuda.get_device_name()
    ncpu = os.cpu_count() or 2
    jobs = args.jobs or (min(2, ncpu) if cpu else max(1, min(12, ncpu - 2)))
    log(f"python {sys.version.split()[0]}, torch {torch.__version__} cuda {torch.version.cuda}; device {name}; "
        f"{ncpu} CPU cores")
    del torch
    # The extension builds in the background while the Triton check sections compile
    # their kernels; the sections that need it start once it is there.
    build = Build().start() if not args.skip_build and not cpu else None
    section_s = args.section_s or ((180 if args.quick else 240) * (4 if cpu else 1))
    phase_s = args.check_phase_s or (None if cpu else (270 if args.quick else 330))

    sections = select_sections(
        [Section(f, be, dt) for f, fam in FAMILIES.items() if fam["kind"] == "check"
         for be in backends for dt in family_dtypes(f, be, args.device, args.quick)]
        + [Section(f, be) for f in ("timings", "moe-timings") for be in backends])
    checks = [sec for sec in sections if not sec.timing]
    timing = [] if cpu or args.skip_timings else [sec for sec in sections if sec.timing]
    if not args.skip_checks:
        # Triton's timing kernels compile (one call each, no timing) while the checks run,
        # so the timing sections below find them in the cache.
        warm = [Section(sec.family, "triton", warm=True) for sec in timing if sec.backend == "triton"]
        log(f"=== checks: {len(checks)} sections, {jobs} at a time"
            + (f", plus {len(warm)} Triton warm-up runs of the timing sections" if warm else "")
            + (f"; the phase ends within {phase_s}s" if phase_s else ""))
        t = time.time()
        run_pool(args, warm + checks, jobs, section_s, phase_s, build)
        log(f"=== checks done in {time.time() - t:.0f}s")
    if build is not None and not build.done.is_set():
        log("waiting for the build ...")
        build.done.wait()
    if timing:
        log(f"=== timings: {len(timing)} sections, one at a time")
        t = time.time()
        for sec in timing:
            budget = (150 if args.quick else 200) if sec.family == "timings" else (120 if args.quick else 180)
            run_pool(args, [sec], 1, budget, build=build)
        log(f"=== timings done in {time.time() - t:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    summary()


# --------------------------------------------------------------------------- MoE (issue 4)
# Checks every MoE kernel of each backend against glm5_ops.reference ("cpp" =
# torch.ops.glm5, csrc/cuda/moe.cu on a GPU; "triton" = glm5_ops/triton/moe.py,
# both called directly: the public API only adds argument checks), then times
# fused_moe forward at GLM-5 scale against the measured bf16 matmul peak
# (target 50%) and the dispatch + combine share of it (target <= 10%).
# Run alone: --only moe  (about a minute per backend on an H200).

MOE_CASES = [  # (T, E, k, D, I, ids): decode at E=256, odd D/I, one expert with every token,
    (1, 256, 8, 64, 32, "random"), (37, 16, 4, 96, 40, "random"), (33, 12, 3, 40, 24, "one"),
    (300, 8, 2, 512, 256, "random"), (64, 128, 12, 128, 64, "few"), (5, 6, 1, 7, 5, "random"),
    (64, 256, 8, 512, 256, "few")]  # bf16 grouped GEMM with 253 idle experts (small 16-bit calls run in fp32)
MOE_ROUTES = [(256, 8, 4, 8), (256, 1, 1, 8), (128, 1, 1, 12), (16, 1, 1, 1), (6, 3, 2, 3)]
MOE_BENCH = (16384, 256, 8, 6144, 2048)  # T, E, k, D, I (GLM-5's routed experts, one 16K-token batch)


def _moe_impl(torch, backend, dev):
    if backend == "cpp":
        ops = torch.ops.glm5
        return dict(route=ops.moe_route, fwd=ops.fused_moe_fwd, bwd=ops.fused_moe_bwd,
                    dispatch=ops.moe_dispatch, combine=ops.moe_combine)
    if backend == "triton":
        if dev == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from glm5_ops._backend import triton_module
        tm = triton_module("moe", torch.device(dev))
        return dict(route=tm.moe_route, fwd=tm.fused_moe_fwd, bwd=tm.fused_moe_bwd, tm=tm)
    raise ValueError(f"no MoE kernels for backend {backend!r}")


def _moe_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _moe_ids(torch, kind, T, E, k, dev, g):
    if kind == "random":   # distinct experts per token, as the router gives
        return torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices.int()
    if kind == "one":      # every token to one expert, the others idle
        return torch.full((T, k), E - 2, dtype=torch.int32, device=dev)
    few = torch.tensor([0, 5, E - 1], device=dev)   # three busy experts (repeats), the rest idle
    return few[torch.randint(0, 3, (T, k), device=dev, generator=g)].int()


def _moe_route_check(torch, impl, E, ng, tg, k, dtype, dev, g):
    from glm5_ops import reference
    T, D = 193, 96
    h = torch.randn(T, D, device=dev, generator=g).to(dtype)
    gw = (torch.randn(E, D, device=dev, generator=g) * D ** -0.5).to(dtype)
    bias = torch.randn(E, device=dev, generator=g) * 0.05
    w, ids = impl["route"](h, gw, bias, k, ng, tg, 2.5, True)
    wr, ir = reference.moe_route(h, gw, bias, top_k=k, n_group=ng, topk_group=tg, routed_scaling_factor=2.5,
                                 norm_topk_prob=True)
    if w.dtype != torch.float32 or ids.dtype != torch.int32 or tuple(ids.shape) != (T, k):
        return False, f"got {w.dtype} {ids.dtype} {tuple(ids.shape)}"
    # Rows decided by a float64 gap < 1e-5 (group boundary, top-k boundary, order) may differ.
    c = (h.double() @ gw.double().T).sigmoid() + bias.double()
    tie = torch.zeros(T, dtype=torch.bool, device=dev)
    if tg < ng:
        gsc = c.view(T, ng, -1).topk(2, dim=-1).values.sum(-1).sort(-1, descending=True)
        tie |= (gsc.values[:, tg - 1] - gsc.values[:, tg]) < 1e-5
        keep = torch.zeros_like(gsc.values, dtype=torch.bool).scatter_(1, gsc.indices[:, :tg], True)
        c = c.masked_fill(~keep.repeat_interleave(E // ng, dim=1), float("-inf"))
    cs = c.sort(-1, descending=True).values[:, :k + 1]
    tie |= ((cs[:, :-1] - cs[:, 1:]) < 1e-5).any(1)
    ok = ~tie
    same = torch.equal(ids[ok], ir[ok])
    werr = (w[ok] - wr[ok]).abs().max().item() if ok.any() else 0.0
    return same and werr <= 1e-5, f"ids {'equal' if same else 'DIFFER'} on {int(ok.sum())}/{T} tie-free rows, " \
        f"max |dw| {werr:.1e}"


def _moe_fused_check(torch, impl, T, E, k, D, I, kind, dtype, dev, g):
    """fp32: rel err <= 1e-5 vs the reference; 16-bit: within 2x of the reference's own
    error when it runs on the rounded inputs (both against the fp32 oracle)."""
    from glm5_ops import reference
    x = torch.randn(T, D, device=dev, generator=g)
    wgu = torch.randn(E, 2 * I, D, device=dev, generator=g) * D ** -0.5
    wd = torch.randn(E, D, I, device=dev, generator=g) * I ** -0.5
    wts = torch.rand(T, k, device=dev, generator=g) + 0.1
    ids = _moe_ids(torch, kind, T, E, k, dev, g)
    dout = torch.randn(T, D, device=dev, generator=g)

    def ref(*ts):
        leaves = [t.detach().clone().requires_grad_() for t in ts]
        out = reference.fused_moe(*leaves, ids)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    want = ref(x, wgu, wd, wts)
    low = [t.to(dtype) for t in (x, wgu, wd)]
    base = [0.0] * 5 if dtype == torch.float32 else [_moe_rel(a, b) for a, b in zip(ref(*low, wts), want)]
    got = [impl["fwd"](*low, wts, ids)] + list(impl["bwd"](dout.to(dtype), *low, wts, ids))
    errs = []
    for name, a, b, b0 in zip(("out", "dx", "dw_gate_up", "dw_down", "dweights"), got, want, base):
        if tuple(a.shape) != tuple(b.shape) or not torch.isfinite(a).all():
            return False, f"{name}: shape {tuple(a.shape)} or non-finite (unwritten) entries"
        err = _moe_rel(a, b)
        tol = 1e-5 if dtype == torch.float32 else 2 * b0 + 1e-6
        errs.append((name, err, tol))
    bad = [f"{n} {e:.1e}>{t:.1e}" for n, e, t in errs if e > t]
    return not bad, ("FAIL " + ", ".join(bad)) if bad else "rel err " + " ".join(f"{n} {e:.1e}" for n, e, _ in errs)


def _moe_dispatch_check(torch, impl, dtype, align, dev, g):
    from glm5_ops import reference
    T, E, k, D = 333, 64, 6, 72
    x = torch.randn(T, D, device=dev, generator=g).to(dtype)
    ids = _moe_ids(torch, "random", T, E, k, dev, g)
    ids[ids == 7] = 3   # expert 7 idle
    got = impl["dispatch"](x, ids, E, align)
    want = reference.moe_dispatch(x, ids, E, align=align)
    want = (want[0],) + tuple(want[1])
    for name, a, b in zip(("x_sorted", "expert_offsets", "slot_token", "token_slot"), got, want):
        if not torch.equal(a, b):
            return False, f"{name} differs from the reference"
    w = torch.rand(T, k, device=dev, generator=g)
    y = torch.randn(got[0].shape, device=dev, generator=g).to(dtype)
    err = _moe_rel(impl["combine"](y, got[3], w), reference.moe_combine(y, got[3], w))
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    return err <= tol, f"dispatch bit-exact, N={got[0].shape[0]}; combine rel err {err:.1e} (tol {tol:.0e})"


def _moe_impl_lazy(torch, be, dev):
    box = {}

    def impl():
        if "x" not in box:
            box["x"] = _moe_impl(torch, be, dev)
        return box["x"]
    return impl


def moe_route_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    """moe_route (both backends), moe_dispatch + moe_combine and the bad-ids error (cpp)."""
    with _Poisoned(torch):
        _moe_route_checks(torch, backends, dev)


def _moe_route_checks(torch, backends, dev):
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    g = _generator(torch, dev)
    for be in backends:
        impl = _moe_impl_lazy(torch, be, dev)
        # Triton compiles one kernel per constexpr set (a second or two each on a
        # cold cache): fewer router shapes.
        routes = MOE_ROUTES if be == "cpp" else MOE_ROUTES[::2]
        for (E, ng, tg, k) in routes:
            for dt in ([torch.float32, torch.bfloat16] if dev == "cuda" else [torch.float32]):
                def one(E=E, ng=ng, tg=tg, k=k, dt=dt, impl=impl):
                    r = _moe_route_check(torch, impl(), E, ng, tg, k, dt, dev, g)
                    sync()
                    return r
                run_check(f"moe_route/{be}: {str(dt)[6:]} E={E} n_group={ng} topk_group={tg} k={k}", one)
        if be == "cpp":
            for dt in (torch.float32, torch.bfloat16):
                for align in (1, 16):
                    run_check(f"moe_dispatch+combine/{be}: {str(dt)[6:]} align={align}",
                              lambda dt=dt, align=align, impl=impl: _moe_dispatch_check(torch, impl(), dt, align,
                                                                                        dev, g))

            def bad_ids(impl=impl):
                x = torch.randn(4, 8, device=dev)
                ids = torch.tensor([[0, 1]] * 3 + [[2, 9]], dtype=torch.int32, device=dev)
                try:
                    impl()["fwd"](x, torch.randn(4, 4, 8, device=dev), torch.randn(4, 8, 2, device=dev),
                                  torch.rand(4, 2, device=dev), ids)
                except RuntimeError as e:
                    return "ids" in str(e), str(e).splitlines()[0][:120]
                return False, "ids out of range were accepted"
            run_check(f"fused_moe_fwd/{be}: bad ids raise", bad_ids)


def moe_fused_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    """fused_moe forward and backward against the reference, in the given dtypes."""
    with _Poisoned(torch):
        _moe_fused_checks(torch, backends, quick, dev, _dtypes(torch, dtypes))


def _moe_fused_checks(torch, backends, quick, dev, dtypes):
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    g = _generator(torch, dev)
    cases = MOE_CASES if not (quick or dev == "cpu") else [c for c in MOE_CASES if c[0] * c[4] <= 3000]
    for be in backends:
        impl = _moe_impl_lazy(torch, be, dev)
        paths = [("", None)]
        if be == "cpp" and dev == "cuda":
            paths.append((" [GEMM loop]", "loop"))
        for (T, E, k, D, I, kind) in cases:
            for dt in dtypes:
                # Triton: fp32 only in the BLOCK_M=32 tile config (fewer compiles on a cold cache)
                if be == "triton" and dev == "cuda" and (dt == torch.float16 or
                                                         (dt == torch.float32 and T * k > 32 * E)):
                    continue
                for tag, mode in paths:
                    if mode and dt != torch.bfloat16:
                        continue   # the grouped GEMM path exists for bf16 only

                    def one(T=T, E=E, k=k, D=D, I=I, kind=kind, dt=dt, mode=mode, impl=impl):
                        old = os.environ.pop("GLM5_MOE_GEMM", None)
                        if mode:
                            os.environ["GLM5_MOE_GEMM"] = mode
                        try:
                            r = _moe_fused_check(torch, impl(), T, E, k, D, I, kind, dt, dev, g)
                            sync()
                        finally:
                            os.environ.pop("GLM5_MOE_GEMM", None)
                            if old is not None:
                                os.environ["GLM5_MOE_GEMM"] = old
                        return r
                    run_check(f"fused_moe/{be}{tag}: {str(dt)[6:]} T={T} E={E} k={k} D={D} I={I} {kind}", one)


def moe_timing_section(torch, glm5_ops, backends, quick, dev="cuda"):
    if dev == "cuda":   # its own child process: a crash or timeout here keeps the checks
        for be in backends:
            _moe_timings(torch, be, quick)


def _moe_timings(torch, be, quick):
    timer = Timer(torch)
    T, E, k, D, I = MOE_BENCH
    dev = "cuda"
    group = f"fused_moe fwd bf16 T={T} E={E} k={k} D={D} I={I}"
    flops = 2.0 * T * k * 3 * D * I
    # The ceiling: a square bf16 GEMM, measured here.
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    peak_ms = timed(timer, "bf16 matmul peak (8192^3)", f"torch.mm [moe {be} section]", lambda: a @ b,
                    flops=2.0 * 8192 ** 3)
    del a, b
    peak = 2.0 * 8192 ** 3 / peak_ms / 1e9 if peak_ms else None
    g = torch.Generator(device=dev)
    g.manual_seed(1)
    x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)
    wgu = torch.randn(E, 2 * I, D, device=dev, generator=g, dtype=torch.bfloat16) * D ** -0.5
    wd = torch.randn(E, D, I, device=dev, generator=g, dtype=torch.bfloat16) * I ** -0.5
    ids = _moe_ids(torch, "random", T, E, k, dev, g)
    wts = torch.rand(T, k, device=dev, generator=g)
    impl = _moe_impl(torch, be, dev)
    note = lambda ms: f"{flops / ms / 1e9 / peak:.0%} of the bf16 peak {peak:.0f} TFLOP/s" if ms and peak else ""  # noqa
    fused_ms = timed(timer, group, f"{be} fused_moe_fwd", lambda: impl["fwd"](x, wgu, wd, wts, ids), flops=flops)
    if fused_ms:
        RESULTS["timings"][-1]["note"] = note(fused_ms)
        log(f"    {be}: {note(fused_ms)}")
    if be == "cpp":
        old = os.environ.get("GLM5_MOE_GEMM")
        os.environ["GLM5_MOE_GEMM"] = "loop"
        try:
            timed(timer, group, "cpp fused_moe_fwd [GEMM loop]", lambda: impl["fwd"](x, wgu, wd, wts, ids),
                  flops=flops)
        finally:
            os.environ.pop("GLM5_MOE_GEMM")
            if old is not None:
                os.environ["GLM5_MOE_GEMM"] = old
        xs, offs, _, ts = impl["dispatch"](x, ids, E, 1)
        y = torch.empty_like(xs).normal_()
        dc_ms = timed(timer, group, "cpp dispatch + combine", lambda: (impl["dispatch"](x, ids, E, 1),
                                                                       impl["combine"](y, ts, wts)))
        # Baselines: torch's grouped GEMM on pre-sorted rows (the GEMM ceiling reachable
        # without fusion), and the HF-style per-expert loop in bf16.
        if hasattr(torch, "_grouped_mm"):
            ends = offs[1:].contiguous()

            def grouped():
                gu = torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends)
                h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
                return torch._grouped_mm(h, wd.transpose(1, 2), offs=ends)
            timed(timer, group, "torch._grouped_mm x2 + silu (GEMMs only, sorted rows)", grouped, flops=flops)
        counts = torch.bincount(ids.flatten().long(), minlength=E).tolist()

        def loop():
            out = torch.zeros(T, D, device=dev, dtype=torch.bfloat16)
            flat = ids.flatten().long()
            order = flat.argsort(stable=True)
            s = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                p = order[s:s + n]
                s += n
                tok = p // k
                gate, up = (x[tok] @ wgu[e].T).chunk(2, dim=-1)
                yv = (torch.nn.functional.silu(gate) * up) @ wd[e].T
                out.index_add_(0, tok, (yv * wts.flatten()[p, None]).to(out.dtype))
            return out
        timed(timer, group, "torch per-expert loop (HF GlmMoeDsaExperts style, bf16)", loop, flops=flops)
    else:
        tm = impl["tm"]
        cfg = tm._config(torch.bfloat16, False, T * k / E)
        y = torch.randn(T * k, D, device=dev, dtype=torch.bfloat16)
        dc_ms = timed(timer, group, "triton align + combine",
                      lambda: (tm._Plan(ids, E, cfg["BLOCK_M"]), tm._combine(y, wts, T, k, D, torch.bfloat16)))
    if fused_ms and dc_ms:
        share = dc_ms / fused_ms
        record_check(f"perf target/{be}: dispatch+combine share <= 10% of fused_moe fwd", share <= 0.10,
                     f"{share:.1%} ({dc_ms:.2f} of {fused_ms:.2f} ms)")
    if fused_ms and peak:
        frac = flops / fused_ms / 1e9 / peak
        record_check(f"perf target/{be}: fused_moe fwd >= 50% of bf16 matmul peak", frac >= 0.5,
                     f"{frac:.0%} ({flops / fused_ms / 1e9:.0f} of {peak:.0f} TFLOP/s)")
    # Full-size correctness: one row block against a float32 oracle on the same rows.
    if not quick:
        def full_check():
            from glm5_ops import reference
            out = impl["fwd"](x, wgu, wd, wts, ids)
            rows = slice(0, 64)
            ref = reference.fused_moe(x[rows], wgu, wd, wts[rows], ids[rows])
            err = _moe_rel(out[rows], ref)
            return err <= 1e-2, f"rel err {err:.1e} on 64 rows vs the reference (bf16 in, fp32 math)"
        run_check(f"fused_moe/{be}: bench shape {T}x{D}, E={E}, k={k}", full_check)
    del x, wgu, wd
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- quantize (issue 5)
# quantize_groupwise / dequantize of every backend against glm5_ops.reference:
# scale and zero bit-exact, codes off by one only at rounding ties, dequantize
# within 2 ulp; stochastic rounding within one code of v and bit-identical
# across backends (one counter-based hash), including the seeds whose key is 0
# and 1 (a key equal to 1 once compiled as a Triton constexpr). Timed in the
# "timings" section against the measured device-to-device copy bandwidth.

# (bits, group_size, dtype): every width, power-of-two and odd groups, GLM-5's
# hidden size as one group (the one-group-per-program path); a few compiles each.
QUANT_CASES = [(8, 128, "float32"), (4, 128, "float32"), (2, 128, "float32"), (4, 32, "bfloat16"),
               (8, 256, "float16"), (2, 96, "bfloat16"), (4, 6144, "bfloat16"), (8, 64, "float16")]
QUANT_SEEDS = [33350994, 3343701148, 42]   # seed_key 0, seed_key 1, an ordinary one
QUANT_BENCH = (16384, 6144)                # bf16 activations: one 16K-token batch at GLM-5's hidden size


def quantize_checks(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    with _Poisoned(torch):
        _quantize_checks(torch, glm5_ops, backends, quick, dev)


def _quantize_codes(torch, packed, bits):
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    return ((packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1).long()


def _quantize_checks(torch, glm5_ops, backends, quick, dev):
    from glm5_ops import reference
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    g = _generator(torch, dev)
    cases = QUANT_CASES[:4] + QUANT_CASES[6:7] if quick else QUANT_CASES
    for be in backends:
        for bits, gs, dn in cases:
            dtype = getattr(torch, dn)
            if _interpreted(be, dev) and dtype == torch.bfloat16:
                dtype, dn = torch.float16, "float16"
            rows = max(4, 8192 // gs)

            def make(gs=gs, dtype=dtype, rows=rows):
                x = (torch.randn(rows, 2 * gs, device=dev, generator=g) * 3).to(dtype)
                x[0, :gs] = 1.5                                  # a constant group: scale 0, codes 0
                x[1, 3] = 1e4                                    # one outlier: a wide group
                return x

            def det(bits=bits, gs=gs, dtype=dtype, be=be, make=make):
                x = make()
                with glm5_ops.use_backend(be):
                    packed, scale, zero = glm5_ops.quantize_groupwise(x, bits, gs)
                    y = glm5_ops.dequantize(packed, scale, zero, bits, gs, x.shape, dtype=dtype)
                sync()
                rp, rs, rz = reference.quantize_groupwise(x, bits, gs)
                if packed.dtype != torch.uint8 or packed.shape != rp.shape or scale.shape != rs.shape:
                    return False, f"got {packed.dtype}{tuple(packed.shape)} scale {tuple(scale.shape)}"
                if not (torch.equal(scale, rs) and torch.equal(zero, rz)):
                    n = int((scale != rs).sum() + (zero != rz).sum())
                    return False, f"scale/zero differ from the reference in {n} groups"
                diff = (_quantize_codes(torch, packed, bits) - _quantize_codes(torch, rp, bits)).abs()
                ties = (diff > 0).float().mean().item()
                if diff.max().item() > 1 or ties > 1e-3:
                    return False, f"codes differ by up to {diff.max().item()} ({ties:.1e} of them)"
                # dequantize of the same codes: zero + q * scale in fp32 within 2 ulp of the
                # group's largest term (an FMA may fuse it), then one rounding to the output dtype
                ry = reference.dequantize(packed, scale, zero, bits, gs, x.shape, dtype)
                if y.dtype != dtype or y.shape != x.shape or not torch.isfinite(y).all():
                    return False, f"dequantize: {y.dtype} {tuple(y.shape)} or non-finite entries"
                mag = (zero.abs() + scale * ((1 << bits) - 1)).repeat_interleave(gs).reshape(x.shape)
                out_eps = 0.0 if dtype == torch.float32 else (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
                bound = 2 ** -22 * mag + out_eps * ry.float().abs() + 1e-30
                err = ((y.float() - ry.float()).abs() / bound).max().item()
                return err <= 1, (f"codes off by one at {ties:.1e} (ties); dequantize within {err:.2f} of its "
                                  "bound (2 ulp of the group's range + 1 ulp of the output dtype)")

            def stoch(bits=bits, gs=gs, dtype=dtype, be=be, make=make):
                x = make()
                rp, rs, rz = reference.quantize_groupwise(x, bits, gs)
                v = ((x.float().reshape(-1, gs) - rz[:, None]) / torch.where(rs > 0, rs, 1)[:, None]).reshape(-1)
                msgs = []
                for seed in QUANT_SEEDS:
                    with glm5_ops.use_backend(be):
                        packed, scale, zero = glm5_ops.quantize_groupwise(x, bits, gs, stochastic=True, seed=seed)
                    sync()
                    if not (torch.equal(scale, rs) and torch.equal(zero, rz)):
                        return False, f"seed {seed}: scale/zero differ from the deterministic ones"
                    q = _quantize_codes(torch, packed, bits).float()
                    off = (q - v).abs().max().item()
                    if off >= 1 + 1e-3:
                        return False, f"seed {seed}: a code {off:.3f} away from v (stochastic rounding stays within 1)"
                    if be != "cpp":   # same hash as the C++/CUDA kernels: the same codes
                        try:
                            with glm5_ops.use_backend("cpp"):
                                cp = glm5_ops.quantize_groupwise(x, bits, gs, stochastic=True, seed=seed)[0]
                            sync()
                        except (NotImplementedError, RuntimeError, ImportError) as e:
                            msgs.append(f"no cpp result to compare ({type(e).__name__})")
                            continue
                        if not torch.equal(cp, packed):
                            return False, f"seed {seed}: codes differ from the cpp backend's (same hash)"
                        msgs.append(f"seed {seed} = cpp")
                return True, "within one code of v" + (f"; {', '.join(msgs)}" if msgs else "")

            tag = f"{dn} bits={bits} group={gs} x[{rows},{2 * gs}]"
            run_check(f"quantize/{be}: {tag}", det)
            run_check(f"quantize/{be}: stochastic {tag}", stoch)


def _bw_note(ms, nbytes, bw):
    if ms and bw:
        note = f"{nbytes / ms / 1e6 / bw:.0%} of the measured copy bandwidth {bw:.0f} GB/s"
        RESULTS["timings"][-1]["note"] = note
        log(f"    {note}")


def quantize_timings(torch, glm5_ops, backends, quick, timer):
    """quantize_groupwise and dequantize of a bf16 [16384, 6144] activation (201 MB)
    against the measured device-to-device copy bandwidth (read + write)."""
    dev = "cuda"
    src = torch.empty(256 * 2 ** 20, dtype=torch.float32, device=dev)   # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = timed(timer, "memory bandwidth (1 GiB copy)", "torch copy_", lambda: dst.copy_(src),
                    nbytes=2 * src.numel() * 4)
    del src, dst
    bw = 2 * 2 ** 30 / copy_ms / 1e6 if copy_ms else None   # GB/s
    R, C = QUANT_BENCH
    x = torch.randn(R, C, device=dev).bfloat16()
    n = x.numel()
    for bits in ([8, 4] if quick else [8, 4, 2]):
        gs = 128
        G = n // gs
        qbytes = n * 2 + n * bits // 8 + G * 8             # read x, write codes + scale + zero
        group = f"quantize bf16 [{R},{C}] bits={bits} group={gs}"
        for be in backends:
            def fq(be=be, bits=bits):
                with glm5_ops.use_backend(be):
                    return glm5_ops.quantize_groupwise(x, bits, gs)
            _bw_note(timed(timer, group, f"{be} quantize_groupwise", fq, nbytes=qbytes), qbytes, bw)
            with glm5_ops.use_backend(be):
                packed, scale, zero = glm5_ops.quantize_groupwise(x, bits, gs)

            def fd(be=be, bits=bits, packed=packed, scale=scale, zero=zero):
                with glm5_ops.use_backend(be):
                    return glm5_ops.dequantize(packed, scale, zero, bits, gs, x.shape, dtype=torch.bfloat16)
            _bw_note(timed(timer, group, f"{be} dequantize", fd, nbytes=qbytes), qbytes, bw)
            del packed, scale, zero
    del x
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- section registry
# family -> fn(torch, glm5_ops, backends, quick, dev, dtypes), its kind, whether it
# is split into one section per dtype, a weight (longest first: Triton compiles),
# and the prefixes of its check / timing names (for --only).

def _timing_fn(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    timings(torch, glm5_ops, backends, quick)


def _moe_timing_fn(torch, glm5_ops, backends, quick, dev="cuda", dtypes=None):
    moe_timing_section(torch, glm5_ops, backends, quick, dev)


FAMILIES = {
    "attention-sparse": dict(fn=sparse_attention_checks, kind="check", split=True, weight=10,
                             prefixes=["attention.sparse_fwd/", "attention.sparse_bwd/"]),
    "attention-block": dict(fn=block_attention_checks, kind="check", split=True, weight=9,
                            prefixes=["attention.block_fwd/", "attention.block_bwd/"]),
    "moe-fused": dict(fn=moe_fused_checks, kind="check", split=True, weight=9, prefixes=["fused_moe/"]),
    "indexer": dict(fn=indexer_checks, kind="check", split=True, weight=6,
                    prefixes=["indexer_scores/", "indexer_topk/"]),
    "attention-mask": dict(fn=block_mask_checks, kind="check", weight=6, prefixes=["attention.block_topk_mask/"]),
    "topk": dict(fn=topk_checks, kind="check", weight=4, prefixes=["topk_indices/"]),
    "quantize": dict(fn=quantize_checks, kind="check", weight=4, prefixes=["quantize/"]),
    "moe-route": dict(fn=moe_route_checks, kind="check", weight=3,
                      prefixes=["moe_route/", "moe_dispatch+combine/", "fused_moe_fwd/"]),
    "timings": dict(fn=_timing_fn, kind="timing",
                    prefixes=["topk fp32", "indexer bf16", "indexer_topk/", "indexer_scores/", "quantize bf16",
                              "memory bandwidth", "attention sparse", "attention block-sparse"]),
    "moe-timings": dict(fn=_moe_timing_fn, kind="timing",
                        prefixes=["fused_moe fwd", "bf16 matmul peak", "perf target/", "fused_moe/"]),
}



if __name__ == "__main__":
    main()
