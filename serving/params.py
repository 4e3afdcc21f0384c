"""How one request is decoded: vLLM's SamplingParams, the subset the engine serves.

    SamplingParams(max_tokens=64, temperature=0.0)                  # greedy
    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=7, logprobs=5)

There is no eos: a request stops at max_tokens, or at one of stop_token_ids
(vLLM's ignore_eos=True behaviour unless stop ids are given).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# As vLLM: a temperature this small is greedy (dividing by it would overflow the logits).
SAMPLING_EPS = 1e-5
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1      # what torch.Generator.manual_seed accepts


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    seed: int | None = None             # set: the request draws from its own generator
    stop_token_ids: tuple = ()
    logprobs: int | None = None         # None: off; n: the chosen token's logprob (+ the top n when n > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError / TypeError naming the first bad argument."""
        if not _is_int(self.max_tokens):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not _is_number(self.temperature):
            raise TypeError(f"temperature must be a float, got {type(self.temperature).__name__}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {self.temperature}")
        if not _is_number(self.top_p):
            raise TypeError(f"top_p must be a float, got {type(self.top_p).__name__}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 for no top-k cut, got {self.top_k}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list or tuple of ints, got "
                            f"{type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            if not _is_int(t):
                raise TypeError(f"stop_token_ids must hold ints, got {type(t).__name__} {t!r}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, vocab_size={vocab_size}), got {t}")
        if self.logprobs is not None:
            if not _is_int(self.logprobs):
                raise TypeError(f"logprobs must be an int or None, got {type(self.logprobs).__name__}")
            if not 0 <= self.logprobs <= vocab_size:
                raise ValueError(f"logprobs must be in [0, vocab_size={vocab_size}], got {self.logprobs}")
