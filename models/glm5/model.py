"""GLM-5 (transformers' GlmMoeDsaForCausalLM) composed from the lab's kernels.

Module and parameter names follow the HF checkpoint, so a state dict loads
as is (models/glm5/loading.py only stacks per-expert tensors). What differs
from transformers is how each piece computes, not what:

- MLA runs in its absorbed form: q_nope is multiplied into the latent space
  (W_UK), every head attends over the one cached latent+rope key per token
  (MQA, Dk = kv_lora_rank + rope, v = the first kv_lora_rank channels of k),
  and W_UV maps the result back. No per-head K/V is ever built, so prefill and
  decode read the same cache.
- attn="dsa": the indexer's q/k/w feed the fused `indexer_topk` kernel (never
  the [B,S,T] scores), and `sparse_attention` attends to the chosen keys.
  attn="block_sparse": `block_topk_mask` + `block_sparse_attention` on the
  same q/k. attn="dense": causal attention over every key (the baseline).
- MoE: `moe_route` then `fused_moe` (dispatch, grouped SwiGLU, combine).
  fused=False runs the unfused ops (indexer_scores + topk_indices;
  moe_dispatch + per-expert GEMMs + moe_combine) so a profile sees each part.

Every component is wrapped in a glm5_ops.nvtx range named as in
docs/ARCHITECTURE.md, "NVTX ranges" (layer{i}/attn/indexer, layer{i}/moe/experts, ...).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import glm5_ops
from glm5_ops.nvtx import nvtx_range

from .config import GLM5Config

ATTN_MODES = ("dsa", "block_sparse", "dense")
# Dense attention (attn="dense", or "dsa" while every visible key is selected)
# with at least this many queries per call expands K/V per head (the cheaper
# form for prefill); fewer (decode) attend in the absorbed form.
DENSE_EXPANDED_MIN_QUERIES = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, S, dim/2] for absolute positions [B, S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    freqs = positions[..., None].float() * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x, cos, sin):
    """GLM-5's interleaved RoPE: pairs (x0,x1), (x2,x3)... each rotated by one
    frequency; like transformers, the result is laid out de-interleaved
    (all first members, then all second members). x [B,S,(H,)dim]."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(nn.Module):
    """DSA's lightning indexer: which keys each query attends to."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def _rope_front(self, x, cos, sin):
        r = self.rope_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def key(self, x, cos, sin):
        """The cached indexer key of each token, [B, S, head_dim]."""
        return self._rope_front(self.k_norm(self.wk(x)), cos, sin)

    def query(self, x, q_resid, cos, sin):
        """(q [B,S,H,D], w fp32 [B,S,H]) for indexer_topk. transformers scores
        sum_h w_h * relu(q_h.k * D^-0.5) * H^-0.5; both positive scales move
        into w since relu(c*a) = c*relu(a) for c > 0."""
        B, S, _ = x.shape
        q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)
        q = self._rope_front(q, cos, sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return q, w * (self.n_heads ** -0.5 * self.head_dim ** -0.5)


class MLAttention(nn.Module):
    """Multi-head latent attention with the DSA indexer (or block-sparse / dense)."""

    def __init__(self, config: GLM5Config, layer_idx: int, shared_selection: bool):
        super().__init__()
        c = config
        self.layer_idx, self.config = layer_idx, c
        self.n_heads, self.nope, self.rope_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        self.kv_lora, self.v_dim = c.kv_lora_rank, c.v_head_dim
        self.scale = c.qk_head_dim ** -0.5
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.indexer = None if shared_selection else Indexer(c)

    def project(self, x, cos, sin):
        """The projections every mode shares: q_nope [B,S,H,nope], q_rot
        [B,S,H,rope] (roped), q_resid [B,S,q_lora] (the indexer's query input)
        and kv [B,S,C+rope], the normed latent and roped k_rot the cache stores."""
        B, S, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, S, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        q_rot = apply_rope(q_rot, cos, sin)
        if not torch.is_grad_enabled():     # roped in place: q_nope and q_rot stay views of one tensor (_joined)
            q[..., self.nope:] = q_rot
            q_rot = q[..., self.nope:]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        kv = torch.cat([self.kv_a_layernorm(latent), apply_rope(k_rot, cos, sin)], dim=-1)
        return q_nope, q_rot, q_resid, kv

    @staticmethod
    def _joined(q_nope, q_rot):
        """[q_nope, q_rot] [B,S,H,nope+rope]: the tensor both are views of
        (project under no_grad), else a concatenation."""
        n = q_nope.shape[-1]
        if q_rot.stride() == q_nope.stride() and q_rot.data_ptr() == q_nope.data_ptr() + n * q_nope.element_size():
            return q_nope.as_strided((*q_nope.shape[:-1], n + q_rot.shape[-1]), q_nope.stride())
        return torch.cat([q_nope, q_rot], dim=-1)

    def expand(self, q_nope, q_rot, keys, ctx=None):
        """The non-absorbed (per-head) form: q [B,S,H,nope+rope], k [B,T,H,nope+rope]
        and v [B,T,H,v] from the latent keys [B,T,C+rope] through kv_b_proj.
        Given ctx and no autograd, k and v land in the forward's reused buffers."""
        B, T, _ = keys.shape
        H, n, r, dv = self.n_heads, self.nope, self.rope_dim, self.v_dim
        latent, k_rot = keys.split([self.kv_lora, r], dim=-1)
        reuse = ctx is not None and not torch.is_grad_enabled()

        def out(name, shape):    # where a result goes: a reused buffer, or a new tensor (None)
            return ctx.scratch(name, shape, keys.dtype, keys.device) if reuse else None

        # Head-major [B,H,T,D] storage, returned as [B,T,H,D] views: a head's
        # rows are then consecutive, where token-major rows H * D apart land in
        # a few L1 sets and defeat the prefetcher (lane tiles: 10-20% faster).
        w = self.kv_b_proj.weight.view(H, n + dv, self.kv_lora)
        kv = out("expanded_kv", (B, H, T, n + dv))
        if reuse:
            for b in range(B):
                for h in range(H):
                    torch.mm(latent[b], w[h].t(), out=kv[b, h])
        else:
            kv = torch.matmul(latent[:, None], w.transpose(1, 2))
        k_nope, v = kv.split([n, dv], -1)
        k = torch.cat([k_nope, k_rot[:, None].expand(B, H, T, r)], dim=-1, out=out("expanded_k", (B, H, T, n + r)))
        return self._joined(q_nope, q_rot), k.transpose(1, 2), v.transpose(1, 2)

    def _absorb(self):
        """W_UK [H, nope, C] and W_UV [H, v, C] as views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x, ctx: "ForwardContext", prev_selection):
        """x [B,S,hidden] -> (out [B,S,hidden], selection for a following shared layer)."""
        B, S, _ = x.shape
        i = self.layer_idx
        w_uk, w_uv = self._absorb()
        # DSA selects every visible key while they fit in index_topk: that is
        # dense attention, run as such (vLLM's DSA does the same for short prefill).
        every_key = ctx.attn == "dense" or (ctx.attn == "dsa" and ctx.q_start + S <= self.config.index_topk)
        many = S >= DENSE_EXPANDED_MIN_QUERIES
        # DSA over a selection that still covers much of the context (prefill
        # at a few times index_topk) attends in the expanded form too: see
        # expanded_is_cheaper. Same selection, same result; fewer FLOPs.
        sparse_expanded = (many and ctx.attn == "dsa" and not every_key and x.device.type == "cpu"
                           and self.expanded_is_cheaper(S, ctx.q_start))
        expanded = (every_key and many) or sparse_expanded
        with nvtx_range(f"layer{i}/attn/proj"):
            q_nope, q_rot, q_resid, kv = self.project(x, ctx.cos, ctx.sin)
            if not expanded:
                q = self._absorb_queries(q_nope, q_rot, w_uk, ctx)
        index_key = None
        if self.indexer is not None and ctx.attn == "dsa":
            with nvtx_range(f"layer{i}/attn/indexer"):
                index_key = self.indexer.key(x, ctx.cos, ctx.sin)
        keys, index_keys = ctx.store(i, kv, index_key, need_keys=expanded or ctx.attn != "dsa")

        selection = prev_selection
        if expanded and not sparse_expanded:
            selection = None
        elif ctx.attn == "dsa" and self.indexer is not None:
            selection = self._select(x, q_resid, index_keys, ctx)
        elif ctx.attn == "block_sparse":
            selection = None
        if expanded:
            with nvtx_range(f"layer{i}/attn/core"):
                if sparse_expanded:
                    out = self._sparse_expanded(q_nope, q_rot, keys, selection, ctx)
                elif ctx.attn == "dsa" and x.device.type == "cpu":
                    out = self._every_key_expanded(q_nope, q_rot, keys, ctx)
                else:
                    out = self._dense_expanded(q_nope, q_rot, keys, ctx)    # [B,S,H,v]
            with nvtx_range(f"layer{i}/attn/out"):
                out = self.o_proj(out.reshape(B, S, self.n_heads * self.v_dim))
        else:
            with nvtx_range(f"layer{i}/attn/core"):
                out = self._attend(q, keys, selection, ctx)            # [B,S,H,C]
            with nvtx_range(f"layer{i}/attn/out"):
                out = torch.einsum("bshc,hvc->bshv", out, w_uv).reshape(B, S, self.n_heads * self.v_dim)
                out = self.o_proj(out)
        if ctx.attn != "block_sparse":            # block_sparse records its mask where it builds it
            ctx.record_selection(i, selection)
        return out, selection

    def _absorb_queries(self, q_nope, q_rot, w_uk, ctx):
        """[q_nope W_UK, q_rot] [B,S,H,C+r]. Without autograd, one batched
        product per head into reused buffers: [q_nope, q_rot] times
        [[W_UK, 0], [0, I]] carries q_rot through exactly (x*1 + 0s), so no
        separate cat, and nothing over 32 MiB is allocated afresh."""
        if torch.is_grad_enabled() or q_nope.shape[1] < DENSE_EXPANDED_MIN_QUERIES:
            return torch.cat([torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_rot], dim=-1)
        B, S, H, n = q_nope.shape
        C, r = self.kv_lora, self.rope_dim
        w = q_nope.new_zeros(H, n + r, C + r)
        w[:, :n, :C] = w_uk
        w[:, n:, C:] = torch.eye(r, dtype=w.dtype, device=w.device)
        q_in = self._joined(q_nope, q_rot).transpose(1, 2)
        by_head = ctx.scratch("absorbed_q_by_head", (B, H, S, C + r), q_nope.dtype, q_nope.device)
        torch.matmul(q_in, w, out=by_head)
        q = ctx.scratch("absorbed_q", (B, S, H, C + r), q_nope.dtype, q_nope.device)
        return q.copy_(by_head.transpose(1, 2))

    @torch.no_grad()
    def _select(self, x, q_resid, index_keys, ctx):
        """int32 [B,S,topk] logical key positions per query (-1 = none)."""
        i = self.layer_idx
        B, S, _ = x.shape
        T = index_keys.shape[1]
        topk = min(self.config.index_topk, T)
        if T <= self.config.index_topk:
            # Every visible key is chosen (transformers' top-k picks all T, the
            # causal mask drops the future): no need to score them.
            with nvtx_range(f"layer{i}/attn/topk"):
                keys = torch.arange(T, dtype=torch.int32, device=x.device)
                return torch.where(ctx.causal_mask(T), keys, -1)[None].expand(B, S, T)
        with nvtx_range(f"layer{i}/attn/indexer"):
            qi, wi = self.indexer.query(x, q_resid, ctx.cos, ctx.sin)
            qi = qi.to(index_keys.dtype)
            if not ctx.fused:
                scores = glm5_ops.indexer_scores(qi, wi, index_keys, causal=True, q_start=ctx.q_start)
        with nvtx_range(f"layer{i}/attn/topk"):
            if ctx.fused:
                return glm5_ops.indexer_topk(qi, wi, index_keys, topk, causal=True, q_start=ctx.q_start)
            return glm5_ops.topk_indices(scores, topk)

    # Lane tiles (the CPU kernel's path for the expanded form) compute at ~0.85
    # of the rate the gathered absorbed path reaches, per spanned or selected
    # pair (~206 against ~242 GFLOP/s on the 2-core Xeon, 8K prefill chunks,
    # head-major K/V; measured per chunk, chunk 4 expanded lost 10%).
    LANE_RATE = 0.85

    def expanded_is_cheaper(self, S: int, q_start: int) -> bool:
        """Whether DSA over S queries at q_start costs less in the expanded form
        on the CPU. Absorbed, each selected (query, key, head) costs kv_lora +
        rope + kv_lora FMAs (544 in the small preset, 1088 in GLM-5), plus the
        W_UK / W_UV products per query. Expanded, nope + rope + v (160 / 512),
        but the kernel then runs each query block's whole span of keys on lane
        tiles (it does once a block selected more than ~16% of its span, with
        one head per kv head), and every visible key's latent is expanded
        first. The expanded form wins while the selection covers most visible
        keys: an 8K-token prefill at top-2048 takes it for positions 2K-6K."""
        topk, first, last = self.config.index_topk, q_start + 1, q_start + S   # query s sees q_start + s + 1 keys
        visible = (first + last) * S / 2                                         # causal (query, key) pairs
        below = max(0, min(last, topk) - first + 1)                              # queries seeing <= topk keys
        selected = (first + first + below - 1) * below / 2 + topk * (S - below)
        absorbed = selected * (2 * self.kv_lora + self.rope_dim) + S * self.kv_lora * (self.nope + self.v_dim)
        expanded = visible * (self.nope + self.rope_dim + self.v_dim) / self.LANE_RATE
        return expanded + last * self.kv_lora * (self.nope + self.v_dim) < absorbed

    def _sparse_expanded(self, q_nope, q_rot, keys, selection, ctx):
        """DSA in the non-absorbed form: per-head K and V (expand), the same
        selection, sparse_attention with one kv head per query head. [B,S,H,v]."""
        q, k, v = self.expand(q_nope, q_rot, keys, ctx)
        return glm5_ops.sparse_attention(q, k, v, selection, scale=self.scale, causal=True, q_start=ctx.q_start)[0]

    def _every_key_expanded(self, q_nope, q_rot, keys, ctx):
        """DSA while its selection is every visible key, on the CPU: causal
        attention in the expanded form on the block-sparse kernel over every
        causal key block (no zero-padding of v as SDPA's flash kernel needs:
        ~20% less time than _dense_expanded at 2K tokens). [B,S,H,v]"""
        q, k, v = self.expand(q_nope, q_rot, keys, ctx)
        mask = glm5_ops.BlockMask.causal(q.shape[1], k.shape[1], 64, q_start=ctx.q_start, device=q.device)
        return glm5_ops.block_sparse_attention(q, k, v, mask, scale=self.scale, causal=True, q_start=ctx.q_start)[0]

    def _dense_expanded(self, q_nope, q_rot, keys, ctx):
        """The dense baseline for many queries, as FlashAttention runs MLA
        prefill: every key's latent expanded to per-head K = [k_nope, k_rot]
        (Dk = nope + rope) and V (v_head_dim) by kv_b_proj, then causal SDPA.
        3.4x fewer FLOPs per (query, key, head) than the absorbed form, for
        T x kv_lora x H x (nope + v) to expand."""
        T = keys.shape[1]
        q, k, v = self.expand(q_nope, q_rot, keys, ctx)
        # torch's CPU flash kernel needs one head size for q, k and v (else SDPA
        # takes the math path, [B,H,S,T] in memory and ~8x slower): zero-pad the
        # smaller side, which changes neither scores nor outputs.
        D = max(q.shape[-1], self.v_dim)
        q, k = F.pad(q, (0, D - q.shape[-1])), F.pad(k, (0, D - k.shape[-1]))
        v = F.pad(v, (0, D - self.v_dim))
        mask, causal = ctx.sdpa_mask(T)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=causal, scale=self.scale)
        return out[..., :self.v_dim].transpose(1, 2)

    def _attend(self, q, keys, selection, ctx):
        if ctx.attn == "dsa":
            if selection is None:
                raise ValueError(f"layer {self.layer_idx} is a 'shared' indexer layer but no earlier layer "
                                 "chose keys")
            if ctx.cache is not None:   # the paged pool, read through physical slot ids
                return ctx.cache.sparse_attention(self.layer_idx, q, selection, self.scale)
        k = keys[:, :, None, :]                   # [B,T,1,C+r]: one latent key per token (MQA)
        v = k[..., :self.kv_lora]                 # the latent is also the value (a view)
        if ctx.attn == "dense":
            return _dense_causal(q, k, v, self.scale, ctx)
        if ctx.attn == "block_sparse":
            bs = ctx.block_size
            topk_blocks = max(1, self.config.index_topk // bs - 2)   # sink + local + chosen ~ index_topk keys
            mask = glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=topk_blocks, q_start=ctx.q_start)
            ctx.record_selection(self.layer_idx, mask)
            return glm5_ops.block_sparse_attention(q, k, v, mask, scale=self.scale, causal=True,
                                                   q_start=ctx.q_start)[0]
        return glm5_ops.sparse_attention(q, k, v, selection, scale=self.scale, causal=True, q_start=ctx.q_start)[0]


def _dense_causal(q, k, v, scale, ctx):
    """Causal attention over every key in the absorbed (MQA) form: q [B,S,H,D],
    k [B,T,1,D], v [B,T,1,Dv] (a view of k). One SDPA with the kv head
    broadcast to the H query heads; the mask is [S,T] (none when S == T)."""
    B, _, H, D = q.shape
    T = k.shape[1]
    kh = k.transpose(1, 2).expand(B, H, T, D)
    vh = v.transpose(1, 2).expand(B, H, T, v.shape[-1])
    mask, causal = ctx.sdpa_mask(T)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # In place: two fewer [tokens, intermediate] tensors (23 MiB each at a
        # 2K-token chunk of the small preset), each faulted in afresh.
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class Router(nn.Module):
    def __init__(self, config: GLM5Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))


class Experts(nn.Module):
    """Routed experts in the HF layout: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


class MoE(nn.Module):
    def __init__(self, config: GLM5Config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x, ctx: "ForwardContext"):
        c, i = self.config, self.layer_idx
        h = x.reshape(-1, x.shape[-1])
        with nvtx_range(f"layer{i}/moe/route"):
            weights, ids = glm5_ops.moe_route(
                h.float(), self.gate.weight.float(), self.gate.e_score_correction_bias, top_k=c.num_experts_per_tok,
                n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                norm_topk_prob=c.norm_topk_prob)
            if torch.is_grad_enabled() and self.gate.weight.requires_grad:
                weights = self._differentiable_weights(h, ids)
        ctx.record_routing(i, ids)
        weights = weights.to(x.dtype)
        if ctx.fused:
            with nvtx_range(f"layer{i}/moe/experts"):
                routed = glm5_ops.fused_moe(h, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:
            routed = self._unfused(h, weights, ids)
        with nvtx_range(f"layer{i}/moe/shared"):
            out = routed + self.shared_experts(h)
        return out.view_as(x)

    def _differentiable_weights(self, h, ids):
        """The router's mixing weights as a function of gate.weight (moe_route
        returns them without a graph): the same formula, gathered at ids."""
        c = self.config
        w = torch.sigmoid(F.linear(h.float(), self.gate.weight.float())).gather(1, ids.long())
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor

    def _unfused(self, h, weights, ids):
        i, E = self.layer_idx, self.config.n_routed_experts
        with nvtx_range(f"layer{i}/moe/dispatch"):
            x_sorted, plan = glm5_ops.moe_dispatch(h, ids, E)
        with nvtx_range(f"layer{i}/moe/experts"):
            offsets = plan.expert_offsets.tolist()
            parts = []
            for e in range(E):
                rows = x_sorted[offsets[e]:offsets[e + 1]]
                if rows.shape[0]:
                    gate, up = F.linear(rows, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
                    rows = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
                parts.append(rows)
            y_sorted = torch.cat(parts)
        with nvtx_range(f"layer{i}/moe/combine"):
            return glm5_ops.moe_combine(y_sorted, plan, weights)


class DecoderLayer(nn.Module):
    def __init__(self, config: GLM5Config, layer_idx: int, sparse_mlp: bool, shared_selection: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLAttention(config, layer_idx, shared_selection)
        self.mlp = MoE(config, layer_idx) if sparse_mlp else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, prev_selection):
        i = self.layer_idx
        with nvtx_range(f"layer{i}/attn_norm"):
            h = self.input_layernorm(x)
        h, selection = self.self_attn(h, ctx, prev_selection)
        x = x + h
        with nvtx_range(f"layer{i}/mlp_norm"):
            h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            h = self.mlp(h, ctx)
        else:
            with nvtx_range(f"layer{i}/mlp"):
                h = self.mlp(h)
        return x + h, selection


class MTPLayer(nn.Module):
    """DeepSeek-V3 / GLM-5 multi-token prediction (checkpoint: model.layers.{L}).
    From the main model's final (normed) hidden state at position t and the
    embedding of token t+1 it predicts token t+2:
        h = layer(eh_proj([enorm(embed(x[t+1])), hnorm(hidden[t])])); logits = head(shared_head.norm(h))
    The embedding and head are the main model's (the checkpoint repeats them)."""

    def __init__(self, config: GLM5Config, layer_idx: int):
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config, layer_idx, sparse_mlp=True, shared_selection=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ForwardContext:
    """What one forward shares across layers: positions, rope tables, the
    attention mode, the cache (if any), and what profiling may inspect."""

    def __init__(self, model, B, S, q_start, cache, dtype, device):
        c = model.config
        self.attn, self.fused, self.block_size = model.attn, model.fused, model.block_size
        self.cache, self.q_start, self.S, self.device = cache, q_start, S, device
        self._mask = None
        positions = (q_start + torch.arange(S, device=device))[None].expand(B, S)
        self.cos, self.sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, dtype)
        self.model = model
        self._scratch = {}

    def scratch(self, name: str, shape, dtype, device) -> torch.Tensor:
        """An uninitialised buffer that every layer of this forward reuses (out=
        targets under no_grad). A fresh tensor over 32 MiB is fresh mmap'd
        memory, one page fault per 4 KiB on first touch: an absorbed 2K-token
        chunk's q alone cost ~5 ms of faults per layer."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device:
            buf = self._scratch[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def causal_mask(self, T: int):
        """[S, T] bool, key t visible to query s (t <= q_start + s); built once per forward."""
        if self._mask is None or self._mask.shape[1] != T:
            pos_q = self.q_start + torch.arange(self.S, device=self.device)
            self._mask = torch.arange(T, device=self.device)[None, :] <= pos_q[:, None]
        return self._mask

    def sdpa_mask(self, T: int):
        """(attn_mask, is_causal) for SDPA: its own causal flag when the queries are all T keys."""
        return (None, True) if self.S == T and self.q_start == 0 else (self.causal_mask(T), False)

    def store(self, layer, kv, index_key, *, need_keys: bool):
        """Adds this step's latent keys (and indexer keys) and returns all keys
        so far in logical order: [B,T,C+r] (if need_keys: sparse attention
        reads the cache's pool in place instead) and [B,T,Di] (None where unused)."""
        if self.cache is None:
            return kv, index_key
        return self.cache.write(layer, kv, index_key, gather_keys=need_keys)

    def record_selection(self, layer, selection):
        if self.model.record:
            self.model.last_selection[layer] = selection

    def record_routing(self, layer, ids):
        if self.model.record:
            self.model.last_routing[layer] = ids


class GLM5Model(nn.Module):
    def __init__(self, config: GLM5Config):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, c.mlp_layer_types[i] == "sparse", c.indexer_types[i] == "shared")
            for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mtp = nn.ModuleList(MTPLayer(c, c.num_hidden_layers + j) for j in range(c.num_nextn_predict_layers))


class GLM5ForCausalLM(nn.Module):
    """GLM-5. `model(input_ids)` -> logits [B,S,V]; with `cache=model.new_cache(B, max_tokens)`
    the call appends to the cache (prefill, chunked prefill, decode alike)."""

    def __init__(self, config: GLM5Config, *, attn: str = "dsa", fused: bool = True, block_size: int = 64):
        super().__init__()
        if attn not in ATTN_MODES:
            raise ValueError(f"attn must be one of {ATTN_MODES}, got {attn!r}")
        self.config, self.attn, self.fused, self.block_size = config, attn, fused, block_size
        self.model = GLM5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.record = False                      # profiling: keep last_selection / last_routing
        self.last_selection: dict = {}
        self.last_routing: dict = {}
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float | None = None):
        """transformers' initialisation: normal(0, initializer_range) for linear,
        embedding, router and expert weights; ones for norms; zero biases."""
        std = self.config.initializer_range if std is None else std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0, std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, Router):
                m.weight.normal_(0, std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, Experts):
                m.gate_up_proj.normal_(0, std)
                m.down_proj.normal_(0, std)

    # -- construction helpers --------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "GLM5ForCausalLM":
        from .loading import load_pretrained
        return load_pretrained(cls, path, **kwargs)

    def new_cache(self, batch: int, max_tokens: int, *, page_size: int = 64):
        from .cache import PagedCache
        p = next(self.parameters())
        return PagedCache(self.config, batch, max_tokens, page_size=page_size, dtype=p.dtype, device=p.device)

    # -- forward ---------------------------------------------------------------
    def _check_ids(self, input_ids, start: int):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be an integer tensor [B, S], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        V = self.config.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"input_ids must be token ids in [0, vocab_size={V}), got values in [{lo}, {hi}]")
        end = start + input_ids.shape[1]
        if end > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {end} tokens exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")

    def hidden_states(self, input_ids, cache=None):
        """Final normed hidden states [B,S,hidden] (the LM head's and MTP's input)."""
        B, S = input_ids.shape
        start = 0 if cache is None else cache.length
        self._check_ids(input_ids, start)
        if cache is not None:
            cache.begin(B, S)
        with nvtx_range("embed"):
            x = self.model.embed_tokens(input_ids)
        ctx = ForwardContext(self, B, S, start, cache, x.dtype, x.device)
        selection = None
        for layer in self.model.layers:
            x, selection = layer(x, ctx, selection)
        with nvtx_range("norm"):
            x = self.model.norm(x)
        if cache is not None:
            cache.commit(S)
        return x

    def logits(self, hidden):
        with nvtx_range("lm_head"):
            return self.lm_head(hidden)

    def forward(self, input_ids, cache=None, logits_to_keep: int = 0):
        """logits [B,S,V] (the last `logits_to_keep` positions when > 0)."""
        hidden = self.hidden_states(input_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.logits(hidden)

    def mtp_logits(self, hidden, next_ids, cache=None, depth: int = 0, logits_to_keep: int = 0):
        """MTP head `depth`: hidden [B,S,hidden] (positions t) and next_ids [B,S]
        (tokens t+1) -> logits for tokens t+2, [B,S,V] (the last `logits_to_keep`
        positions when > 0). With a cache, the MTP layer's own latent keys are
        appended like any layer's."""
        if not len(self.model.mtp):
            raise RuntimeError("this model has no MTP layer (config.num_nextn_predict_layers == 0, or the "
                               "checkpoint did not contain one)")
        mtp = self.model.mtp[depth]
        B, S = next_ids.shape
        start = 0 if cache is None else cache.mtp_length
        self._check_ids(next_ids, start)
        with nvtx_range("mtp"):
            e = mtp.enorm(self.model.embed_tokens(next_ids))
            x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden)], dim=-1))
            if cache is not None:
                cache.begin(B, S, mtp=True)
            ctx = ForwardContext(self, B, S, start, cache, x.dtype, x.device)
            x, _ = mtp.layer(x, ctx, None)
            if cache is not None:
                cache.commit(S, mtp=True)
            if logits_to_keep:
                x = x[:, -logits_to_keep:]
            return self.lm_head(mtp.shared_head.norm(x))

    @torch.no_grad()
    def prefill(self, input_ids, cache, *, chunk: int = 2048):
        """Feeds input_ids through the cache `chunk` tokens at a time (memory
        O(chunk), the same result as one call); returns the last position's
        logits [B,V] and the final hidden states of every position."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        hiddens = []
        for s in range(0, input_ids.shape[1], chunk):
            hiddens.append(self.hidden_states(input_ids[:, s:s + chunk], cache))
        hidden = torch.cat(hiddens, dim=1) if len(hiddens) > 1 else hiddens[0]
        return self.logits(hidden[:, -1]), hidden


def count_parameters(model: nn.Module) -> int:
    """Parameters of a (possibly meta) model, each shared tensor once."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n
