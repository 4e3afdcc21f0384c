"""How much of dense attention a sparse selection keeps: recall (the softmax
mass the selected keys carry) and the output's relative error, at 1%, 5% and
10% density, for token-level selection (DSA) and block selection.

    python bench/attention_recall.py [--source structured|byte_lm|both] [--seq 2048]

Selections compared, each at the same density (selected keys / T, causal):
  oracle top-k     the topk keys of the exact attention scores (the best any
                   token-level predictor can do; upper bound)
  indexer top-k    glm5_ops.indexer_topk in the lightning indexer's form with
                   nothing learned: the attention's query heads against one
                   shared key per token (mean over kv heads), relu, unit weights
  block (mean)     glm5_ops.block_topk_mask, block_size 16, mean pooling (MoBA);
                   of the n = density * Kb blocks, one is the local (diagonal)
                   block and, from n >= 3, one the sink
  block (minmax)   the same with Quest's min/max bound
Sources: "structured" random inputs (keys drawn from 32 topics in runs of
tokens, queries near a topic seen earlier, plus a recency bias; deterministic),
and "byte_lm": q, k, v of every layer of the lab's byte-level LM
(training/byte_lm.py) after a short training run on the Python stdlib
sources (the GLM-5 model of issue 6 replaces it when it lands).
Prints a markdown table; results go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import glm5_ops  # noqa: E402

DENSITIES = (0.01, 0.05, 0.10)


def structured_inputs(S: int, H: int = 4, D: int = 64, topics: int = 32, seed: int = 0):
    """q, k, v [1,S,H,D] with topic structure in runs and a recency bias."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(topics, H, D, generator=g)
    run = 48
    seg_topic = torch.randint(0, topics, (S // run + 1,), generator=g)
    topic = seg_topic.repeat_interleave(run)[:S]
    k = 1.5 * centers[topic] + torch.randn(S, H, D, generator=g)
    # each query looks for the topic of a random earlier (mostly recent) segment
    back = (torch.rand(S, generator=g) ** 3 * torch.arange(S)).long()
    want = topic[torch.arange(S) - back]
    q = 1.5 * centers[want] + torch.randn(S, H, D, generator=g)
    v = torch.randn(S, H, D, generator=g)
    return q[None], k[None], v[None]


def byte_lm_inputs(S: int, steps: int = 300, seed: int = 0):
    """q, k, v of each layer of a byte LM trained for `steps` steps at seq_len S."""
    from training.byte_lm import ByteLM, ByteLMConfig
    from training.train import batch, load_corpus

    torch.manual_seed(seed)
    cfg = ByteLMConfig(seq_len=S)
    model = ByteLM(cfg)
    data = load_corpus(8 << 20)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.time()
    for step in range(steps):
        x, y = batch(data, 4, S, gen)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  byte_lm step {step:4d}  loss {loss.item():.3f}  ({time.time() - t0:.0f} s)", flush=True)
    captured = []

    def hook(mod, args, _out):
        x = args[0]
        B, L, Dm = x.shape
        q, k, v = mod.qkv(x).view(B, L, 3, mod.n_heads, Dm // mod.n_heads).unbind(2)
        captured.append((q.detach(), k.detach(), v.detach()))

    handles = [blk.attn.register_forward_hook(hook) for blk in model.blocks]
    with torch.no_grad():
        x, y = batch(data, 1, S, gen)
        model(x, y)
    for h in handles:
        h.remove()
    return captured


def indexer_selection(q, k, topk: int):
    """glm5_ops.indexer_topk with the attention's own query heads against one
    shared key per token (the mean of the kv heads), relu scores, unit head
    weights: the lightning indexer's form with nothing learned."""
    B, S, H, D = q.shape
    return glm5_ops.indexer_topk(q, torch.ones(B, S, H), k.mean(2), topk)


def oracle_selection(q, k, topk: int, scale: float):
    """Per query, the topk keys by exact score summed over heads (shared by all heads, as DSA's are)."""
    B, S, H, D = q.shape
    scores = torch.einsum("bshd,bthd->bst", q, k) * scale
    causal = torch.ones(S, k.shape[1], dtype=torch.bool).tril(k.shape[1] - S)
    return glm5_ops.topk_indices(scores.masked_fill(~causal, float("-inf")), topk)


def rows_for(name: str, q, k, v):
    S, D = q.shape[1], q.shape[3]
    scale = D ** -0.5
    out = []
    for dens in DENSITIES:
        topk = max(1, round(dens * S))
        bs = 16
        nb = max(1, round(dens * -(-S // bs)))
        blocks = dict(block_size=bs, local_blocks=1, sink_blocks=1 if nb >= 3 else 0)
        blocks["topk_blocks"] = nb - 1 - blocks["sink_blocks"]
        sels = {
            "oracle top-k": oracle_selection(q, k, topk, scale),
            "indexer top-k": indexer_selection(q, k, topk),
            "block (mean)": glm5_ops.block_topk_mask(q, k, **blocks),
            "block (minmax)": glm5_ops.block_topk_mask(q, k, pooling="minmax", **blocks),
        }
        for sel_name, sel in sels.items():
            r = glm5_ops.attention_recall(q, k, v, sel, scale=scale)
            out.append((name, f"{dens:.0%}", sel_name, r.mean_recall, float(r.rel_err.median()), r.output_rel_err))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("structured", "byte_lm", "both"), default="both")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=300, help="byte LM training steps")
    args = ap.parse_args(argv)
    rows = []
    if args.source in ("structured", "both"):
        print("structured inputs ...", flush=True)
        rows += rows_for(f"structured S={args.seq}", *structured_inputs(args.seq))
    if args.source in ("byte_lm", "both"):
        print(f"training the byte LM at seq_len {args.seq} for {args.steps} steps ...", flush=True)
        for i, (q, k, v) in enumerate(byte_lm_inputs(args.seq, args.steps)):
            rows += rows_for(f"byte_lm layer {i}", q, k, v)
    print("\n| inputs | density | selection | mean recall | median rel err | output rel err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} |")


if __name__ == "__main__":
    main()
