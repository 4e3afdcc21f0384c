"""Text generation through the paged cache: greedy or sampled, and
speculative decoding with the MTP head as the drafter.

Both prefill the prompt in chunks (memory O(chunk)), then decode one forward
per step. Speculative decoding drafts one token with MTP and verifies it with
a two-token forward of the main model: accepted, the step yields two tokens;
rejected, the main model's own token is kept and the draft's cache entry is
dropped. The output is the main model's greedy output whatever the drafter
proposes; a better drafter only raises the acceptance length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glm5_ops._checks import INT32_MAX, int_in_range


def _check_prompt(model, input_ids, max_new_tokens: int, prefill_chunk):
    int_in_range(prefill_chunk, "prefill_chunk", 1, INT32_MAX)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    model._check_ids(input_ids, 0)
    total = input_ids.shape[1] + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"input_ids and max_new_tokens must fit max_position_embeddings="
                         f"{model.config.max_position_embeddings}, got a prompt of {input_ids.shape[1]} + "
                         f"{max_new_tokens} new tokens")


def sample_next(logits, *, do_sample: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator=None):
    """Next token ids [B] from logits [B, V]: argmax, or a sample from the
    temperature-scaled distribution cut to its top_k / top_p nucleus."""
    if not do_sample:
        return logits.argmax(-1)
    _check_sampling(temperature, top_k, top_p)
    logits = top_k_top_p_filter(logits.float() / temperature, top_k, top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def top_k_top_p_filter(logits, top_k, top_p):
    """logits [B, V] (float, already temperature-scaled) with every token outside
    each row's top_k / top_p nucleus set to -inf. top_k, top_p: one value for
    all rows, or a tensor [B] per row (serving batches requests with their own).
    top_k 0 (or below 1) = off; ties with the k-th value stay in. top_p >= 1 =
    off; else the smallest prefix of the sorted distribution (after top_k)
    whose mass reaches top_p. The one home of this rule (serving's sampler uses it)."""
    B, V = logits.shape
    k = torch.as_tensor(top_k, device=logits.device).long().expand(B)
    p = torch.as_tensor(top_p, device=logits.device, dtype=torch.float32).expand(B)
    use_k, use_p = (k >= 1) & (k < V), p < 1.0
    if not bool(use_k.any()) and not bool(use_p.any()):
        return logits                    # nothing to cut: skip the [B, V] sort
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(-1, torch.where(use_k, k - 1, V - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # keep the smallest prefix reaching top_p (the first token always stays); inf: rows with the rule off
    threshold = torch.where(use_p, p, torch.full_like(p, float("inf")))
    drop = probs.cumsum(-1) - probs > threshold[:, None]
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _check_sampling(temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite float > 0 when sampling, got {temperature}")
    int_in_range(top_k, "top_k", 0, INT32_MAX)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"top_p must be a float, got {type(top_p).__name__}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.inference_mode()
def generate(model, input_ids, max_new_tokens: int, *, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id=None, generator=None,
             prefill_chunk: int = 2048, page_size: int = 64):
    """input_ids [B, n] -> [B, n + max_new_tokens]. Sequences that emit
    eos_token_id keep emitting it (the batch runs until all are done or the
    budget is spent; the result is padded with eos)."""
    _check_prompt(model, input_ids, max_new_tokens, prefill_chunk)
    if do_sample:
        _check_sampling(temperature, top_k, top_p)
    B, n = input_ids.shape
    cache = model.new_cache(B, n + max_new_tokens, page_size=page_size)
    logits, _ = model.prefill(input_ids, cache, chunk=prefill_chunk)
    out = [input_ids]
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        nxt = sample_next(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.append(nxt[:, None])
        if step + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            break
        logits = model(nxt[:, None], cache)[:, -1]
    result = torch.cat(out, dim=1)
    if result.shape[1] < n + max_new_tokens:        # every sequence finished early: pad with eos
        pad = torch.full((B, n + max_new_tokens - result.shape[1]), eos_token_id, dtype=result.dtype,
                         device=result.device)
        result = torch.cat([result, pad], dim=1)
    return result


@dataclass
class SpeculativeStats:
    main_forwards: int          # verification forwards of the main model (after prefill)
    drafts_accepted: int
    drafts_proposed: int
    new_tokens: int

    @property
    def acceptance_length(self) -> float:
        """Tokens produced per main-model forward (1.0 = no gain, 2.0 = every draft kept)."""
        return self.new_tokens / max(self.main_forwards, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / max(self.drafts_proposed, 1)


@torch.inference_mode()
def speculative_generate(model, input_ids, max_new_tokens: int, *, prefill_chunk: int = 2048,
                         page_size: int = 64):
    """Greedy decoding with MTP drafting one token per step.
    Returns (tokens [B, n + max_new_tokens], SpeculativeStats). With B > 1 a
    draft is kept only when every sequence accepts it (the batch stays in step)."""
    _check_prompt(model, input_ids, max_new_tokens, prefill_chunk)
    B, n = input_ids.shape
    # No position is past max_position_embeddings (the forward checks it), so no cache needs more.
    cache = model.new_cache(B, min(n + max_new_tokens + 2, model.config.max_position_embeddings),
                            page_size=page_size)
    logits, hidden = model.prefill(input_ids, cache, chunk=prefill_chunk)
    last = logits.argmax(-1)                                    # token n
    new = [last]
    # The MTP stream: position t reads (hidden[t], token t+1) and predicts token t+2.
    next_ids = torch.cat([input_ids[:, 1:], last[:, None]], dim=1)
    for s in range(0, n, prefill_chunk):     # fills the MTP layer's cache; only the last logits matter
        draft_logits = model.mtp_logits(hidden[:, s:s + prefill_chunk], next_ids[:, s:s + prefill_chunk], cache,
                                        logits_to_keep=1)
    draft = draft_logits[:, -1].argmax(-1)
    stats = SpeculativeStats(0, 0, 0, 0)
    while len(new) < max_new_tokens:
        h = model.hidden_states(torch.stack([last, draft], dim=1), cache)    # verify: tokens (last, draft)
        verified = model.logits(h).argmax(-1)                               # [B, 2]
        stats.main_forwards += 1
        stats.drafts_proposed += 1
        if bool((verified[:, 0] == draft).all()):
            stats.drafts_accepted += 1
            step_tokens, step_hidden = [draft, verified[:, 1]], h
        else:
            cache.truncate(cache.length - 1)                                 # drop the draft's entry
            step_tokens, step_hidden = [verified[:, 0]], h[:, :1]
        new.extend(step_tokens)
        last = step_tokens[-1]
        draft_logits = model.mtp_logits(step_hidden, torch.stack(step_tokens, dim=1), cache, logits_to_keep=1)
        draft = draft_logits[:, -1].argmax(-1)
    new = torch.stack(new[:max_new_tokens], dim=1)
    stats.new_tokens = new.shape[1] - 1           # the first token came from the prefill
    return torch.cat([input_ids, new], dim=1), stats
