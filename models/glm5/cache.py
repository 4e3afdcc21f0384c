"""The paged cache GLM-5 decodes from: MLA's compressed latent and the DSA indexer key, per token.

A KVPool holds, per layer, `pages x page_size` token slots:
  latent   [slots, kv_lora_rank + qk_rope_head_dim]  (normed latent, then the roped key)
  index_k  [slots, index_head_dim]                   (layers that run an indexer)
A page id p names slots [p * page_size, (p + 1) * page_size) in every layer's
pool, so one page table serves the latent and the indexer keys alike (a
prefix-cache hit reuses both). A sequence's block table maps its logical page
i to a page id; pages need not be contiguous.

A CacheView is what one forward segment reads and writes: B sequences, each
at its own start position (an int when they share it, else an int64 [B]
tensor), S new tokens each. Prefill, chunked prefill and decode all use it:
  - the indexer scores a query against the sequence's keys in logical order
    (a gather of index_k: index_head_dim values per token);
  - sparse attention reads the latent pool in place: the chosen logical
    positions are translated to physical slot ids (FlashMLA's paged sparse
    decode does the same), so no per-step copy of the latent is made.
Sequences shorter than the segment's longest read padding past their end;
the ops' causal rule (key t visible to query s of sequence b iff
t <= start[b] + s) masks it. Every such position reads the pool's null slot,
zeros kept past the pages, never a real slot: a real slot past a sequence's
end may hold anything (torch.empty's heap contents, or -inf / NaN left by
earlier tensors), and a masked score is q.k + (-inf), NaN when q.k is, and a
masked value's weight 0 times NaN is NaN too (dense attention reads every
key of the segment; it made a busy batch's tokens depend on what the process
had freed before).

PagedCache is the simple owner: a batch that moves in lock step (one length),
its pages taken from its own pool as it grows (generate(), profiling). The
serving engine (serving/) owns a shared pool and builds views per step. The
MTP layers have their own stream: their positions lag the main model's by
the one token they predict ahead, so they keep their own length.
"""
from __future__ import annotations

import torch

import glm5_ops
from glm5_ops._checks import INT32_MAX, int_in_range
from glm5_ops.memory import huge_page_empty

from .config import GLM5Config


class KVPool:
    def __init__(self, config: GLM5Config, num_pages: int, page_size: int, *, dtype=torch.float32, device="cpu"):
        try:
            self._allocate(config, num_pages, page_size, dtype, device)
        except RuntimeError as e:   # the allocator's "can't allocate memory" (CPU) or out of memory (CUDA)
            if "allocate" not in str(e) and "out of memory" not in str(e):
                raise
            need = KVPool.bytes_per_token(config, dtype) * num_pages * page_size
            # a ValueError: the sizes asked are at fault (PagedCache names its own arguments instead)
            raise ValueError(f"num_pages and page_size must give a pool that fits in memory, got num_pages={num_pages} "
                             f"and page_size={page_size}: a pool of {need / 2**30:.1f} GiB on {device}, more than "
                             "can be allocated") from e

    def _allocate(self, config, num_pages, page_size, dtype, device):
        c = config
        int_in_range(num_pages, "num_pages", 1, INT32_MAX)
        int_in_range(page_size, "page_size", 1, c.max_position_embeddings)
        if num_pages * page_size > INT32_MAX:
            raise ValueError(f"num_pages * page_size must be < 2^31 (int32 slot ids), got {num_pages} * {page_size}")
        self.config, self.num_pages, self.page_size = c, num_pages, page_size
        slots = num_pages * page_size
        # One slot past the pages: the null slot padding reads (zeros: finite whatever is masked).
        self.null_slot = slots
        # huge pages: a step reads index_topk scattered rows a layer (glm5_ops/memory.py)
        self.latent = huge_page_empty((self.num_layers(c), slots + 1, c.latent_dim), dtype, device)
        self.latent[:, slots].zero_()
        self.index_k = {i: huge_page_empty((slots + 1, c.index_head_dim), dtype, device)
                        for i in self.indexed_layers(c)}
        for keys in self.index_k.values():
            keys[slots].zero_()

    @staticmethod
    def num_layers(c: GLM5Config) -> int:
        return c.num_hidden_layers + c.num_nextn_predict_layers

    @staticmethod
    def indexed_layers(c: GLM5Config) -> list[int]:
        """Layers that cache an indexer key: those running their own indexer, and MTP's."""
        return [i for i in range(KVPool.num_layers(c)) if i >= c.num_hidden_layers or c.indexer_types[i] == "full"]

    @staticmethod
    def bytes_per_token(c: GLM5Config, dtype=torch.float32) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return size * (KVPool.num_layers(c) * c.latent_dim + len(KVPool.indexed_layers(c)) * c.index_head_dim)


