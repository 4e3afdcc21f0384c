"""Multi-head latent attention (MLA) with DSA's lightning indexer.

MLA runs in its absorbed form: q_nope is multiplied into the latent space
(W_UK), every head attends over the one cached latent+rope key per token
(MQA, Dk = kv_lora_rank + rope, v = the first kv_lora_rank channels of k),
and W_UV maps the result back. No per-head K/V is built unless the attention
mode asks for the expanded form (many queries: see glm5_ops/plan.py), so
prefill and decode read the same cache. Which keys each query attends to,
and how, is the attention mode's (attention_modes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import glm5_ops
from glm5_ops.nvtx import nvtx_range

from .config import GLM5Config
from .layers import Linear, RMSNorm
from .quantization import Int8Linear
from .workspace import Int8Heads, Workspace, assign, heads_product, joined


class Indexer(nn.Module):
    """DSA's lightning indexer: which keys each query attends to."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, bias=False)

    def key(self, x, cos, sin):
        """The cached indexer key of each token, [B, S, head_dim]."""
        return glm5_ops.rope(self.k_norm(self.wk(x)), cos, sin, self.rope_dim)

    def query(self, x, q_resid, cos, sin):
        """(q [B,S,H,D], w fp32 [B,S,H]) for indexer_topk. transformers scores
        sum_h w_h * relu(q_h.k * D^-0.5) * H^-0.5; both positive scales move
        into w since relu(c*a) = c*relu(a) for c > 0."""
        B, S, _ = x.shape
        q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)
        q = glm5_ops.rope(q, cos, sin, self.rope_dim)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return q, w * (self.n_heads ** -0.5 * self.head_dim ** -0.5)


@dataclass
class AttentionStep:
    """What one MLA call has computed for its attention mode: the input x
    [B,S,hidden], q_nope [B,S,H,nope] and q_rot [B,S,H,rope] (roped), q_resid
    [B,S,q_lora] (the indexer's query input), q [B,S,H,C+r] (absorbed; None in
    the expanded form), and after the cache write keys [B,T,C+r] (None where
    the mode reads the cache in place) and index_keys [B,T,Di] (or None)."""
    x: torch.Tensor
    q_nope: torch.Tensor
    q_rot: torch.Tensor
    q_resid: torch.Tensor
    q: torch.Tensor | None
    expanded: bool
    keys: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None


