"""GLM-5 (transformers' GlmMoeDsaForCausalLM) composed from the lab's kernels.

Module and parameter names follow the HF checkpoint, so a state dict loads
as is (models/glm5/loading.py only stacks per-expert tensors). What differs
from transformers is how each piece computes, not what:

- MLA (mla.py) runs in its absorbed form: q_nope is multiplied into the
  latent space (W_UK), every head attends over the one cached latent+rope
  key per token, and W_UV maps the result back; so prefill and decode read
  the same cache. Prefill with many queries may expand per-head K/V where
  that costs less (glm5_ops/plan.py).
- Attention modes (attention_modes.py, one class each, registered by name):
  "dsa" (the indexer's fused `indexer_topk`, then `sparse_attention`),
  "block_sparse" (`block_topk_mask` + `block_sparse_attention`), "dense"
  (every causal key: the baseline). Chosen at construction or for a block:
  `with model.attention("dense"): ...`.
- MoE (moe.py): `moe_route` then `fused_moe` (dispatch, grouped SwiGLU, combine).
  fused=False runs the unfused ops (indexer_scores + topk_indices;
  moe_dispatch + per-expert GEMMs + moe_combine) so a profile sees each part.
- Without autograd, buffers are reused and tensors updated in place (workspace.py).

Every component is wrapped in a glm5_ops.nvtx range named as in
docs/ARCHITECTURE.md, "NVTX ranges" (layer{i}/attn/indexer, layer{i}/moe/experts, ...).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from glm5_ops._checks import INDEX_DTYPES, INT32_MAX, dtype_name, int_in_range
from glm5_ops.memory import weights_on_huge_pages
from glm5_ops.nvtx import nvtx_range

from .cache import CacheView
from .attention_modes import DEFAULT_ATTENTION, AttentionMode, attention_mode
from .config import GLM5Config
from .decode_compile import compile_layers
from .layers import MLP, Linear, RMSNorm, rope_cos_sin
from .mla import MLAttention
from .moe import MoE, Experts, Router
from .workspace import Workspace

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
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config, layer_idx, sparse_mlp=True, shared_selection=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Segment:
    """B sequences of one forward with S new tokens each, sequence b's at
    positions start[b] .. start[b] + S - 1 (start: an int shared by all, or an
    int64 [B] tensor), read and written through cache (a CacheView, or None)."""
    B: int
    S: int
    start: int | torch.Tensor = 0
    cache: CacheView | None = None

    @property
    def end(self) -> int:
        """One past the last position of the longest sequence: the keys the segment reads."""
        return (self.start if isinstance(self.start, int) else int(self.start.max())) + self.S


class ForwardContext:
    """What one forward shares across layers: the rope tables of its tokens,
    the attention mode, its segments, and what profiling may inspect.

    One forward may pack several segments (the serving engine: the decodes of
    many sequences at different lengths, and prefill chunks) as x [1, N,
    hidden], N = sum of B * S. Everything but attention is per token and runs
    on all N at once (each weight read once per forward); attention runs per
    segment on its [B, S] view. A forward of one segment (x [B, S, hidden])
    is the same code with views that are the whole tensors."""

    def __init__(self, model, positions, segments: list[Segment], dtype):
        c = model.config
        self.model, self.mode, self.fused, self.block_size = model, model.attention_mode, model.fused, model.block_size
        self.cos, self.sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, dtype)
        if len(segments) == 1 and positions.shape[0] == segments[0].B:
            self.segments = [SegmentContext(self, segments[0], None)]
        else:
            offsets = [0]
            for seg in segments:
                offsets.append(offsets[-1] + seg.B * seg.S)
            self.segments = [SegmentContext(self, seg, slice(lo, hi))
                             for seg, lo, hi in zip(segments, offsets, offsets[1:])]

    def join(self, per_segment: list[torch.Tensor]) -> torch.Tensor:
        """The segments' [B,S,...] results as one tensor laid out like the forward's x."""
        if self.segments[0].rows is None:
            return per_segment[0]
        return torch.cat([t.reshape(1, -1, *t.shape[2:]) for t in per_segment], dim=1)

    def record_routing(self, layer, ids):
        if self.model.record:
            self.model.last_routing[layer] = ids


class SegmentContext:
    """What an attention mode sees of one segment: its sequences' start
    positions (q_start), rope tables, cache view, masks and workspace (the
    buffers its layers reuse)."""

    def __init__(self, fwd: ForwardContext, seg: Segment, rows: slice | None):
        self.model, self.mode, self.fused, self.block_size = fwd.model, fwd.mode, fwd.fused, fwd.block_size
        self.rows, self.B, self.S, self.q_start, self.cache, self.end = rows, seg.B, seg.S, seg.start, seg.cache, seg.end
        self.cos, self.sin = self.take(fwd.cos), self.take(fwd.sin)
        self.device = self.cos.device
        self.workspace = Workspace()
        self._mask = self._every_key = None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This segment's [B, S, ...] view of a per-token tensor of the forward."""
        if self.rows is None:
            return t
        return t[0, self.rows].view(self.B, self.S, *t.shape[2:])

    def causal_mask(self, T: int):
        """Bool, key t visible to query s (t <= q_start + s): [S, T], or [B, S, T]
        when the sequences start at different positions; built once per forward."""
        if self._mask is None or self._mask.shape[-1] != T:
            start = self.q_start if isinstance(self.q_start, int) else self.q_start[:, None]
            pos_q = start + torch.arange(self.S, device=self.device)
            self._mask = torch.arange(T, device=self.device) <= pos_q[..., None]
        return self._mask

    def every_key_selection(self, T: int):
        """int32 [B, S, T]: each query's causal keys 0..T-1, -1 past its own
        position (DSA's choice while the context fits index_topk); built once
        per forward, shared by its layers."""
        if self._every_key is None or self._every_key.shape[-1] != T:
            keys = torch.arange(T, dtype=torch.int32, device=self.device)
            self._every_key = torch.where(self.causal_mask(T), keys, -1).expand(self.B, self.S, T)
        return self._every_key

    def sdpa_mask(self, T: int):
        """(attn_mask, is_causal) for SDPA: its own causal flag when the queries are all T keys."""
        if self.S == T and isinstance(self.q_start, int) and self.q_start == 0:
            return None, True
        mask = self.causal_mask(T)
        return (mask if mask.dim() == 2 else mask[:, None]), False

    def store(self, layer, kv, index_key, *, need_keys: bool):
        """Adds this step's latent keys (and indexer keys) and returns all keys
        so far in logical order: [B,T,C+r] (if need_keys: sparse attention
        reads the cache's pool in place instead) and [B,T,Di] (None where unused)."""
        if self.cache is None:
            return kv, index_key
        return self.cache.write(layer, kv, index_key, gather_keys=need_keys)

    def record_selection(self, layer, selection):
        if self.model.record and self.rows is None:
            self.model.last_selection[layer] = selection


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

    def __init__(self, config: GLM5Config, *, attn: str | AttentionMode = DEFAULT_ATTENTION, fused: bool = True,
                 block_size: int = 64):
        super().__init__()
        self.attention_mode = attention_mode(attn)
        self.config, self.fused, self.block_size = config, fused, block_size
        self.model = GLM5Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.record = False                      # profiling: keep last_selection / last_routing
        self.last_selection: dict = {}
        self.last_routing: dict = {}
        self._decode_layers = None               # compile_decode()'s compiled _layers
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()
            weights_on_huge_pages(self)   # decode streams them: glm5_ops/memory.py says why

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

    @property
    def attn(self) -> str:
        """The attention mode's name ("dsa", "block_sparse", "dense", or one registered later)."""
        return self.attention_mode.name

    @contextlib.contextmanager
    def attention(self, mode: str | AttentionMode):
        """Runs the block with attention mode `mode` (a registered name or an
        AttentionMode); the previous mode comes back afterwards, even on an exception."""
        previous, self.attention_mode = self.attention_mode, attention_mode(mode, "mode")
        try:
            yield self
        finally:
            self.attention_mode = previous

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
    @staticmethod
    def _check_ids_type(input_ids, name: str = "input_ids"):
        """Rank and dtype, before anything unpacks the shape: int32 or int64,
        the index dtypes the embedding takes (uint8 and the like are refused
        here, not by the embedding's RuntimeError)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in INDEX_DTYPES:
            what = dtype_name(input_ids.dtype) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"{name} must be an integer tensor [B, S] of dtype int32 or int64, got "
                             f"{what} {tuple(getattr(input_ids, 'shape', ()))}")

    def _check_ids(self, input_ids, start: int, name: str = "input_ids"):
        self._check_ids_type(input_ids, name)
        if input_ids.numel() == 0:
            raise ValueError(f"{name} must hold at least one token, got shape {tuple(input_ids.shape)}")
        V = self.config.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"{name} must be token ids in [0, vocab_size={V}), got values in [{lo}, {hi}]")
        end = start + input_ids.shape[1]
        if end > self.config.max_position_embeddings:
            raise ValueError(f"{name} must end within max_position_embeddings={self.config.max_position_embeddings} "
                             f"positions, got a sequence of {end} tokens ({start} held + {input_ids.shape[1]})")

    def hidden_states(self, input_ids, cache=None):
        """Final normed hidden states [B,S,hidden] (the LM head's and MTP's input)."""
        start = 0 if cache is None else cache.length
        self._check_ids(input_ids, start)
        B, S = input_ids.shape
        view = None if cache is None else cache.begin(B, S)
        positions = (start + torch.arange(S, device=input_ids.device))[None].expand(B, S)
        layers = self._decode_layers if self._decode_layers is not None and S == 1 and view is not None else self._layers
        x = layers(input_ids, positions, [Segment(B, S, start, view)])
        if cache is not None:
            cache.commit(S)
        return x

    def packed_hidden_states(self, input_ids, positions, segments: list[Segment]):
        """One forward over several segments packed as input_ids [1, N] (each
        segment's B x S tokens, sequence by sequence) with their positions [1, N]:
        the serving engine's step (decodes at different lengths and prefill
        chunks together). Returns the final normed hidden states [1, N, hidden]."""
        self._check_ids(input_ids, 0)
        if input_ids.shape[0] != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"packed input_ids and positions must both be [1, N], got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        if not segments or sum(seg.B * seg.S for seg in segments) != input_ids.shape[1]:
            raise ValueError(f"segments must cover the {input_ids.shape[1]} packed tokens, got "
                             f"{sum(seg.B * seg.S for seg in segments)}")
        return self._layers(input_ids, positions, segments)

    def compile_decode(self, **options) -> "GLM5ForCausalLM":
        """From now on a decode step (one new token per sequence, through a cache)
        runs the layers through torch.compile(**options): one graph of the whole
        stack, the Python around each op gone (bench/RESULTS.md, "Decode compiled").
        The first steps compile (about a minute for `small` on 2 cores; once more when
        the context length first changes, which makes it dynamic, and when it passes
        index_topk). MLA's weights derived from kv_b_proj are built now: after
        changing the weights, call compile_decode() again. Prefill, MTP and the
        serving engine's packed steps stay eager. The step is specialised to the
        model as it is now (Dynamo's guards on its modules are dropped: ~0.6 ms a
        step): after changing its structure (quantize, attention mode, `record`),
        call compile_decode() again; weights changed in place are read at each step
        (decode_compile.py says why and how). Returns the model."""
        for layer in list(self.model.layers) + [mtp.layer for mtp in self.model.mtp]:
            layer.self_attn.build_derived_weights()
        self._decode_layers = compile_layers(self, options)
        return self

    def _layers(self, input_ids, positions, segments):
        with nvtx_range("embed"):
            x = self.model.embed_tokens(input_ids)
        ctx = ForwardContext(self, positions, segments, x.dtype)
        selection = None
        for layer in self.model.layers:
            x, selection = layer(x, ctx, selection)
        with nvtx_range("norm"):
            return self.model.norm(x)

    def logits(self, hidden):
        with nvtx_range("lm_head"):
            return self.lm_head(hidden)

    def forward(self, input_ids, cache=None, logits_to_keep: int = 0):
        """logits [B,S,V] (the last `logits_to_keep` positions when > 0)."""
        int_in_range(logits_to_keep, "logits_to_keep", 0, INT32_MAX)
        hidden = self.hidden_states(input_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.logits(hidden)

    def mtp_logits(self, hidden, next_ids, cache=None, depth: int = 0, logits_to_keep: int = 0):
        """MTP head `depth`: hidden [B,S,hidden] (positions t) and next_ids [B,S]
        (tokens t+1) -> logits for tokens t+2, [B,S,V] (the last `logits_to_keep`
        positions when > 0). With a cache, the MTP layer's own latent keys are
        appended like any layer's."""
        int_in_range(logits_to_keep, "logits_to_keep", 0, INT32_MAX)
        start = 0 if cache is None else cache.mtp_length
        self._check_ids(next_ids, start, "next_ids")
        B, S = next_ids.shape
        view = None if cache is None else cache.begin(B, S, mtp=True, name="next_ids")
        positions = (start + torch.arange(S, device=next_ids.device))[None].expand(B, S)
        x = self._mtp_hidden(hidden, next_ids, positions, [Segment(B, S, start, view)], depth)
        if cache is not None:
            cache.commit(S, mtp=True)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.mtp_head(x, depth)

    def packed_mtp_hidden(self, hidden, next_ids, positions, segments: list[Segment], depth: int = 0):
        """MTP over a packed forward (see packed_hidden_states): the main model's
        hidden [1,N,hidden] at positions t and the tokens t+1 [1,N]; the MTP
        layer's keys go to the same pages at the same positions. Returns its
        hidden states [1,N,hidden]; mtp_head() of the rows wanted gives the logits of tokens t+2."""
        self._check_ids(next_ids, 0, "next_ids")
        return self._mtp_hidden(hidden, next_ids, positions, segments, depth)

    def _mtp_hidden(self, hidden, next_ids, positions, segments, depth):
        if not len(self.model.mtp):
            raise RuntimeError("this model has no MTP layer (config.num_nextn_predict_layers == 0, or the "
                               "checkpoint did not contain one)")
        mtp = self.model.mtp[depth]
        with nvtx_range("mtp"):
            e = mtp.enorm(self.model.embed_tokens(next_ids))
            x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden)], dim=-1))
            ctx = ForwardContext(self, positions, segments, x.dtype)
            return mtp.layer(x, ctx, None)[0]

    def mtp_head(self, x, depth: int = 0):
        """Logits from MTP hidden states (its own norm, the main model's LM head)."""
        with nvtx_range("mtp"):
            return self.lm_head(self.model.mtp[depth].shared_head.norm(x))

    @torch.inference_mode()
    def prefill(self, input_ids, cache, *, chunk: int = 2048):
        """Feeds input_ids through the cache `chunk` tokens at a time (memory
        O(chunk), the same result as one call); returns the last position's
        logits [B,V] and the final hidden states of every position."""
        int_in_range(chunk, "chunk", 1, INT32_MAX)
        # the whole input up front (an empty one has no chunk to run; hidden_states checks each chunk too)
        self._check_ids(input_ids, 0 if cache is None else cache.length)
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
