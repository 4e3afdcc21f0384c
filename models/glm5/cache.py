"""The paged cache GLM-5 decodes from: MLA's compressed latent and the DSA indexer key, per token.

Per layer one pool of `pages x page_size` token slots holds
  latent   [slots, kv_lora_rank + qk_rope_head_dim]  (normed latent, then the roped key)
  index_k  [slots, index_head_dim]                   (layers that run an indexer)
and one block table [B, pages_per_seq] maps a sequence's logical page to a
physical page; pages are taken from a free list as sequences grow, so a
sequence's pages need not be contiguous (they interleave across the batch).
Prefill, chunked prefill and decode all write and read this one layout:
  - the indexer scores a query against the sequence's keys in logical order
    (a gather of index_k: index_head_dim values per token);
  - sparse attention reads the latent pool in place: the chosen logical
    positions are translated to physical slot ids (FlashMLA's paged sparse
    decode does the same), so no per-step copy of the latent is made.
The MTP layers have their own stream: their positions lag the main model's
by the one token they predict ahead, so they keep their own length.
"""
from __future__ import annotations

import torch

import glm5_ops
from glm5_ops._checks import INT32_MAX, int_in_range

from .config import GLM5Config


class PagedCache:
    def __init__(self, config: GLM5Config, batch: int, max_tokens: int, *, page_size: int = 64,
                 dtype=torch.float32, device="cpu"):
        c = config
        # Bounds the sizes imply, so one huge int cannot allocate the cache: no position is past
        # max_position_embeddings, a page larger than that holds nothing more, and slot ids are int32.
        int_in_range(batch, "batch", 1, INT32_MAX)
        int_in_range(max_tokens, "max_tokens", 1, c.max_position_embeddings)
        int_in_range(page_size, "page_size", 1, c.max_position_embeddings)
        slots = batch * -(-max_tokens // page_size) * page_size
        if slots > INT32_MAX:
            raise ValueError(f"batch, max_tokens and page_size must give batch * pages * page_size < 2^31 int32 slot "
                             f"ids, got batch={batch}, max_tokens={max_tokens}, page_size={page_size}")
        self.config, self.batch, self.page_size, self.max_tokens = c, batch, page_size, max_tokens
        self.num_main_layers = c.num_hidden_layers
        layers = c.num_hidden_layers + c.num_nextn_predict_layers
        self.pages_per_seq = -(-max_tokens // page_size)
        slots = batch * self.pages_per_seq * page_size
        self.latent = torch.empty(layers, slots, c.latent_dim, dtype=dtype, device=device)
        indexed = [i for i in range(layers) if i >= c.num_hidden_layers or c.indexer_types[i] == "full"]
        self.index_k = {i: torch.empty(slots, c.index_head_dim, dtype=dtype, device=device) for i in indexed}
        self.block_table = torch.full((batch, self.pages_per_seq), -1, dtype=torch.int64, device=device)
        self.free_pages = list(range(batch * self.pages_per_seq))[::-1]   # pop() takes the lowest
        self.length = 0          # tokens of the main stream held
        self.mtp_length = 0      # tokens of the MTP stream held
        self._step = None        # (start, S) of the forward in progress

    # -- bookkeeping -----------------------------------------------------------
    def begin(self, B: int, S: int, *, mtp: bool = False) -> None:
        if B != self.batch:
            raise ValueError(f"this cache holds batch {self.batch}, got input of batch {B}")
        start = self.mtp_length if mtp else self.length
        if start + S > self.max_tokens:
            raise ValueError(f"cache full: the {start} tokens held plus the {S} of input_ids must fit max_tokens="
                             f"{self.max_tokens}, got {start + S} tokens")
        self._allocate(start + S)
        self._step = (start, S)
        # logical position -> physical slot, with a leading -1 so that slot ids
        # of a selection are lut[selection + 1] (one gather, -1 stays -1)
        self._every = self.slots(start + S)                      # [B, T] int64, once per forward
        self._lut = torch.cat([torch.full((B, 1), -1, dtype=torch.int32, device=self._every.device),
                               self._every.to(torch.int32)], dim=1)
        self._identity = B == 1 and bool((self._every[0] == torch.arange(start + S, device=self._every.device)).all())

    def commit(self, S: int, *, mtp: bool = False) -> None:
        if mtp:
            self.mtp_length += S
        else:
            self.length += S
        self._step = None

    def truncate(self, length: int) -> None:
        """Forget the main stream's tokens past `length` (speculative decoding's rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}")
        self.length = length

    def _allocate(self, tokens: int) -> None:
        need = -(-tokens // self.page_size)
        for p in range(need):             # page p of every sequence, then page p+1: they interleave
            for b in range(self.batch):
                if self.block_table[b, p] < 0:
                    self.block_table[b, p] = self.free_pages.pop()

    def slots(self, T: int) -> torch.Tensor:
        """Physical slot ids [B, T] of every sequence's logical positions 0..T-1."""
        pos = torch.arange(T, device=self.block_table.device)
        return self.block_table[:, pos // self.page_size] * self.page_size + pos % self.page_size

    # -- per-layer reads and writes --------------------------------------------
    def write(self, layer: int, kv, index_key, *, gather_keys: bool):
        """Stores this step's tokens of `layer`; returns (latent keys [B,T,C+r]
        in logical order if gather_keys else None, indexer keys [B,T,Di] or None)."""
        start, S = self._step
        every = self._every
        new = every[:, start:].reshape(-1)
        self.latent[layer].index_copy_(0, new, kv.reshape(-1, kv.shape[-1]).to(self.latent.dtype))
        if index_key is not None:
            self.index_k[layer].index_copy_(0, new, index_key.reshape(-1, index_key.shape[-1]).to(self.latent.dtype))
        T = start + S
        if self._identity:          # the pool's first T slots are the sequence, in order: views
            keys = self.latent[layer][None, :T] if gather_keys else None
            index_keys = self.index_k[layer][None, :T] if index_key is not None else None
        else:
            keys = self.latent[layer][every] if gather_keys else None
            index_keys = self.index_k[layer][every] if index_key is not None else None
        return keys, index_keys

    def sparse_attention(self, layer: int, q, selection, scale: float):
        """glm5_ops.sparse_attention of q [B,S,H,C+r] over the chosen logical
        positions selection [B,S,topk], read in place from the latent pool."""
        B, S, H, D = q.shape
        C = self.config.kv_lora_rank
        if self._identity:          # one sequence on pages 0, 1, 2...: slot = position
            physical = selection
        else:
            physical = self._lut.gather(1, (selection.reshape(B, -1) + 1).long()).view(B, S, -1)
        pool = self.latent[layer][None, :, None, :]            # [1, slots, 1, C+r]
        out, _ = glm5_ops.sparse_attention(q.reshape(1, B * S, H, D), pool, pool[..., :C],
                                           physical.reshape(1, B * S, -1), scale=scale, causal=False)
        return out.view(B, S, H, C)