class MLAttention(nn.Module):
    """Multi-head latent attention; its mode (dsa, block_sparse, dense, ...) comes with the forward's ctx."""

    def __init__(self, config: GLM5Config, layer_idx: int, shared_selection: bool):
        super().__init__()
        c = config
        self.layer_idx, self.config = layer_idx, c
        self.n_heads, self.nope, self.rope_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        self.kv_lora, self.v_dim = c.kv_lora_rank, c.v_head_dim
        self.scale = c.qk_head_dim ** -0.5
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = Linear(c.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.n_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.indexer = None if shared_selection else Indexer(c)
        self._derived = {}   # name -> (kv_b_proj weight version, weight derived from it): see _derived_weight

    def forward(self, x, ctx, prev_selection):
        """x [B,S,hidden] (or several segments packed as [1,N,hidden]: see
        model.ForwardContext) -> (out like x, each segment's selection for a
        following shared layer)."""
        i = self.layer_idx
        with nvtx_range(f"layer{i}/attn/proj"):
            q_nope, q_rot, q_resid, kv = self.project(x, ctx.cos, ctx.sin)
        prev_selection = prev_selection or [None] * len(ctx.segments)
        outs, selections = [], []
        for seg, prev in zip(ctx.segments, prev_selection):
            out, selection = self.attend(seg, *map(seg.take, (x, q_nope, q_rot, q_resid, kv)), prev)
            outs.append(out)
            selections.append(selection)
        with nvtx_range(f"layer{i}/attn/out"):
            return self.o_proj(ctx.join(outs)), selections

    def attend(self, seg, x, q_nope, q_rot, q_resid, kv, prev_selection):
        """One segment's attention, all [B,S,...]: -> (heads' outputs [B,S,H*v], selection)."""
        i, mode = self.layer_idx, seg.mode
        expanded = mode.expanded(self, x.shape[1], seg)
        with nvtx_range(f"layer{i}/attn/proj"):
            q = None if expanded else self.absorb_queries(q_nope, q_rot, seg.workspace)
        step = AttentionStep(x, q_nope, q_rot, q_resid, q, expanded)
        index_key = mode.index_key(self, x, seg)
        step.keys, step.index_keys = seg.store(i, kv, index_key, need_keys=mode.needs_keys(step))
        selection = mode.select(self, step, prev_selection, seg)
        seg.record_selection(i, selection)
        with nvtx_range(f"layer{i}/attn/core"):
            out = mode.attend(self, step, selection, seg)    # [B,S,H,v] expanded, [B,S,H,C] absorbed
        with nvtx_range(f"layer{i}/attn/out"):
            return self.heads_output(out, expanded), selection

    def project(self, x, cos, sin):
        """The projections every mode shares: q_nope [B,S,H,nope], q_rot
        [B,S,H,rope] (roped; in place when reusing, so both stay views of one
        tensor), q_resid [B,S,q_lora] (the indexer's query input) and kv
        [B,S,C+rope], the normed latent and roped k_rot the cache stores."""
        B, S, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, S, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        q_rot = assign(q_rot, glm5_ops.rope(q_rot, cos, sin))
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        kv = torch.cat([self.kv_a_layernorm(latent), glm5_ops.rope(k_rot, cos, sin)], dim=-1)
        return q_nope, q_rot, q_resid, kv

    def _absorb(self):
        """W_UK [H, nope, C] and W_UV [H, v, C] as views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, :self.nope], w[:, self.nope:]

    def _w_uk(self) -> torch.Tensor:
        return self._absorb()[0]

    def _kv_b_int8(self):
        """(q int8 [H, n+v, C], scale [H, n+v]) of an int8 kv_b_proj (models.glm5.quantize), else None."""
        if not isinstance(self.kv_b_proj, Int8Linear):
            return None
        rows = self.nope + self.v_dim
        return (self.kv_b_proj.qweight.view(self.n_heads, rows, self.kv_lora),
                self.kv_b_proj.scale.view(self.n_heads, rows))

    def _w_uv(self):
        """W_UV [H,v,C] for heads_output: int8 views of an int8 kv_b_proj, read in place."""
        int8 = self._kv_b_int8()
        if int8 is None:
            return self._absorb()[1]
        q, scale = int8
        return Int8Heads(q[:, self.nope:], scale[:, self.nope:])

    def _derived_weight(self, name: str, build) -> torch.Tensor:
        """build()'s result, rebuilt only when kv_b_proj's weight changes (inference: no gradient flows through it)."""
        # the stored tensor: an int8 kv_b_proj's .weight would dequantise a fresh copy
        w = self.kv_b_proj.qweight if isinstance(self.kv_b_proj, Int8Linear) else self.kv_b_proj.weight
        if torch.compiler.is_compiling():
            # A traced version check would split the graph: a compiled step takes what
            # build_derived_weights() stored (GLM5ForCausalLM.compile_decode calls it).
            cached = self._derived.get(name)
            return cached[1] if cached is not None else build()
        if w.is_inference():   # made under inference_mode: no version counter to tell a change by
            return build()
        version = (w.data_ptr(), w._version, w.dtype, w.device)
        cached = self._derived.get(name)
        if cached is None or cached[0] != version:
            with torch.no_grad():
                cached = self._derived[name] = (version, build())
        return cached[1]

    def build_derived_weights(self) -> None:
        """Builds and stores every derived weight now, from the current kv_b_proj (what a compiled step reads)."""
        self._derived.clear()
        with torch.no_grad():
            for derive in (self.lifted_w_uk, self.w_uk_rows):
                built = derive()   # stored by _derived_weight, unless the weight is an inference tensor
                self._derived.setdefault(derive.__name__, (None, built))

    def lifted_w_uk(self) -> torch.Tensor:
        """[[W_UK, 0], [0, I]] [H, nope+rope, C+rope] (absorbed_queries' one product with many queries)."""
        def build():
            n, r, C = self.nope, self.rope_dim, self.kv_lora
            w = self.kv_b_proj.weight
            lifted = w.new_zeros(self.n_heads, n + r, C + r)
            lifted[:, :n, :C] = self._absorb()[0]
            lifted[:, n:, C:] = torch.eye(r, dtype=w.dtype, device=w.device)
            return lifted
        return self._derived_weight("lifted_w_uk", build)

    def w_uk_rows(self):
        """W_UK^T [H, C, nope], contiguous: absorbed_queries' product with few queries, row
        by row. Of an int8 kv_b_proj: its int8 rows transposed (Int8Heads), kv_b's row
        scales applied to the query (they run along nope here): exact, nothing requantised."""
        def build():
            int8 = self._kv_b_int8()
            if int8 is None:
                return self._absorb()[0].transpose(1, 2).contiguous()
            q, scale = int8
            w = q[:, :self.nope].transpose(1, 2).contiguous()
            return Int8Heads(w, scale.new_ones(w.shape[:2]), scale[:, :self.nope].contiguous())
        return self._derived_weight("w_uk_rows", build)

    def absorb_queries(self, q_nope, q_rot, workspace: Workspace):
        """The absorbed query [q_nope W_UK, q_rot] [B,S,H,C+r]."""
        return workspace.absorbed_queries(q_nope, q_rot, self._w_uk, self.lifted_w_uk, self.w_uk_rows)

    def expand(self, q_nope, q_rot, keys, workspace: Workspace | None = None):
        """The non-absorbed (per-head) form: q [B,S,H,nope+rope], k [B,T,H,nope+rope]
        and v [B,T,H,v] from the latent keys [B,T,C+rope] through kv_b_proj."""
        workspace = workspace or Workspace()
        B, T, _ = keys.shape
        H, n, r, dv = self.n_heads, self.nope, self.rope_dim, self.v_dim
        latent, k_rot = keys.split([self.kv_lora, r], dim=-1)
        # Head-major [B,H,T,D] storage, returned as [B,T,H,D] views: a head's
        # rows are then consecutive, where token-major rows H * D apart land in
        # a few L1 sets and defeat the prefetcher (lane tiles: 10-20% faster).
        kv = workspace.head_products("expanded_kv", latent, self.kv_b_proj.weight.view(H, n + dv, self.kv_lora))
        k_nope, v = kv.split([n, dv], -1)
        k = torch.cat([k_nope, k_rot[:, None].expand(B, H, T, r)], dim=-1,
                      out=workspace.out("expanded_k", (B, H, T, n + r), keys))
        return joined(q_nope, q_rot), k.transpose(1, 2), v.transpose(1, 2)

    def heads_output(self, out, expanded: bool):
        """The heads' outputs as o_proj's input [B,S,H*v], from [B,S,H,v] (expanded)
        or [B,S,H,C] (absorbed, through W_UV)."""
        B, S = out.shape[:2]
        if not expanded:
            out = heads_product(out, self._w_uv())   # W_UV [H,v,C]: rows contiguous, read in place
        return out.reshape(B, S, self.n_heads * self.v_dim)
