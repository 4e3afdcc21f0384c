"""register_fake for the ops of torch.ops.glm5, so they trace under
torch.compile and pass torch.library.opcheck: output shapes and dtypes only."""
from __future__ import annotations

import torch

from ._backend import _C

if _C is not None:

    @torch.library.register_fake("glm5::indexer_scores")
    def _indexer_scores_fake(q, w, k, causal, q_start):
        return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("glm5::topk_indices")
    def _topk_indices_fake(scores, k, sorted):
        return scores.new_empty((*scores.shape[:-1], k), dtype=torch.int32)

    @torch.library.register_fake("glm5::indexer_topk")
    def _indexer_topk_fake(q, w, k, topk, causal, q_start):
        return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)
