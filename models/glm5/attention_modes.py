"""Attention modes: which keys each query of an MLA layer attends to, and how.

A mode is one class with the steps it needs (MLAttention.forward calls them
in order: expanded, index_key, needs_keys, select, attend), registered under
a name:

    @register_attention_mode("sliding_window")
    class SlidingWindow(AttentionMode):
        def select(self, attn, step, prev_selection, ctx): ...   # int32 [B,S,k] key positions, -1 = none
        def attend(self, attn, step, selection, ctx):
            return attend_selected(attn, step, selection, ctx)

The model takes one at construction (GLM5ForCausalLM(config, attn="dsa")) or
for a block (`with model.attention("dense"): ...`). ATTENTION_MODES is the one
list of them: the CLI (glm5-lab profile --attn) and training read it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import glm5_ops
from glm5_ops import plan
from glm5_ops.nvtx import nvtx_range

ATTENTION_MODES: dict[str, type[AttentionMode]] = {}
DEFAULT_ATTENTION = "dsa"       # GLM-5's own
BASELINE_ATTENTION = "dense"    # every causal key: what the sparse modes are measured against


def register_attention_mode(name: str):
    """Class decorator: registers an AttentionMode subclass under `name`."""
    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, AttentionMode)):
            raise TypeError(f"register_attention_mode({name!r}): expected an AttentionMode subclass, got {cls!r}")
        if ATTENTION_MODES.get(name, cls) is not cls:
            raise ValueError(f"attention mode {name!r} is already registered ({ATTENTION_MODES[name].__name__})")
        cls.name = name
        ATTENTION_MODES[name] = cls
        return cls
    return register


def attention_mode(mode, name: str = "attn") -> AttentionMode:
    """The mode named `mode` (a registered name), or `mode` itself if already an AttentionMode.
    `name`: the argument it came in as, for the error message."""
    if isinstance(mode, AttentionMode):
        return mode
    if not isinstance(mode, str) or mode not in ATTENTION_MODES:
        raise ValueError(f"{name} must be one of the registered attention modes {sorted(ATTENTION_MODES)}, "
                         f"got {mode!r}")
    return ATTENTION_MODES[mode]()


class AttentionMode:
    """The steps of one mode, each given the layer (attn: MLAttention), what
    it computed so far (step: mla.AttentionStep) and the forward's ctx.
    Defaults: the absorbed form, no indexer key, no selection."""
    name = "?"
    selects_keys = True     # False: attends to every causal key (nothing to recall or compare)

    def expanded(self, attn, S: int, ctx) -> bool:
        """Whether this call attends in the expanded (per-head K/V) form."""
        return False

    def index_key(self, attn, x, ctx):
        """The indexer key to cache for these tokens [B,S,Di], or None."""
        return None

    def needs_keys(self, step) -> bool:
        """Whether attend reads the keys in logical order (False: from the cache's pool in place)."""
        return True

    def select(self, attn, step, prev_selection, ctx):
        """The keys each query attends to (passed to a following shared layer and recorded), or None."""
        return None

    def attend(self, attn, step, selection, ctx) -> torch.Tensor:
        """[B,S,H,v] in the expanded form, [B,S,H,C] absorbed."""
        raise NotImplementedError(f"attention mode {self.name!r} defines no attend step")


def latent_kv(attn, step):
    """The absorbed form's k [B,T,1,C+r] (one latent key per token: MQA) and v, a view of its latent."""
    k = step.keys[:, :, None, :]
    return k, k[..., :attn.kv_lora]


def attend_selected(attn, step, selection, ctx):
    """Absorbed sparse attention over selection [B,S,k] (logical key positions, -1 = none)."""
    k, v = latent_kv(attn, step)
    return glm5_ops.sparse_attention(step.q, k, v, selection, scale=attn.scale, causal=True, q_start=ctx.q_start)[0]


def causal_sdpa(attn, step, ctx):
    """Causal attention over every key, one SDPA. Absorbed: one latent key per
    token serves every head (MQA), so the H heads fold into the query rows
    ([B, 1, S*H, C+r] against [B, 1, T, C+r]; broadcasting the kv head to H
    heads instead costs SDPA a strided copy per head, ~50x slower at decode).
    Expanded, as FlashAttention runs MLA prefill: every key's latent expanded
    to per-head K (nope + rope) and V by kv_b_proj, 3.4x fewer FLOPs per
    (query, key, head), for T x kv_lora x H x (nope + v) to expand. The mask
    is [S,T] (none when S == T)."""
    if not step.expanded:
        return _absorbed_sdpa(attn, step, ctx)
    q, k, v = attn.expand(step.q_nope, step.q_rot, step.keys, ctx.workspace)
    # torch's CPU flash kernel needs one head size for q, k and v (else SDPA
    # takes the math path, [B,H,S,T] in memory and ~8x slower): zero-pad the
    # smaller side, which changes neither scores nor outputs.
    D = max(q.shape[-1], attn.v_dim)
    q, k, v = F.pad(q, (0, D - q.shape[-1])), F.pad(k, (0, D - k.shape[-1])), F.pad(v, (0, D - attn.v_dim))
    B, S, H, _ = q.shape
    T = k.shape[1]
    mask, causal = ctx.sdpa_mask(T)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, scale=attn.scale)
    return out[..., :attn.v_dim].transpose(1, 2)


def _absorbed_sdpa(attn, step, ctx):
    q, (k, v) = step.q, latent_kv(attn, step)
    B, S, H, D = q.shape
    T = k.shape[1]
    mask = None
    if not (S == 1 and T == ctx.end and isinstance(ctx.q_start, int)):    # one query at the end sees every key
        m = ctx.causal_mask(T)                                             # [S,T] or [B,S,T]
        mask = m[..., None, :].expand(*m.shape[:-1], H, T).reshape(*m.shape[:-2], 1, S * H, T)
    out = F.scaled_dot_product_attention(q.reshape(B, 1, S * H, D), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=attn.scale)
    return out.view(B, S, H, v.shape[-1])


