"""What the engine returns each step: vLLM's offline RequestOutput / CompletionOutput.

token_ids (and logprobs) are cumulative: everything generated so far, so
the last step's output of a request is its whole completion.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int                          # which completion of the request (always 0: n=1)
    token_ids: list[int]
    logprobs: list[float] | None        # one per token in token_ids; None when params.logprobs is None
    finish_reason: str | None           # None while running; "stop", "length" or "abort"
    stop_reason: int | None             # the stop token id that ended it, if one did
    top_logprobs: list[dict] | None = None   # per token {token id: logprob} of the top params.logprobs ids


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens found in the prefix cache
