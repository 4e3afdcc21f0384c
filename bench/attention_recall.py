"""How much of dense attention a sparse selection keeps: recall (the softmax
mass the selected keys carry) and the output's relative error, at 1%, 5% and
10% density, for token-level selection (DSA) and block selection.

    python bench/attention_recall.py [--source structured|byte_lm|glm5|both] [--seq 2048]

Selections compared, each at the same density (selected keys / T, causal):
  oracle top-k     the topk keys by exact attention probability averaged over
                   heads (the best shared selection: an upper bound)
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
sources; and "glm5": a GLM-5-architecture byte LM (models/glm5: MLA, DSA
indexer, MoE) pretrained with dense attention, whose own lightning indexer is
measured before and after DSA's dense warm-up (training/indexer_warmup.py).
Prints a markdown table; results go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
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
    """Per query, the topk keys by attention probability averaged over heads:
    recall is that average summed over the chosen keys, so this is the best
    selection shared by all heads (as DSA's is), an upper bound for any
    token-level predictor. (Ranking by the heads' summed scores instead, as
    an earlier version did, is not: warmed-up indexers beat it.)"""
    from training.indexer_warmup import attention_distribution

    S, T = q.shape[1], k.shape[1]
    causal = torch.ones(S, T, dtype=torch.bool).tril(T - S)
    probs = attention_distribution(q, k, scale)   # what the warm-up teaches the indexer
    return glm5_ops.topk_indices(probs.masked_fill(~causal, float("-inf")), topk)


def glm5_inputs(S: int, steps: int, warmup_steps: int, sparse_steps: int = 0, seed: int = 0):
    """Per layer of a GLM-5-architecture byte LM (training/indexer_warmup.py)
    pretrained `steps` steps at seq_len S with dense attention: (q, k, v) per
    head on a held-out sequence, its scale, and its own indexer's top-k before
    and after DSA's dense warm-up (`warmup_steps` steps of KL to the attention);
    and the held-out next-byte loss with dense, block-sparse and DSA attention,
    also after `sparse_steps` steps of training under DSA at 5% (the second stage)."""
    from training.indexer_warmup import (attention_inputs, byte_glm5, head_qkv, held_out_loss, pretrain,
                                         sparse_train, warm_up_indexer)
    from training.train import load_corpus

    corpus = load_corpus(9 << 20)
    train, held_out = corpus[:8 << 20], corpus[8 << 20:]
    model = byte_glm5(S, seed)
    pretrain(model, train, steps=steps, seq_len=S, seed=seed)
    ids = held_out[None, :S].long()
    with torch.no_grad():
        layers = [(attn, *head_qkv(attn, x, cos, sin), x, cos, sin) for attn, x, cos, sin in attention_inputs(model, ids)]

    @torch.no_grad()
    def indexer_inputs():
        return [(attn.indexer.query(x, q_resid, cos, sin), attn.indexer.key(x, cos, sin))
                for attn, _, _, _, q_resid, x, cos, sin in layers]

    rows = held_out[:4 * (S + 1)].long().view(4, S + 1)   # 4 held-out windows for the loss
    losses = [("dense", "100%", held_out_loss(model, rows, "dense"))]
    losses += [("block_sparse (mean pooling, 16-token blocks)", f"{d:.0%}", held_out_loss(model, rows, "block_sparse", d))
               for d in DENSITIES[1:]]
    losses += [("dsa, untrained indexer", f"{d:.0%}", held_out_loss(model, rows, "dsa", d)) for d in DENSITIES]
    before = indexer_inputs()
    warm_up_indexer(model, train, steps=warmup_steps, seq_len=S, seed=seed + 1)
    after = indexer_inputs()
    losses += [("dsa, indexer after warm-up", f"{d:.0%}", held_out_loss(model, rows, "dsa", d)) for d in DENSITIES]
    if sparse_steps:   # the second stage, against the same steps of dense training (same batches and lr)
        control = copy.deepcopy(model)
        pretrain(control, train, steps=sparse_steps, seq_len=S, lr=1e-3, seed=seed + 2)
        sparse_train(model, train, steps=sparse_steps, seq_len=S, density=0.05, lr=1e-3, seed=seed + 2)
        for how, m in (("dense", control), ("under dsa at 5%", model)):
            losses.append((f"+{sparse_steps} steps {how}: dense attention", "100%", held_out_loss(m, rows, "dense")))
            losses += [(f"+{sparse_steps} steps {how}: dsa", f"{d:.0%}", held_out_loss(m, rows, "dsa", d))
                       for d in DENSITIES[1:]]
    out = []
    for (attn, q, k, v, *_), ((qb, wb), kb), ((qa, wa), ka) in zip(layers, before, after):
        selections = {
            "GLM-5 indexer, untrained": lambda topk, qi=qb, wi=wb, ki=kb: glm5_ops.indexer_topk(qi, wi, ki, topk),
            "GLM-5 indexer, after warm-up": lambda topk, qi=qa, wi=wa, ki=ka: glm5_ops.indexer_topk(qi, wi, ki, topk),
        }
        out.append((q, k, v, attn.scale, selections))
    return out, losses


def rows_for(name: str, q, k, v, scale: float | None = None, selectors: dict | None = None):
    """Recall rows at each density; selectors: extra {name: topk -> selection}."""
    S, D = q.shape[1], q.shape[3]
    scale = D ** -0.5 if scale is None else scale
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
        sels.update({sel_name: select(topk) for sel_name, select in (selectors or {}).items()})
        for sel_name, sel in sels.items():
            r = glm5_ops.attention_recall(q, k, v, sel, scale=scale)
            out.append((name, f"{dens:.0%}", sel_name, r.mean_recall, float(r.rel_err.median()), r.output_rel_err))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("structured", "byte_lm", "glm5", "both"), default="both",
                    help="both = structured and byte_lm")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=300, help="byte LM / byte GLM-5 training steps")
    ap.add_argument("--warmup-steps", type=int, default=100, help="glm5: indexer warm-up steps (KL)")
    ap.add_argument("--sparse-steps", type=int, default=100,
                    help="glm5: then steps of training under DSA at 5%% (0: skip)")
    args = ap.parse_args(argv)
    rows = []
    if args.source in ("structured", "both"):
        print("structured inputs ...", flush=True)
        rows += rows_for(f"structured S={args.seq}", *structured_inputs(args.seq))
    if args.source in ("byte_lm", "both"):
        print(f"training the byte LM at seq_len {args.seq} for {args.steps} steps ...", flush=True)
        for i, (q, k, v) in enumerate(byte_lm_inputs(args.seq, args.steps)):
            rows += rows_for(f"byte_lm layer {i}", q, k, v)
    if args.source == "glm5":
        print(f"training a byte-level GLM-5 at seq_len {args.seq} for {args.steps} steps, then warming up "
              f"its indexer for {args.warmup_steps} ...", flush=True)
        layers, losses = glm5_inputs(args.seq, args.steps, args.warmup_steps, args.sparse_steps)
        for i, (q, k, v, scale, selectors) in enumerate(layers):
            rows += rows_for(f"glm5 layer {i}", q, k, v, scale, selectors)
        print("\n| attention | density | held-out loss (nats/byte) |\n|---|---|---|")
        for name, dens, loss in losses:
            print(f"| {name} | {dens} | {loss:.4f} |")
    print("\n| inputs | density | selection | mean recall | median rel err | output rel err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} |")


if __name__ == "__main__":
    main()
