"""One request's state as the engine, scheduler and page manager share it.

As in vLLM's V1 engine there is no separate prefill and decode phase: a
request holds all its tokens (prompt, then what was generated) and how many
of them are in the cache (num_computed_tokens); each step the scheduler
gives it some of the rest to compute. A decode is the case of one token left.
Preemption frees its pages and sets num_computed_tokens back to 0: the
request is recomputed later from prompt + output, so nothing is lost.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"          # a stop token
    FINISHED_LENGTH = "length"         # max_tokens, or the model's context
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: Any                              # serving.SamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None            # tenants with different salts share no cached page
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict] = field(default_factory=list)   # per token {id: logprob}, when logprobs > 0
    num_computed_tokens: int = 0             # tokens whose latent (and indexer key) is in the cache
    block_ids: list[int] = field(default_factory=list)   # the block table: logical page i -> page id
    spec_token_ids: list[int] = field(default_factory=list)  # MTP's drafts after the last token, to verify
    num_cached_tokens: int = 0               # of the prompt, found in the prefix cache at admission
    num_preemptions: int = 0
    pad_end: int = 0                         # static batching: one past the last slot padding wrote (0: none)
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token was produced

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_ids_to_compute(self) -> list[int]:
        """all_token_ids, then the drafts the next forward verifies."""
        return self.prompt_token_ids + self.output_token_ids + self.spec_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
