"""Weights on transparent huge pages against 4 KiB pages, in one process (glm5_ops/memory.py).

    python bench/huge_pages_ab.py                       # small preset, random weights, compiled decode
    python bench/huge_pages_ab.py --ckpt DIR --eager    # a checkpoint; eager decode steps

1. GEMV: one LM-head-sized fp32 product [vocab x hidden] from each placement, cold
   (two other copies read in between), alternating calls: GB/s of each.
2. Decode: two copies of the model, one built with GLM5_HUGE_PAGES=0 (weights and
   cache on torch's allocator: 4 KiB pages) and one as the lab builds it (on huge
   pages), each with its own cache at depth 1, decoding in alternating blocks of
   --steps tokens (the order flips every block): tokens/s of each, the median ratio
   and how many blocks huge pages won. Both models compile (--eager to skip) first.
The host's bandwidth drifts within minutes, so only the alternating figures compare.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm5_ops  # noqa: E402
from glm5_ops.memory import huge_pages_enabled, on_huge_pages  # noqa: E402
from models.glm5 import GLM5ForCausalLM, preset  # noqa: E402


def anon_huge_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")) / 1024


@contextlib.contextmanager
def pages(huge: bool):
    """GLM5_HUGE_PAGES set for the block (what is built in it is placed or not), then restored."""
    before = os.environ.get("GLM5_HUGE_PAGES")
    os.environ["GLM5_HUGE_PAGES"] = "1" if huge else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLM5_HUGE_PAGES"]
        else:
            os.environ["GLM5_HUGE_PAGES"] = before


def build(a, huge: bool) -> GLM5ForCausalLM:
    with pages(huge):
        if a.ckpt:
            return GLM5ForCausalLM.from_pretrained(a.ckpt, verbose=False).eval()
        torch.manual_seed(0)
        return GLM5ForCausalLM(preset(a.preset)).eval()


def bench_gemv(model, rounds: int) -> None:
    w4k = model.lm_head.weight.detach().clone()
    wh = on_huge_pages(w4k)
    others = [w4k.clone() for _ in range(2)]
    x = torch.randn(1, w4k.shape[1])
    assert torch.equal(glm5_ops.gemv(x, w4k), glm5_ops.gemv(x, wh))

    def cold(w):
        ts = []
        for _ in range(5):
            for o in others:
                glm5_ops.gemv(x, o)
            t0 = time.perf_counter()
            glm5_ops.gemv(x, w)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    ratios = []
    for _ in range(rounds):
        t4, th = cold(w4k), cold(wh)
        ratios.append(t4 / th)
        print(f"  gemv {tuple(w4k.shape)}: 4 KiB pages {w4k.nbytes / t4 / 1e9:.1f} GB/s, "
              f"huge pages {w4k.nbytes / th / 1e9:.1f} GB/s", flush=True)
    print(f"gemv: huge pages {statistics.median(ratios):.3f}x (median of {rounds}), "
          f"faster in {sum(r > 1 for r in ratios)}/{rounds}\n", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="a checkpoint directory (default: the preset, random weights)")
    p.add_argument("--preset", default="small")
    p.add_argument("--eager", action="store_true", help="decode without compile_decode()")
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=60, help="tokens per block")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if not huge_pages_enabled():
        sys.exit("transparent huge pages are off here (transparent_hugepage 'never' or GLM5_HUGE_PAGES=0)")
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'eager' if a.eager else 'compiled'} decode, {a.ckpt or a.preset}", flush=True)
    before = anon_huge_mib()
    models = {"4k": build(a, huge=False), "huge": build(a, huge=True)}
    print(f"huge pages in use: {anon_huge_mib() - before:.0f} MiB more after building both", flush=True)
    bench_gemv(models["4k"], rounds=a.blocks)
    vocab = models["4k"].config.vocab_size
    ids = [torch.tensor([[t]]) for t in torch.randint(0, vocab, (a.steps,)).tolist()]
    tok_s = {n: [] for n in models}
    with torch.inference_mode():
        caches = {}
        for n, m in models.items():
            with pages(n == "huge"):
                caches[n] = m.new_cache(1, a.blocks * a.steps + 16)
            m.prefill(torch.randint(0, vocab, (1, 1)), caches[n])
            if not a.eager:
                t0 = time.perf_counter()
                m.compile_decode()
                for x in ids[:3]:            # compiles; the second length makes it dynamic
                    m(x, caches[n])
                print(f"{n}: compiled in {time.perf_counter() - t0:.0f} s", flush=True)
        for block in range(a.blocks):
            for n in (("4k", "huge") if block % 2 == 0 else ("huge", "4k")):
                t0 = time.perf_counter()
                for x in ids:
                    models[n](x, caches[n])
                tok_s[n].append(a.steps / (time.perf_counter() - t0))
            print(f"  block {block}: 4 KiB pages {tok_s['4k'][-1]:.1f} tok/s, huge pages {tok_s['huge'][-1]:.1f}",
                  flush=True)
    r = [h / s for s, h in zip(tok_s["4k"], tok_s["huge"])]
    print(f"decode: 4 KiB pages {statistics.median(tok_s['4k']):.1f} tok/s, huge pages "
          f"{statistics.median(tok_s['huge']):.1f} (medians of {a.blocks} blocks); huge/4k "
          f"{statistics.median(r):.3f}x, faster in {sum(x > 1 for x in r)}/{a.blocks}")


if __name__ == "__main__":
    main()
