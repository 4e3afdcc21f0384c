"""Benchmark workloads (vLLM's `bench serve` datasets, as token ids: the lab has
no tokenizer) and their arrival times.

- random: input and output lengths uniform over [lo, hi], token ids uniform
  over [0, vocab_size).
- prefix_repetition: num_prefixes random prefixes of prefix_len tokens; each
  request is one of them (round robin, then shuffled) + its own random suffix
  of suffix_len tokens, output_len tokens out. distinct_prefixes=True gives
  every request its own prefix (same lengths, a 0% prefix-cache hit rate).

Every request fixes its output length: the engine has no eos, so it runs to
max_tokens (vLLM's ignore_eos). All draws are seeded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "prefix_repetition")


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _range(value, name: str) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a (lo, hi) pair, got {value!r}")
    lo, hi = _positive(value[0], f"{name}[0]"), _positive(value[1], f"{name}[1]")
    if lo > hi:
        raise ValueError(f"{name} must have lo <= hi, got {value!r}")
    return lo, hi


def random_requests(num_prompts: int, *, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> list[SampleRequest]:
    n = _positive(num_prompts, "num_prompts")
    (ilo, ihi), (olo, ohi) = _range(input_len, "input_len"), _range(output_len, "output_len")
    vocab = _positive(vocab_size, "vocab_size")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(ilo, ihi + 1, size=n)
    out_lens = rng.integers(olo, ohi + 1, size=n)
    return [SampleRequest(rng.integers(0, vocab, size=int(i)).tolist(), int(o)) for i, o in zip(in_lens, out_lens)]


def prefix_repetition_requests(num_prompts: int, *, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, vocab_size: int, seed: int = 0,
                               distinct_prefixes: bool = False) -> list[SampleRequest]:
    n = _positive(num_prompts, "num_prompts")
    plen, slen = _positive(prefix_len, "prefix_len"), _positive(suffix_len, "suffix_len")
    olen, vocab = _positive(output_len, "output_len"), _positive(vocab_size, "vocab_size")
    groups = n if distinct_prefixes else _positive(num_prefixes, "num_prefixes")
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, vocab, size=(groups, plen)).tolist()
    requests = [SampleRequest(prefixes[i % groups] + rng.integers(0, vocab, size=slen).tolist(), olen)
                for i in range(n)]
    order = rng.permutation(n)          # as vLLM: the groups' requests interleave in arrival order
    return [requests[i] for i in order]


def arrival_times(num_requests: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent, as vLLM's
    `bench serve`: intervals ~ Gamma(shape=burstiness, scale=1/(rate*burstiness))
    (mean 1/rate; burstiness 1 = Poisson, < 1 burstier, > 1 more even, inf
    evenly spaced),
    summed, then scaled so the last arrival falls at num_requests / rate
    (vLLM's fixed-rate normalisation). rate inf: every request at 0."""
    n = _positive(num_requests, "num_requests")
    if isinstance(request_rate, bool) or not isinstance(request_rate, (int, float)) or math.isnan(request_rate):
        raise TypeError(f"request_rate must be a number (inf = all at once), got {request_rate!r}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)):
        raise TypeError(f"burstiness must be a number, got {burstiness!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (inf = evenly spaced), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        return [(i + 1) / request_rate for i in range(n)]
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n))
    return (times * (n / request_rate / times[-1])).tolist()
