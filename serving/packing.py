"""One engine step's chunks packed into one model forward.

The decodes (one new token each, at different lengths) form one segment of
B sequences with per-sequence start positions; every prefill chunk is a
segment of its own (one sequence, many queries: the kernels' prefill path).
All their tokens are packed as [1, N], so the projections, MLPs and experts
read their weights once for the whole step (see models/glm5/model.py,
ForwardContext). Each segment reads and writes the shared pool through its
own block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.glm5.cache import CacheView, KVPool
from models.glm5.model import Segment

# What static batching's padding computes (any id: causality hides pad positions from real queries).
PAD_TOKEN_ID = 0


@dataclass
class PackedStep:
    input_ids: torch.Tensor        # [1, N]
    positions: torch.Tensor        # [1, N]
    segments: list[Segment]
    chunks: list                   # the scheduler's chunks, in packed order
    offsets: list[int]             # chunk i's tokens (then its padding) are rows offsets[i] .. offsets[i+1] - 1 of N
    sampled: list                  # the chunks that reach the end of their request's tokens (and drafts)
    sample_rows: list[int]         # rows whose logits are sampled: per sampled chunk, its last 1 + drafts


def block_table(requests, device) -> torch.Tensor:
    """[B, pages] int64 of the requests' page ids, -1 past each one's pages."""
    width = max(len(r.block_ids) for r in requests)
    table = torch.full((len(requests), width), -1, dtype=torch.int64)
    for b, r in enumerate(requests):
        table[b, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int64)
    return table.to(device)


def pack(chunks, pool: KVPool, device) -> PackedStep:
    decodes = [c for c in chunks if c.num_tokens + c.num_pad == 1]
    prefills = [c for c in chunks if c.num_tokens + c.num_pad > 1]      # and decodes verifying drafts
    ids, positions, segments, order = [], [], [], []
    if decodes:
        starts = torch.tensor([c.start for c in decodes], dtype=torch.int64, device=device)
        view = CacheView(pool, block_table([c.request for c in decodes], device), starts, 1)
        segments.append(Segment(len(decodes), 1, starts, view))
    for c in prefills:
        n = c.num_tokens + c.num_pad
        view = CacheView(pool, block_table([c.request], device), c.start, n)
        segments.append(Segment(1, n, c.start, view))
    offsets, rows, sampled = [0], [], []
    for c in decodes + prefills:
        req = c.request
        ids += req.token_ids_to_compute[c.start:c.start + c.num_tokens] + [PAD_TOKEN_ID] * c.num_pad
        positions += range(c.start, c.start + c.num_tokens + c.num_pad)
        order.append(c)
        real_end = offsets[-1] + c.num_tokens
        offsets.append(real_end + c.num_pad)
        if c.num_tokens and c.start + c.num_tokens == req.num_tokens + len(req.spec_token_ids):
            sampled.append(c)
            rows += range(real_end - 1 - len(req.spec_token_ids), real_end)
    return PackedStep(torch.tensor([ids], dtype=torch.int64, device=device),
                      torch.tensor([positions], dtype=torch.int64, device=device), segments, order, offsets,
                      sampled, rows)
