"""`glm5-lab inspect`: what a configuration costs, from arithmetic alone.

    glm5-lab inspect --preset glm-5
    glm5-lab inspect --preset seed-1.8t --context 4K,32K --context 128K --format text
    glm5-lab inspect --config path/to/config.json --claims

Prints parameters and active parameters, FLOPs per token against context
(DSA and dense attention, decode and prefill), KV + indexer cache bytes per
token and the indexer's share of attention FLOPs (conventions:
models/glm5/accounting.py). For seed-1.8t, or with --claims, it adds the seed
article's claims (docs/ARCHITECTURE.md, "The seed article") next to what the configuration gives.

Import it as profiling.inspect (profiling/cli.py does); run as a script from
inside profiling/ it would shadow the standard library's inspect.
"""
from __future__ import annotations

import argparse
import json
import sys

from models.glm5 import PRESETS, GLM5Config, preset
from models.glm5.accounting import (DEFAULT_CONTEXTS, Report, count_label, context_label, flops_per_token, render,
                                    report, table)

ARTICLE_CONTEXT = 32768  # the seed article tests its sparse attention at 32K tokens
COST_CUT = 0.40          # its "~40% lower inference cost"


def parse_contexts(text: str) -> list:
    """'4096,32K' -> [4096, 32768]; K means 1024 tokens."""
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = 1024 if item[-1:] in ("k", "K") else 1
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) == 0:
            raise argparse.ArgumentTypeError(f"context {item!r} is not a positive token count (e.g. 4096 or 32K)")
        out.append(int(digits) * scale)
    return out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="parameters, FLOPs and cache bytes per token of a GLM-5 configuration",
        description="Parameters, active parameters, FLOPs per token against context length, cache bytes per token "
                    "and the indexer's share of attention FLOPs, computed from the configuration.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration")
    src.add_argument("--config", metavar="PATH", help="a config.json, or a directory holding one (HF format)")
    p.add_argument("--context", action="append", type=parse_contexts, metavar="N[,N...]",
                   help="context lengths in tokens, repeatable or comma-separated, K = 1024 "
                        f"(default {','.join(context_label(n) for n in DEFAULT_CONTEXTS)})")
    p.add_argument("--format", choices=("md", "text"), default="md", help="markdown tables or plain text")
    p.add_argument("--claims", action="store_true",
                   help="add the seed article's claims next to the configuration (always on for seed-1.8t)")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"glm5-lab inspect: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    if args.config is not None:
        try:
            cfg, name = GLM5Config.from_json(args.config), args.config
        except (OSError, ValueError, TypeError, json.JSONDecodeError) as e:
            return _fail(f"--config {args.config}: {e}")
    else:
        cfg, name = preset(args.preset), args.preset
    contexts = sorted({n for group in (args.context or [list(DEFAULT_CONTEXTS)]) for n in group})
    too_long = [n for n in contexts if n > cfg.max_position_embeddings]
    if too_long:
        return _fail(f"--context {too_long} exceeds this config's max_position_embeddings "
                     f"({cfg.max_position_embeddings})")
    rep = report(cfg, contexts, name=name)
    print(render(rep, args.format))
    if args.claims or args.preset == "seed-1.8t":
        print()
        print(render_claims(rep, args.format))
    return 0


# ---- the seed article's claims against the configuration ----
def _saving(cfg: GLM5Config, n: int, mode: str) -> float:
    """How much cheaper per token DSA is than dense attention in the same model."""
    return 1 - flops_per_token(cfg, n, mode, "dsa").total / flops_per_token(cfg, n, mode, "dense").total


def context_for_saving(cfg: GLM5Config, mode: str, target: float = COST_CUT) -> int | None:
    """Shortest context at which DSA saves `target` of the FLOPs per token, or None
    if it does not within max_position_embeddings. The saving grows with context
    (past index_topk, dense attention adds more per key than the indexer), so bisect."""
    hi = cfg.max_position_embeddings
    if _saving(cfg, hi, mode) < target:
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if _saving(cfg, mid, mode) < target else (lo, mid)
    return lo


def claim_rows(rep: Report) -> list:
    """[claim, article, configuration, how computed] for each claim the article makes about the model."""
    cfg, n = rep.config, ARTICLE_CONTEXT
    dec, pre = flops_per_token(cfg, n, "decode"), flops_per_token(cfg, n, "prefill")
    long_dec = flops_per_token(cfg, 4 * n, "decode")
    k, shared = cfg.num_experts_per_tok, cfg.n_shared_experts
    moe_cut = 1 - rep.matmul_active / (rep.total - rep.params["embedding"])
    at = {m: context_for_saving(cfg, m) for m in ("decode", "prefill")}
    where = ", ".join(f"{m} from {c} tokens" if c else f"{m} not within max_position_embeddings"
                      for m, c in at.items())
    return [
        ["experts", "128", f"{cfg.n_routed_experts} routed + {shared} shared", "n_routed_experts, n_shared_experts"],
        ["experts active per token", "8-12", f"{k} routed + {shared} shared = {k + shared}",
         "num_experts_per_tok + n_shared_experts"],
        ["total parameters", "~1.8T", f"{rep.total / 1e12:.3f}T ({rep.total / 1.8e12 - 1:+.1%})",
         "main model incl. embedding and LM head, no MTP (the convention of GLM-5's 744B)"],
        ["compute", "~200B-dense",
         f"{count_label(rep.matmul_active)} weights/token ({rep.matmul_active / 200e9 - 1:+.1%}); "
         f"{count_label(rep.active_params)} active in the blocks",
         "weights a token multiplies by, LM head included: a dense model of N parameters does 2N FLOPs/token "
         "(attention comes on top for both)"],
        ["keys per query", "top 5% (at 32K)", f"{cfg.index_topk} = {cfg.index_topk / n:.2%} of 32K",
         "index_topk / 32768"],
        ["predictor cost", "<= 3% of total compute",
         f"{dec.indexer_share_of_total:.2%} decode, {pre.indexer_share_of_total:.2%} prefill at 32K "
         f"({long_dec.indexer_share_of_total:.2%} decode at 128K)",
         "indexer FLOPs (projections + q.k and head weighting over every key) / FLOPs per token"],
        ["inference cost (attention)", "~40% lower",
         f"{_saving(cfg, n, 'decode'):.1%} decode, {_saving(cfg, n, 'prefill'):.1%} prefill at 32K; "
         f"40% {where}", "FLOPs per token, DSA vs the same model with dense MLA attention"],
        ["inference cost (MoE)", "~40% lower", f"{moe_cut:.1%}",
         "1 - weights per token / parameters outside the embedding: vs a dense model of equal size"],
        ["attention complexity", "O(n log n)",
         f"core O(n*k), k = {cfg.index_topk}; indexer O(n^2): its FLOPs per decode token grow "
         f"x{long_dec.indexer / dec.indexer:.1f} from 32K to 128K",
         "flops_per_token at 32K and 128K"],
        ["attention kept", ">= 98%", "not a property of the configuration",
         "measured on data by bench/attention_recall.py (recall of the selection)"],
    ]


def render_claims(rep: Report, fmt: str = "md") -> str:
    title = f"Seed article's claims vs {rep.name or 'the configuration'}"
    head = f"### {title}" if fmt == "md" else f"{title}\n{'=' * len(title)}"
    return "\n".join([head, "", table(["claim", "article", "configuration", "how computed"], claim_rows(rep), fmt)])