@register_attention_mode("dense")
class DenseAttention(AttentionMode):
    """Causal attention over every key (the baseline): expanded for many queries, absorbed for decode."""
    selects_keys = False

    def expanded(self, attn, S, ctx):
        return S >= plan.EXPANDED_MIN_QUERIES

    def attend(self, attn, step, selection, ctx):
        return causal_sdpa(attn, step, ctx)


@register_attention_mode("dsa")
class DSAttention(AttentionMode):
    """DeepSeek sparse attention: the indexer's q/k/w feed the fused
    indexer_topk kernel (never the [B,S,T] scores), and sparse_attention
    attends to the chosen keys. Layers marked `shared` reuse the previous
    layer's choice. While every visible key fits in index_topk the choice is
    all of them: that is dense attention, run as such (vLLM's DSA does the same
    for short prefill)."""

    @staticmethod
    def every_key(attn, S, ctx) -> bool:
        return ctx.end <= attn.config.index_topk

    def expanded(self, attn, S, ctx):
        if S < plan.EXPANDED_MIN_QUERIES:
            return False
        # A selection that still covers much of the context attends expanded
        # too, where the kernel makes that cheaper: same selection, same result.
        return self.every_key(attn, S, ctx) or plan.dsa_expanded_is_cheaper(
            ctx.device, S, ctx.end - S, attn.config.index_topk, kv_lora=attn.kv_lora, nope=attn.nope,
            rope=attn.rope_dim, v_dim=attn.v_dim)

    def index_key(self, attn, x, ctx):
        if attn.indexer is None:
            return None
        with nvtx_range(f"layer{attn.layer_idx}/attn/indexer"):
            return attn.indexer.key(x, ctx.cos, ctx.sin)

    def needs_keys(self, step):
        return step.expanded

    def select(self, attn, step, prev_selection, ctx):
        if step.expanded and self.every_key(attn, step.x.shape[1], ctx):
            return None
        if attn.indexer is None:
            return prev_selection
        return self._indexer_topk(attn, step, ctx)

    @torch.no_grad()
    def _indexer_topk(self, attn, step, ctx):
        """int32 [B,S,topk] logical key positions per query (-1 = none)."""
        i, T = attn.layer_idx, step.index_keys.shape[1]
        topk = min(attn.config.index_topk, T)
        if T <= attn.config.index_topk:
            # Every visible key is chosen (transformers' top-k picks all T, the
            # causal mask drops the future): no need to score them.
            with nvtx_range(f"layer{i}/attn/topk"):
                return ctx.every_key_selection(T)
        with nvtx_range(f"layer{i}/attn/indexer"):
            qi, wi = attn.indexer.query(step.x, step.q_resid, ctx.cos, ctx.sin)
            qi = qi.to(step.index_keys.dtype)
            if not ctx.fused:
                scores = glm5_ops.indexer_scores(qi, wi, step.index_keys, causal=True, q_start=ctx.q_start)
        with nvtx_range(f"layer{i}/attn/topk"):
            if ctx.fused:
                return glm5_ops.indexer_topk(qi, wi, step.index_keys, topk, causal=True, q_start=ctx.q_start)
            return glm5_ops.topk_indices(scores, topk)

    def attend(self, attn, step, selection, ctx):
        if step.expanded:
            every_key = self.every_key(attn, step.x.shape[1], ctx)
            if every_key and not plan.every_key_on_block_sparse(ctx.device):
                return causal_sdpa(attn, step, ctx)
            q, k, v = attn.expand(step.q_nope, step.q_rot, step.keys, ctx.workspace)
            if every_key:     # causal attention on the block-sparse kernel, every causal key block
                mask = glm5_ops.BlockMask.causal(q.shape[1], k.shape[1], 64, q_start=ctx.q_start, device=q.device)
                return glm5_ops.block_sparse_attention(q, k, v, mask, scale=attn.scale, causal=True,
                                                       q_start=ctx.q_start)[0]
            # the same selection over per-head K/V: one kv head per query head
            return glm5_ops.sparse_attention(q, k, v, selection, scale=attn.scale, causal=True,
                                             q_start=ctx.q_start)[0]
        if selection is None:
            raise ValueError(f"layer {attn.layer_idx} is a 'shared' indexer layer but no earlier layer chose keys")
        if ctx.cache is not None:   # the paged pool, read through physical slot ids
            return ctx.cache.sparse_attention(attn.layer_idx, step.q, selection, attn.scale)
        return attend_selected(attn, step, selection, ctx)


@register_attention_mode("block_sparse")
class BlockSparseAttention(AttentionMode):
    """block_topk_mask + block_sparse_attention on the absorbed q/k: per query
    block (ctx.block_size), sink + local + chosen blocks ~ index_topk keys, so
    a decode step is a block of its own. The mask is built (and recorded)
    inside core attention."""

    def attend(self, attn, step, selection, ctx):
        k, v = latent_kv(attn, step)
        bs = ctx.block_size
        topk_blocks = max(1, attn.config.index_topk // bs - 2)
        mask = glm5_ops.block_topk_mask(step.q, k, block_size=bs, topk_blocks=topk_blocks, q_start=ctx.q_start)
        ctx.record_selection(attn.layer_idx, mask)
        return glm5_ops.block_sparse_attention(step.q, k, v, mask, scale=attn.scale, causal=True,
                                               q_start=ctx.q_start)[0]
