"""The dense baselines the lab's kernels are measured against."""
import torch


def unfused_indexer_topk(q, w, k, topk, q_start=None):
    """What engines did before fused indexers: materialise the per-head
    product [B,S,H,T], relu, weight, sum heads, mask the causal future, torch.topk."""
    B, S, H, D = q.shape
    T = k.shape[1]
    scores = torch.einsum("bshd,btd->bsht", q, k).relu_().mul_(w[..., None]).sum(2)
    start = T - S if q_start is None else q_start
    future = torch.arange(T, device=q.device)[None, :] > (torch.arange(S, device=q.device) + start)[:, None]
    scores.masked_fill_(future[None], float("-inf"))
    return torch.topk(scores, topk, dim=-1, sorted=False).indices
