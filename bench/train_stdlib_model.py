"""Issue 21 item 6: the model `glm5-lab train` trained on the standard library.

    python bench/train_stdlib_model.py runs/stdlib-tiny --png bench/figures/train_stdlib_tiny.png

Reads RUN/metrics.jsonl and RUN/checkpoint: draws the training curve (each
step's loss and its 25-step mean, the held-out loss as a line) and loads
the checkpoint three ways, on held-out stdlib bytes (the same last 5% of
the corpus `glm5-lab train` held out): GLM5ForCausalLM.from_pretrained,
transformers' GlmMoeDsaForCausalLM.from_pretrained (max |logit difference|,
both losses) and the serving Engine (greedy continuation against greedy
decoding with the full forward of either model).

The free-running logit difference is not a parity figure: where fewer than
index_topk keys score above zero (the indexer's relu), the k-th and
(k+1)-th scores are both exactly 0 and top-k may keep any of the tied keys;
torch.topk and our kernel keep different ones, and the attention output
(and every later position through later layers) moves with that choice.
So the parity figures are taken where the selection cannot differ: with
transformers' indexer made to return our selection, and on windows of
index_topk tokens (every causal key selected). Both should be within the
parity tests' tolerance, 1e-4 of the largest logit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plot(metrics: str, png: str) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics)]
    steps = [r for r in rows if "step" in r]
    held = next((r["held_out_loss"] for r in rows if "held_out_loss" in r), None)
    x, y = [r["step"] for r in steps], [r["loss"] for r in steps]
    w = 25
    mean = [sum(y[max(0, i - w + 1):i + 1]) / len(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(x, y, lw=0.5, alpha=0.4, label="train loss (per step)")
    ax.plot(x, mean, lw=1.5, label=f"train loss ({w}-step mean)")
    if held is not None:
        ax.axhline(held, color="k", ls="--", lw=1, label=f"held-out loss {held:.3f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross entropy (nats / byte)")
    ax.set_title("glm5-lab train: tiny GLM-5 (DSA) on the stdlib, 4 gloo processes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    return dict(steps=len(steps), first_loss=y[0], last25_mean=mean[-1], held_out_loss=held,
                tokens_per_s_median=sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2])


@torch.no_grad()
def selection_parity(ours, hf, x: torch.Tensor) -> dict:
    """Where ours and transformers can differ only by the indexer's top-k tie-break:
    - selections_differ: (layer, row, position) triples whose selected key sets
      differ in a free run of both models;
    - selections_differ_at_exact_ties: those where our indexer's k-th and
      (k+1)-th scores are equal (the set is ambiguous), tied_positions: how
      many such boundaries our scores have in all, and
      selections_differ_otherwise: those neither tied nor downstream of an
      earlier difference (a difference at layer i', position s' <= s, i' < i,
      changes layer i's input at s); 0 when the tie-break explains them all;
    - max_abs_logit_diff_same_selection: transformers with each indexer
      returning our selection for that layer;
    - max_abs_logit_diff_topk_windows: both on windows of index_topk tokens."""
    import glm5_ops
    k = ours.config.index_topk
    captured, theirs, handles = {}, {}, []
    for i, (lo, lh) in enumerate(zip(ours.model.layers, hf.model.layers)):
        ix = lo.self_attn.indexer
        if ix is None or lh.self_attn.indexer is None:
            continue
        ix.key = (lambda *a, f=ix.key, i=i: captured.setdefault(("k", i), f(*a)))
        ix.query = (lambda *a, f=ix.query, i=i: captured.setdefault(("q", i), f(*a)))
        handles.append(lh.self_attn.indexer.register_forward_hook(
            lambda m, a, out, i=i: theirs.__setitem__(i, out.long())))
    ours.record = True
    try:
        mine = ours(x)
        hf(input_ids=x)
    finally:
        ours.record = False
        for h in handles:
            h.remove()
        for layer in ours.model.layers:
            if layer.self_attn.indexer is not None:
                vars(layer.self_attn.indexer).pop("key", None)
                vars(layer.self_attn.indexer).pop("query", None)
    B, S = x.shape
    differ = ties = tied = otherwise = 0
    first = torch.full((B,), S)                     # earliest differing position per row, earlier layers
    for i, sel in sorted(theirs.items()):
        first_here = first.clone()
        q, w = captured[("q", i)]
        scores = glm5_ops.indexer_scores(q, w, captured[("k", i)], causal=True)
        top = scores.topk(k + 1, dim=-1).values
        boundary_tie = (top[..., k - 1] == top[..., k]) & torch.isfinite(top[..., k])
        tied += int(boundary_tie.sum())
        ours_sel = ours.last_selection[i].long()
        for b in range(B):
            for s in range(S):
                if {t for t in ours_sel[b, s].tolist() if 0 <= t <= s} != {t for t in sel[b, s].tolist() if t <= s}:
                    differ += 1
                    ties += int(boundary_tie[b, s])
                    otherwise += int(not boundary_tie[b, s] and s < first[b])
                    first_here[b] = min(int(first_here[b]), s)
        first = first_here
    forced = {}
    for i, layer in enumerate(hf.model.layers):
        ix = layer.self_attn.indexer
        if ix is not None:
            sel = ours.last_selection[i].long()
            sel = torch.where(sel < 0, sel[..., :1], sel).to(torch.int32)   # -1 pads: repeat a chosen key
            ix.forward = (lambda *a, sel=sel, **kw: sel)
            forced[i] = ix
    try:
        same = float((mine - hf(input_ids=x).logits).abs().max())
    finally:
        for ix in forced.values():
            del ix.forward
    windows = max(float((ours(x[:, s:s + k]) - hf(input_ids=x[:, s:s + k]).logits).abs().max())
                  for s in range(0, S - k + 1, k))
    return dict(selections_differ=differ, selections_differ_at_exact_ties=ties, tied_positions=tied,
                selections_differ_otherwise=otherwise,
                max_abs_logit_diff_same_selection=same, max_abs_logit_diff_topk_windows=windows)


def _greedy(logits_of, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits_of(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def compare(ckpt: str, seq: int = 256, rows: int = 4, new_tokens: int = 48) -> dict:
    import transformers

    from models.glm5 import GLM5ForCausalLM
    from serving.engine import Engine
    from serving.params import SamplingParams
    from training.train import load_corpus
    data = load_corpus(8 * 2**20)
    held = data[int(data.numel() * 0.95):]
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, held.numel() - seq - 1, (rows,), generator=g)
    window = torch.stack([held[s:s + seq + 1] for s in starts.tolist()]).long()
    x, y = window[:, :-1], window[:, 1:]

    ours = GLM5ForCausalLM.from_pretrained(ckpt, verbose=False).eval()
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    lo, lh = ours(x), hf(input_ids=x).logits
    out = dict(max_abs_logit_diff=float((lo - lh).abs().max()), logit_scale=float(lh.abs().max()),
               loss_ours=float(F.cross_entropy(lo.flatten(0, 1), y.flatten())),
               loss_transformers=float(F.cross_entropy(lh.flatten(0, 1), y.flatten())))
    out.update(selection_parity(ours, hf, x))

    prompt = list(b"def __init__(self, ")
    engine = Engine(ours, kv_cache_memory="64MiB", log=False)
    served = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0),
                             use_tqdm=False)[0].outputs[0].token_ids
    by_ours = _greedy(ours, prompt, new_tokens)
    by_hf = _greedy(lambda t: hf(input_ids=t).logits, prompt, new_tokens)
    out.update(engine_equals_forward=served == by_ours, transformers_greedy_equals=by_hf == by_ours,
               continuation=bytes(prompt + served).decode("utf-8", "replace"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the --out directory of glm5-lab train")
    ap.add_argument("--png", default=None, help="where to draw the training curve")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    if args.png:
        print(json.dumps(plot(os.path.join(args.run, "metrics.jsonl"), args.png)))
    print(json.dumps(compare(os.path.join(args.run, "checkpoint")), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
