"""The top-k acceptance check, shared by the top-k and indexer tests."""
import torch

NEG_INF = float("-inf")


def selectable(scores: torch.Tensor) -> torch.Tensor:
    s = scores.float()
    return ~(torch.isnan(s) | (s == NEG_INF))


def assert_valid_topk(scores: torch.Tensor, idx: torch.Tensor, k: int, *, sorted=False, value_tol=0.0,
                      judge_scores: torch.Tensor | None = None):
    """idx must be a correct top-k of `scores` (rows along the last dim).

    - int32, shape [..., k]; the first min(k, #selectable) slots are distinct
      in-range indices of selectable entries, the rest are -1;
    - the chosen values, sorted, equal the true top values (within value_tol,
      for kernels that recompute the scores in another summation order);
    - wherever the k-th value is not tied with the (k+1)-th (by more than
      value_tol), the chosen set equals the reference set exactly;
    - sorted=True: the chosen values are non-increasing.
    judge_scores: the scores to judge by (default `scores`).
    """
    s = (judge_scores if judge_scores is not None else scores).float().reshape(-1, scores.shape[-1]).cpu()
    got = idx.reshape(-1, k).cpu()
    assert idx.dtype == torch.int32, idx.dtype
    assert tuple(idx.shape) == (*scores.shape[:-1], k), (tuple(idx.shape), tuple(scores.shape), k)
    rows, T = s.shape
    valid = selectable(s)
    n_valid = valid.sum(1)
    want = torch.clamp(n_valid, max=k)
    slot = torch.arange(k)[None, :]
    live = slot < want[:, None]
    assert torch.equal(got[~live], torch.full_like(got[~live], -1)), "slots past the selectable entries must be -1"
    assert bool(((got >= 0) & (got < T))[live].all()), "index out of range in a live slot"
    safe = torch.where(live, got, 0).long()
    assert bool(valid.gather(1, safe)[live].all()), "selected a NaN or -inf entry"
    sorted_idx = torch.where(live, safe, -1 - slot).sort(1).values
    assert bool((sorted_idx[:, 1:] != sorted_idx[:, :-1]).all()), "duplicate index in a row"
    clean = torch.where(valid, s, torch.full_like(s, NEG_INF))
    ref_vals, ref_idx = torch.topk(clean, min(k + 1, T), dim=1, sorted=True)
    chosen = torch.where(live, clean.gather(1, safe), torch.full_like(clean[:, :k], NEG_INF))
    chosen_sorted = chosen.sort(1, descending=True).values
    top = ref_vals[:, :k]
    diff = torch.where(live, (chosen_sorted - top).abs(), torch.zeros_like(top))
    assert float(diff.nan_to_num(0.0).max()) <= value_tol, f"chosen values differ from the top-k by {float(diff.max())}"
    if sorted:
        ordered = torch.where(live[:, 1:], chosen[:, :-1] >= chosen[:, 1:] - value_tol, torch.ones_like(live[:, 1:]))
        assert bool(ordered.all()), "sorted=True but values are not descending"
    # Exact set where the boundary is not tied.
    if T > k:
        gap = top[:, k - 1] - ref_vals[:, k]
        clear = (n_valid > k) & (gap > value_tol)
    else:
        clear = torch.ones(rows, dtype=torch.bool)
    clear |= n_valid <= k
    ref_set = torch.where(torch.arange(ref_idx.shape[1])[None, :k] < want[:, None], ref_idx[:, :k], -1).sort(1).values
    got_set = torch.where(live, got, -1).long().sort(1).values
    mismatch = clear & (ref_set != got_set).any(1)
    assert not bool(mismatch.any()), f"index set differs from the reference in {int(mismatch.sum())} untied rows"
