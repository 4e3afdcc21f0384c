"""A few-layer stand-in for models.glm5.GLM5ForCausalLM with the same
interface and range names (the model contract in profiling/profile_cmd.py),
built from the real glm5_ops kernels. Lets the profiler's tests check the
report machinery against known structure without the full model."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import glm5_ops
from glm5_ops.nvtx import nvtx_range


class FakeCache:
    def __init__(self, model, batch, max_tokens):
        D = model.dim
        self.k = torch.zeros(len(model.layers), batch, max_tokens, 1, D)
        self.idx_k = torch.zeros(len(model.layers), batch, max_tokens, D)
        self.length = 0


class FakeGLM5(torch.nn.Module):
    """Layer 0 dense MLP, layers 1.. MoE; MLA-like absorbed attention (Hkv=1, v = k)."""

    def __init__(self, *, layers=2, dim=32, heads=2, vocab=64, experts=4, top_k=2, index_topk=8,
                 attn="dsa", fused=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        p = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1)  # noqa: E731
        self.dim, self.heads, self.experts, self.top_k, self.index_topk = dim, heads, experts, top_k, index_topk
        self.attn, self.fused = attn, fused
        self.embed = p(vocab, dim)
        self.layers = torch.nn.ModuleList()
        for i in range(layers):
            m = torch.nn.Module()
            m.wq, m.wk, m.wo = p(heads * dim, dim), p(dim, dim), p(dim, heads * dim)
            m.iq, m.iw = p(4 * dim, dim), p(4, dim)
            if i == 0:
                m.w1, m.w2 = p(2 * dim, dim), p(dim, 2 * dim)
            else:
                m.gate, m.bias = p(experts, dim), torch.nn.Parameter(torch.zeros(experts), requires_grad=False)
                m.w_gate_up, m.w_down = p(experts, 2 * dim, dim), p(experts, dim, dim)
            self.layers.append(m)
        self.head = p(vocab, dim)
        self.last_routing, self.last_selection = [], []

    def new_cache(self, batch, max_tokens):
        return FakeCache(self, batch, max_tokens)

    def _attention(self, i, m, h, cache):
        B, S, D = h.shape
        with nvtx_range(f"layer{i}/attn/proj"):
            q = (h @ m.wq.T).view(B, S, self.heads, D)
            k = (h @ m.wk.T).view(B, S, 1, D)
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.k[i, :, start:start + S] = k
            k = cache.k[i, :, :start + S]
        T = k.shape[1]
        if self.attn == "dense":
            with nvtx_range(f"layer{i}/attn/core"):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).expand(B, self.heads, T, D),
                                                   k.transpose(1, 2).expand(B, self.heads, T, D),
                                                   is_causal=S > 1).transpose(1, 2)
            self.last_selection.append(None)
        else:
            with nvtx_range(f"layer{i}/attn/indexer"):
                iq = (h @ m.iq.T).view(B, S, 4, D)
                iw = h @ m.iw.T
                ik = k[:, :, 0]
                topk = min(self.index_topk, T)
                if self.fused:
                    sel = glm5_ops.indexer_topk(iq, iw, ik, topk)
                else:
                    scores = glm5_ops.indexer_scores(iq, iw, ik)
            if not self.fused:
                with nvtx_range(f"layer{i}/attn/topk"):
                    sel = glm5_ops.topk_indices(scores, topk)
            with nvtx_range(f"layer{i}/attn/core"):
                o, _ = glm5_ops.sparse_attention(q, k, k, sel, causal=True)
            self.last_selection.append(sel)
        with nvtx_range(f"layer{i}/attn/out"):
            return o.reshape(B, S, -1) @ m.wo.T

    def _moe(self, i, m, h):
        x = h.reshape(-1, h.shape[-1])
        with nvtx_range(f"layer{i}/moe/route"):
            weights, ids = glm5_ops.moe_route(x, m.gate, m.bias, top_k=self.top_k)
        self.last_routing.append(ids)
        if self.fused:
            with nvtx_range(f"layer{i}/moe/experts"):
                y = glm5_ops.fused_moe(x, m.w_gate_up, m.w_down, weights, ids)
        else:
            with nvtx_range(f"layer{i}/moe/dispatch"):
                xs, plan = glm5_ops.moe_dispatch(x, ids, self.experts)
            with nvtx_range(f"layer{i}/moe/experts"):
                off = plan.expert_offsets.tolist()
                ys = torch.cat([F.silu(xs[a:b] @ m.w_gate_up[e, :self.dim].T) * (xs[a:b] @ m.w_gate_up[e, self.dim:].T)
                                @ m.w_down[e].T for e, (a, b) in enumerate(zip(off[:-1], off[1:]))])
            with nvtx_range(f"layer{i}/moe/combine"):
                y = glm5_ops.moe_combine(ys, plan, weights)
        return y.view_as(h)

    def forward(self, input_ids, cache=None, logits_to_keep=None):
        self.last_routing, self.last_selection = [], []
        with nvtx_range("embed"):
            h = self.embed[input_ids]
        for i, m in enumerate(self.layers):
            with nvtx_range(f"layer{i}/attn_norm"):
                a = F.rms_norm(h, (self.dim,))
            h = h + self._attention(i, m, a, cache)
            with nvtx_range(f"layer{i}/mlp_norm"):
                a = F.rms_norm(h, (self.dim,))
            if i == 0:
                with nvtx_range(f"layer{i}/mlp"):
                    h = h + F.silu(a @ m.w1.T) @ m.w2.T
            else:
                h = h + self._moe(i, m, a)
        if cache is not None:
            cache.length += input_ids.shape[1]
        with nvtx_range("norm"):
            h = F.rms_norm(h, (self.dim,))
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        with nvtx_range("lm_head"):
            return h @ self.head.T