class CacheView:
    """B sequences of a pool, block_table [B, pages] int64 (-1 past a sequence's
    pages), each with its new tokens at positions start[b] .. start[b] + S - 1."""

    def __init__(self, pool: KVPool, block_table: torch.Tensor, start, S: int):
        self.pool, self.start, self.S = pool, start, S
        B = block_table.shape[0]
        ps = pool.page_size
        T = (start if isinstance(start, int) else int(start.max())) + S
        pos = torch.arange(T, device=block_table.device)
        pages = block_table[:, pos // ps]
        starts = torch.as_tensor(start, device=block_table.device).expand(B)[:, None]
        # logical position -> physical slot [B, T], once per forward; past a sequence's end
        # (masked) the null slot, whose zeros keep a masked score or value finite
        self.every = torch.where((pages >= 0) & (pos < starts + S), pages * ps + pos % ps, pool.null_slot)
        self.new = self.every.gather(1, starts + torch.arange(S, device=block_table.device)).reshape(-1)
        # with a leading -1, the slot ids of a selection are lut[selection + 1] (one gather, -1 stays -1)
        self._lut = torch.cat([torch.full((B, 1), -1, dtype=torch.int32, device=block_table.device),
                               self.every.to(torch.int32)], dim=1)
        # one sequence on pages 0, 1, 2...: slot = position, and the pool's first T slots are views
        self._identity = B == 1 and bool((self.every[0] == pos).all())

    @classmethod
    def in_lock_step(cls, pool: KVPool, slot_of: torch.Tensor, lut: torch.Tensor, start: int, S: int,
                     identity: bool) -> "CacheView":
        """The view of B sequences that all hold positions 0..start+S-1 (PagedCache), from
        tables kept up to date as pages are allocated: slot_of [B, capacity] int64 (position
        -> slot) and lut [B, 1 + capacity] int32 (-1, then slot_of). The same fields as
        __init__ computes from a block table (tests/test_model.py checks they agree) in three
        tensor ops instead of ~14: on the CPU those were ~0.35 ms of a ~6 ms decode step."""
        view = cls.__new__(cls)
        T = start + S
        view.pool, view.start, view.S = pool, start, S
        view.every = slot_of[:, :T]
        view.new = slot_of[:, start:T].reshape(-1).clone()
        view._lut = lut[:, :T + 1]
        view._identity = identity
        return view

    def write(self, layer: int, kv, index_key, *, gather_keys: bool):
        """Stores this step's tokens of `layer`; returns (latent keys [B,T,C+r]
        in logical order if gather_keys else None, indexer keys [B,T,Di] or None)."""
        latent = self.pool.latent[layer]
        glm5_ops.cache_write(latent, self.new, kv.reshape(-1, kv.shape[-1]).to(latent.dtype))
        if index_key is not None:
            glm5_ops.cache_write(self.pool.index_k[layer], self.new,
                                 index_key.reshape(-1, index_key.shape[-1]).to(latent.dtype))
        T = self.every.shape[1]
        if self._identity:
            keys = latent[None, :T] if gather_keys else None
            index_keys = self.pool.index_k[layer][None, :T] if index_key is not None else None
        else:
            keys = latent[self.every] if gather_keys else None
            index_keys = self.pool.index_k[layer][self.every] if index_key is not None else None
        return keys, index_keys

    def sparse_attention(self, layer: int, q, selection, scale: float):
        """glm5_ops.sparse_attention of q [B,S,H,C+r] over the chosen logical
        positions selection [B,S,topk], read in place from the latent pool."""
        B, S, H, D = q.shape
        C = self.pool.config.kv_lora_rank
        if self._identity:
            physical = selection
        else:
            physical = self._lut.gather(1, (selection.reshape(B, -1) + 1).long()).view(B, S, -1)
        pool = self.pool.latent[layer][None, :, None, :]            # [1, slots, 1, C+r]
        out, _ = glm5_ops.sparse_attention(q.reshape(1, B * S, H, D), pool, pool[..., :C],
                                           physical.reshape(1, B * S, -1), scale=scale, causal=False)
        return out.view(B, S, H, C)


class PagedCache:
    """A batch of B sequences in lock step, in its own pool sized for max_tokens each."""

    def __init__(self, config: GLM5Config, batch: int, max_tokens: int, *, page_size: int = 64,
                 dtype=torch.float32, device="cpu"):
        c = config
        # Bounds the sizes imply, so one huge int cannot allocate the cache: no position is past
        # max_position_embeddings, a page larger than that holds nothing more, and slot ids are int32.
        int_in_range(batch, "batch", 1, INT32_MAX)
        int_in_range(max_tokens, "max_tokens", 1, c.max_position_embeddings)
        int_in_range(page_size, "page_size", 1, c.max_position_embeddings)
        if batch * -(-max_tokens // page_size) * page_size > INT32_MAX:
            raise ValueError(f"batch, max_tokens and page_size must give batch * pages * page_size < 2^31 int32 slot "
                             f"ids, got batch={batch}, max_tokens={max_tokens}, page_size={page_size}")
        self.config, self.batch, self.page_size, self.max_tokens = c, batch, page_size, max_tokens
        self.pages_per_seq = -(-max_tokens // page_size)
        try:
            self.pool = KVPool(c, batch * self.pages_per_seq, page_size, dtype=dtype, device=device)
        except ValueError as e:
            if not isinstance(e.__cause__, RuntimeError):   # an argument check, not the allocation
                raise
            need = KVPool.bytes_per_token(c, dtype) * batch * self.pages_per_seq * page_size
            raise ValueError(f"batch, max_tokens and page_size must give a cache that fits in memory, got batch={batch}, "
                             f"max_tokens={max_tokens} and page_size={page_size}: a cache of {need / 2**30:.1f} GiB on "
                             f"{device}, more than can be allocated") from e.__cause__
        self.block_table = torch.full((batch, self.pages_per_seq), -1, dtype=torch.int64, device=device)
        self.free_pages = list(range(batch * self.pages_per_seq))[::-1]   # pop() takes the lowest
        self.pages_allocated = 0   # pages 0..pages_allocated-1 of every sequence hold a page
        # CacheView.in_lock_step's tables, written as pages are allocated: position -> slot
        # (the null slot until allocated), the same as int32 after a -1, and whether
        # slot = position (one sequence on pages 0, 1, 2, ...)
        self._slot_of = torch.full((batch, self.pages_per_seq * page_size), self.pool.null_slot, dtype=torch.int64,
                                   device=device)
        self._lut = torch.full((batch, 1 + self.pages_per_seq * page_size), -1, dtype=torch.int32, device=device)
        self._page_offsets = torch.arange(page_size, device=device)
        self._identity = batch == 1
        self.length = 0          # tokens of the main stream held
        self.mtp_length = 0      # tokens of the MTP stream held

    def begin(self, B: int, S: int, *, mtp: bool = False, name: str = "input_ids") -> CacheView:
        """The view a forward of S new tokens per sequence writes through;
        `name`: the caller's argument that holds those tokens, for the errors."""
        if B != self.batch:
            raise ValueError(f"{name} must have the batch this cache holds ({self.batch}: new_cache's batch, the "
                             f"batch of what was prefilled into it), got batch {B}")
        start = self.mtp_length if mtp else self.length
        if start + S > self.max_tokens:
            raise ValueError(f"cache full: the {start} tokens held plus the {S} of {name} must fit max_tokens="
                             f"{self.max_tokens}, got {start + S} tokens")
        self._allocate(start + S)
        return CacheView.in_lock_step(self.pool, self._slot_of, self._lut, start, S, self._identity)

    def commit(self, S: int, *, mtp: bool = False) -> None:
        if mtp:
            self.mtp_length += S
        else:
            self.length += S

    def truncate(self, length: int) -> None:
        """Forget the main stream's tokens past `length` (speculative decoding's rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}")
        self.length = length

    def _allocate(self, tokens: int) -> None:
        # Only the pages past those held: testing every page's entry each step
        # was ~4 tensor ops a page, ~1,000 a decode step at 16K tokens.
        need = -(-tokens // self.page_size)
        ps = self.page_size
        for p in range(self.pages_allocated, need):   # page p of every sequence, then page p+1: they interleave
            for b in range(self.batch):
                page = self.free_pages.pop()
                self.block_table[b, p] = page
                self._slot_of[b, p * ps:(p + 1) * ps] = page * ps + self._page_offsets
                self._identity = self._identity and page == p
        if need > self.pages_allocated:
            lo, hi = self.pages_allocated * ps, need * ps
            self._lut[:, 1 + lo:1 + hi] = self._slot_of[:, lo:hi]
            self.pages_allocated = need

    def slots(self, T: int) -> torch.Tensor:
        """Physical slot ids [B, T] of every sequence's logical positions 0..T-1."""
        pos = torch.arange(T, device=self.block_table.device)
        return self.block_table[:, pos // self.page_size] * self.page_size + pos % self.page_size
