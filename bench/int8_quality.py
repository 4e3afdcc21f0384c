"""Held-out loss of a trained byte-level GLM-5 (the stdlib's .py sources), fp32
against int8 weight-only and W8A8, with and without DEFAULT_SKIP (torchao on the
same model: bench/int8_torchao.py).

    python bench/int8_quality.py --steps 400 --out runs/int8_quality.json

Trains training.indexer_warmup.byte_glm5 (MLA, MoE, dense attention) with its
pretrain() on the first 95% of the corpus, or loads --load (a state dict this
script saved), then evaluates fixed held-out rows from the last 5% (other files).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.glm5 import quantize  # noqa: E402
from training.indexer_warmup import byte_glm5, pretrain  # noqa: E402
from training.train import batch, load_corpus  # noqa: E402


def log(msg):
    print(f"[int8-quality] {msg}", flush=True)


@torch.no_grad()
def loss_of(model, rows) -> float:
    total = 0.0
    for r in rows.split(8):
        logits = model.eval()(r[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), r[:, 1:].flatten(), reduction="sum").item()
    return total / (rows.shape[0] * (rows.shape[1] - 1))


def add_model_args(p):
    """The trained model's and held-out set's options (shared with bench/int8_torchao.py)."""
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--corpus-mib", type=float, default=8.0)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--load", default=None, help="a state dict this script saved: skips the training")
    p.add_argument("--save", default="runs/int8_quality/model.pt")


def trained_model_and_rows(a):
    """(the byte-level GLM-5, trained or loaded, fp32; held-out rows [eval_rows, seq+1] from other files)."""
    data = load_corpus(int(a.corpus_mib * 2**20))
    split = int(data.numel() * 0.95)
    train, val = data[:split], data[split:]
    model = byte_glm5(seq_len=a.seq)
    if a.load:
        model.load_state_dict(torch.load(a.load))
        log(f"loaded {a.load}")
    else:
        t0 = time.time()
        pretrain(model, train, steps=a.steps, seq_len=a.seq, batch_size=a.batch)
        log(f"trained {a.steps} steps in {time.time() - t0:.0f} s")
        Path(a.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), a.save)
    x, y = batch(val, a.eval_rows, a.seq, torch.Generator().manual_seed(123))
    return model.eval(), torch.cat([x, y[:, -1:]], dim=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model, rows = trained_model_and_rows(a)
    res = {"fp32": loss_of(model, rows)}
    log(f"fp32 held-out loss {res['fp32']:.4f} nats/byte ({a.eval_rows} rows x {a.seq} bytes)")
    for mode in ("int8_weight_only", "w8a8"):
        for label, skip in (("default skip", None), ("skip=()", ())):
            m = quantize(copy.deepcopy(model), mode, skip)
            res[f"{mode}, {label}"] = loss_of(m, rows)
    lines = ["| model | held-out loss (nats/byte) | vs fp32 |", "|---|---|---|"]
    for k, v in res.items():
        lines.append(f"| {k} | {v:.4f} | {100 * (v / res['fp32'] - 1):+.3f}% |")
    print("\n".join(lines), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "loss": res}, indent=1))
    return res


if __name__ == "__main__":
    main()
