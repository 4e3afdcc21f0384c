"""Parameters, FLOPs and cache bytes per token of a GLM5Config: pure arithmetic, no tensors.

Parameter counts follow transformers' GlmMoeDsaForCausalLM tensor for tensor
(tests/test_accounting.py checks them against a meta-device instance), plus the
multi-token-prediction (MTP) layers that the checkpoint stores as
model.layers.{num_hidden_layers + j} in the DeepSeek-V3 layout: enorm, hnorm,
eh_proj [hidden, 2*hidden], one full MoE decoder layer (with its own indexer),
shared_head.norm, and copies of embed_tokens and shared_head.head.

Conventions, chosen to reproduce GLM-5's published "744B total / 40B active"
(the same rules put GLM-4.5, published as 355B / 32B, at 352.8B / 32.1B):
- total: every tensor of the main model (embedding, decoder layers with the
  router's e_score_correction_bias buffer, final norm, LM head counted once
  when tied). MTP layers are NOT in it (GLM-5: 743.9B; with its one MTP layer
  the checkpoint holds 753.9B unique, 755.8B as stored with the embed/head copies).
- active: what one token touches in the transformer blocks: attention (and
  the indexer on "full" layers), norms, dense MLPs, the router, top-k routed
  plus shared experts, final norm. NOT the embedding or LM head (GLM-5: 39.9B;
  also reported with them, 41.8B).

FLOPs per token count multiply-adds as 2 FLOPs: 2 x every matmul weight a
token uses (LM head included; embedding lookup, norms and bias adds not), plus the
attention core and the DSA indexer's scoring, which grow with context:
- core, per layer and head over K keys: 2*K*(Dk + Dv). Decode uses MLA's
  absorbed form (Dk = kv_lora_rank + qk_rope_head_dim, Dv = kv_lora_rank; the
  absorption matmuls cost exactly kv_b_proj's 2 x params, already counted);
  prefill the expanded form (Dk = qk_nope + qk_rope, Dv = v_head_dim; kv_b_proj
  runs once per token, also already counted).
- DSA reads K = min(index_topk, keys) keys; dense attention reads all keys.
- indexer, on "full" layers only: its projections (wq_b, wk, weights_proj)
  plus 2*index_n_heads*index_head_dim per key (q.k) and 2*index_n_heads per key
  (the relu-weighted head sum) over every key; "shared" layers reuse the
  previous selection and run no indexer. Dense attention has no indexer.
- decode at context N: the new token sees N keys (itself included); prefill of
  N tokens: the mean over positions i = 1..N, which see i keys.
Softmax, rotary and top-k selection are not counted (no multiply-adds).
MTP layers are not in the FLOPs (they run only when drafting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import GLM5Config

DEFAULT_CONTEXTS = (4096, 32768, 131072)

# Components of a parameter breakdown. MATMUL ones are weights a token
# multiplies by (2 FLOPs each); the others are norms and biases (adds only,
# not counted, as torch's FlopCounterMode does not count them either).
MATMUL = ("mla", "indexer", "dense_mlp", "router", "routed_experts", "shared_experts", "lm_head")
COMPONENTS = ("embedding",) + MATMUL + ("norms", "attn_bias", "router_bias")


# ---- parameters of one module (HF layout) ----
def mla_params(cfg: GLM5Config) -> int:
    """Weights of q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; norms and biases are counted apart."""
    h, H = cfg.hidden_size, cfg.num_attention_heads
    q_b = cfg.q_lora_rank * H * cfg.qk_head_dim
    kv_b = cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return h * cfg.q_lora_rank + q_b + h * cfg.latent_dim + kv_b + H * cfg.v_head_dim * h


def mla_bias_params(cfg: GLM5Config) -> int:
    """attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj carry biases."""
    return (cfg.q_lora_rank + cfg.latent_dim + cfg.hidden_size) if cfg.attention_bias else 0


def mla_norm_params(cfg: GLM5Config) -> int:
    return cfg.q_lora_rank + cfg.kv_lora_rank  # q_a_layernorm, kv_a_layernorm


def indexer_params(cfg: GLM5Config) -> int:
    """wq_b, wk, weights_proj; k_norm (a LayerNorm: weight + bias) is counted with the norms."""
    return (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + cfg.hidden_size * cfg.index_head_dim
            + cfg.hidden_size * cfg.index_n_heads)


def indexer_norm_params(cfg: GLM5Config) -> int:
    return 2 * cfg.index_head_dim


def swiglu_params(cfg: GLM5Config, intermediate: int) -> int:
    return 3 * cfg.hidden_size * intermediate  # gate, up, down


def decoder_layer_params(cfg: GLM5Config, *, moe: bool, indexer: bool, routed: int | None = None) -> dict:
    """One decoder layer by component. routed: how many routed experts to count
    (all of them by default; top-k for the active count)."""
    h = cfg.hidden_size
    p = dict.fromkeys(COMPONENTS, 0)
    p["mla"] = mla_params(cfg)
    p["attn_bias"] = mla_bias_params(cfg)
    p["norms"] = 2 * h + mla_norm_params(cfg)  # input_layernorm, post_attention_layernorm
    if indexer:
        p["indexer"] = indexer_params(cfg)
        p["norms"] += indexer_norm_params(cfg)
    if moe:
        E = cfg.n_routed_experts
        p["router"] = E * h
        p["router_bias"] = E  # e_score_correction_bias: a persistent buffer, in the checkpoint
        p["routed_experts"] = (E if routed is None else routed) * swiglu_params(cfg, cfg.moe_intermediate_size)
        p["shared_experts"] = swiglu_params(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
    else:
        p["dense_mlp"] = swiglu_params(cfg, cfg.intermediate_size)
    return p


def _add(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


def _layers(cfg: GLM5Config, routed: int | None) -> dict:
    total = dict.fromkeys(COMPONENTS, 0)
    for mlp, idx in zip(cfg.mlp_layer_types, cfg.indexer_types):
        total = _add(total, decoder_layer_params(cfg, moe=mlp == "sparse", indexer=idx == "full", routed=routed))
    return total


def param_breakdown(cfg: GLM5Config) -> dict:
    """Main-model parameters by component (MTP excluded); sums to the total."""
    p = _layers(cfg, routed=None)
    p["embedding"] = cfg.vocab_size * cfg.hidden_size
    p["lm_head"] = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    p["norms"] += cfg.hidden_size  # final norm
    return {k: p[k] for k in COMPONENTS}


def active_breakdown(cfg: GLM5Config) -> dict:
    """Parameters one token uses, by component: top-k routed experts per MoE
    layer. embedding and lm_head hold the full matrices (the head multiplies
    by all of it); Report.active_params leaves both out, as published."""
    p = _layers(cfg, routed=cfg.num_experts_per_tok)
    p["embedding"] = cfg.vocab_size * cfg.hidden_size
    p["lm_head"] = cfg.vocab_size * cfg.hidden_size  # a tied head is still a matmul per token
    p["norms"] += cfg.hidden_size
    return {k: p[k] for k in COMPONENTS}


def mtp_layer_params(cfg: GLM5Config) -> int:
    """One MTP layer's own tensors: enorm, hnorm, eh_proj, a MoE decoder layer
    with an indexer, shared_head.norm (not the embed/head copies)."""
    h = cfg.hidden_size
    return 3 * h + 2 * h * h + sum(decoder_layer_params(cfg, moe=True, indexer=True).values())


def mtp_copies_params(cfg: GLM5Config) -> int:
    """embed_tokens and shared_head.head stored again in each MTP layer (equal to the main model's)."""
    return 2 * cfg.vocab_size * cfg.hidden_size


# ---- FLOPs per token ----
@dataclass(frozen=True)
class Flops:
    """FLOPs for one token; decode: the token at context N; prefill: averaged over N tokens."""
    context: int
    mode: str        # "decode" | "prefill"
    attention: str   # "dsa" | "dense"
    other: float     # 2 x MLP, expert, router and LM-head weights
    attn_proj: float  # 2 x MLA projection weights
    attn_core: float  # QK^T and PV over the keys read
    indexer: float   # indexer projections + scoring every key (0 for dense)

    @property
    def attention_total(self) -> float:
        return self.attn_proj + self.attn_core + self.indexer

    @property
    def total(self) -> float:
        return self.other + self.attention_total

    @property
    def indexer_share_of_attention(self) -> float:
        return self.indexer / self.attention_total

    @property
    def indexer_share_of_total(self) -> float:
        return self.indexer / self.total


def _mean_keys(context: int, mode: str, cap: int | None) -> float:
    """Keys a query reads: at decode min(cap, N); at prefill the mean over i=1..N of min(cap, i)."""
    if mode == "decode":
        return float(context if cap is None else min(cap, context))
    c = context if cap is None else min(cap, context)
    return (c * (c + 1) / 2 + (context - c) * c) / context


def flops_per_token(cfg: GLM5Config, context: int, mode: str = "decode", attention: str = "dsa") -> Flops:
    if not (isinstance(context, int) and context > 0):
        raise ValueError(f"context must be a positive int, got {context!r}")
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    if attention not in ("dsa", "dense"):
        raise ValueError(f"attention must be 'dsa' or 'dense', got {attention!r}")
    act = active_breakdown(cfg)
    L = cfg.num_hidden_layers
    H = cfg.num_attention_heads
    if mode == "decode":  # absorbed MLA: attend in the latent space
        dk, dv = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    else:
        dk, dv = cfg.qk_head_dim, cfg.v_head_dim
    keys = _mean_keys(context, mode, cfg.index_topk if attention == "dsa" else None)
    core = L * 2 * H * keys * (dk + dv)
    indexer = 0.0
    if attention == "dsa":
        n_full = cfg.indexer_types.count("full")
        per_key = 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads
        indexer = 2 * act["indexer"] + n_full * per_key * _mean_keys(context, mode, None)
    other = 2 * sum(act[k] for k in MATMUL if k not in ("mla", "indexer"))
    return Flops(context, mode, attention, float(other), float(2 * act["mla"]), float(core), float(indexer))


# ---- cache bytes per token ----
def _fp8_bytes(n: int) -> int:
    """fp8 values with one fp32 scale per 128 (DeepSeek-V3.2 / FlashMLA layout)."""
    return n + 4 * math.ceil(n / 128)


def cache_bytes_per_token(cfg: GLM5Config, dtype: str = "bf16", attention: str = "dsa") -> dict:
    """Bytes one token adds to the cache, over all decoder layers and the MTP
    layers (each runs MLA and an indexer). Per layer: the latent
    (kv_lora_rank normalised + qk_rope_head_dim roped) and, on layers with an
    indexer, its key (index_head_dim). fp8: latent and indexer key in fp8 with
    an fp32 scale per 128 values; the roped part stays bf16, as in FlashMLA."""
    if dtype == "bf16":
        latent, key = 2 * cfg.latent_dim, 2 * cfg.index_head_dim
    elif dtype == "fp8":
        latent, key = _fp8_bytes(cfg.kv_lora_rank) + 2 * cfg.qk_rope_head_dim, _fp8_bytes(cfg.index_head_dim)
    else:
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    with_indexer = cfg.indexer_types.count("full") + cfg.num_nextn_predict_layers if attention == "dsa" else 0
    out = {"latent": layers * latent, "indexer": with_indexer * key}
    out["total"] = out["latent"] + out["indexer"]
    return out


# ---- the report ----
@dataclass
class Report:
    name: str
    config: GLM5Config
    params: dict = field(repr=False)   # param_breakdown
    active: dict = field(repr=False)   # active_breakdown
    mtp: int                           # unique MTP parameters, all MTP layers
    mtp_copies: int                    # embed/head copies the MTP layers store
    flops: list                        # [Flops], for every context x mode x attention
    cache: dict                        # {dtype: cache_bytes_per_token}

    @property
    def total(self) -> int:
        """Published convention: main model with embedding and LM head, no MTP."""
        return sum(self.params.values())

    @property
    def active_params(self) -> int:
        """Published convention: transformer blocks only (no embedding, no LM head)."""
        return sum(v for k, v in self.active.items() if k not in ("embedding", "lm_head"))

    @property
    def active_with_head(self) -> int:
        return self.active_params + self.active["lm_head"]

    @property
    def active_with_embedding(self) -> int:
        return self.active_with_head + self.active["embedding"]

    @property
    def matmul_active(self) -> int:
        """Weights one token multiplies by (DSA): half the context-free FLOPs per token."""
        return sum(self.active[k] for k in MATMUL)

    @property
    def checkpoint_total(self) -> int:
        """Everything a checkpoint holds: the main model, MTP layers and their copies."""
        return self.total + self.mtp + self.mtp_copies

    def flop(self, context: int, mode: str, attention: str) -> Flops:
        for f in self.flops:
            if (f.context, f.mode, f.attention) == (context, mode, attention):
                return f
        raise KeyError(f"no FLOPs for context={context} mode={mode} attention={attention} in this report")


def report(cfg: GLM5Config, contexts=DEFAULT_CONTEXTS, name: str = "") -> Report:
    contexts = list(contexts)
    flops = [flops_per_token(cfg, n, mode, attn) for n in contexts
             for mode in ("decode", "prefill") for attn in ("dsa", "dense")]
    n_mtp = cfg.num_nextn_predict_layers
    return Report(name=name, config=cfg, params=param_breakdown(cfg), active=active_breakdown(cfg),
                  mtp=n_mtp * mtp_layer_params(cfg), mtp_copies=n_mtp * mtp_copies_params(cfg), flops=flops,
                  cache={dt: cache_bytes_per_token(cfg, dt) for dt in ("bf16", "fp8")})


# ---- rendering ----
def table(header: list, rows: list, fmt: str = "md") -> str:
    """A markdown table, or plain text with aligned columns."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    if fmt == "md":
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells[1:]])
    if fmt != "text":
        raise ValueError(f"fmt must be 'md' or 'text', got {fmt!r}")
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    # numbers right-aligned, words left-aligned
    right = [all(r[i][:1] in "0123456789-+" for r in cells[1:]) for i in range(len(header))]
    def fmt_row(r):
        return "  ".join(c.rjust(w) if a else c.ljust(w) for c, w, a in zip(r, widths, right)).rstrip()
    return "\n".join([fmt_row(cells[0]), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in cells[1:]])


def count_label(n: int) -> str:
    """A parameter count in B, M or K, whichever reads best."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def context_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _flop_unit(x: float) -> tuple:
    for scale, unit in ((1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "KFLOP")):
        if x >= 10 * scale:
            return scale, unit
    return 1.0, "FLOP"


def render(rep: Report, fmt: str = "md") -> str:
    """Parameters, active parameters, FLOPs per token against context, cache bytes per token."""
    heading = (lambda s: f"### {s}") if fmt == "md" else (lambda s: f"{s}\n{'=' * len(s)}")
    out = [heading(f"{rep.name or 'config'}: parameters"), ""]
    rows = [[k, count_label(rep.params[k]), count_label(rep.active[k]) if k not in ("embedding", "lm_head") else "-"]
            for k in COMPONENTS]
    rows += [["total (published convention: no MTP)", f"{count_label(rep.total)} ({rep.total:,})",
              f"{count_label(rep.active_params)} ({rep.active_params:,})"],
             ["active + LM head / + embedding", "", f"{count_label(rep.active_with_head)} / "
                                                    f"{count_label(rep.active_with_embedding)}"],
             [f"MTP layers ({rep.config.num_nextn_predict_layers}): own / embed+head copies",
              f"{count_label(rep.mtp)} / {count_label(rep.mtp_copies)}", ""],
             ["checkpoint (main + MTP + copies)", count_label(rep.checkpoint_total), ""]]
    out += [table(["component", "parameters", "active per token"], rows, fmt), ""]

    scale, unit = _flop_unit(2 * rep.matmul_active)
    out += [heading(f"FLOPs per token ({unit}) against context"), ""]
    rows = []
    for n in sorted({f.context for f in rep.flops}):
        for mode in ("decode", "prefill"):
            dsa, dense = rep.flop(n, mode, "dsa"), rep.flop(n, mode, "dense")
            rows.append([context_label(n), mode, f"{dsa.total / scale:.1f}", f"{dense.total / scale:.1f}",
                         f"{1 - dsa.total / dense.total:.1%}", f"{dsa.attn_core / scale:.2f}",
                         f"{dsa.indexer / scale:.2f}", f"{dense.attn_core / scale:.2f}",
                         f"{dsa.indexer_share_of_attention:.1%}", f"{dsa.indexer_share_of_total:.1%}"])
    out += [table(["context", "mode", "DSA", "dense attn", "DSA saves", "DSA core", "indexer", "dense core",
                   "indexer / attention", "indexer / total"], rows, fmt), ""]
    out += [f"Matmul weights per token {count_label(rep.matmul_active)} -> {2 * rep.matmul_active / scale:.1f} "
            f"{unit} before attention; decode: absorbed MLA, prefill: mean over the N positions.", ""]

    out += [heading("Cache bytes per token (all layers incl. MTP)"), ""]
    rows = [[dt, f"{c['latent']:,}", f"{c['indexer']:,}", f"{c['total']:,}",
             f"{c['total'] / 2**10:.1f} KiB", f"{c['total'] * 131072 / 2**30:.2f} GiB"] for dt, c in rep.cache.items()]
    out += [table(["dtype", "MLA latent", "indexer keys", "total B", "total", "per 128K-token sequence"], rows, fmt)]
    return "\n".join(out)
