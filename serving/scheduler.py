"""Which tokens of which requests the engine computes next, in the style of vLLM's V1 scheduler.

There is no prefill or decode phase: each step, every request gets a chunk of
the tokens it still has to compute (num_tokens - num_computed_tokens); a
decode is a chunk of one. Running requests come first, in admission order,
then waiting ones, first come first served, while the step's token budget
and sequence slots last. When the pool runs out of pages, the last admitted
running request is preempted: its pages are freed and it is recomputed later
from its prompt and the tokens it has generated so far.

policy="static" is the baseline continuous batching is measured against, as
issue 18 defines it: fixed batches padded to the longest request, admitted
only when the whole batch has finished. Its prompts are prefilled whole in
one step, right-padded to the batch's longest (the padding is computed: pad
tokens at the positions after each prompt, into the request's own pages,
where its decodes later overwrite them; causality keeps them out of every
real query's view), members decode in lock step, and a member that finishes
keeps computing a pad token per step in its slot, on its pages, until the
whole batch is done (a "ghost"). policy="static_unpadded" is the stricter
baseline: the same batches, no padding computed, a finished member's slot
idle and its pages freed.

The engine loop:
    out = scheduler.schedule()
    (forward over out.scheduled)
    for chunk in out.scheduled: scheduler.update_from_step(chunk)
    (sample for chunks with chunk.reaches_end, append the token, and call
     finish_request for requests that stop: stop token, max_tokens, or
     num_tokens >= max_model_len)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.block_manager import BlockManager
from serving.request import Request, RequestStatus

POLICIES = ("continuous", "static", "static_unpadded")


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute request.all_token_ids[start:start + num_tokens] at positions start...,
    then num_pad pad tokens at the positions after them (static batching's padding)."""
    request: Request
    start: int
    num_tokens: int
    num_pad: int = 0

    @property
    def reaches_end(self) -> bool:
        """Whether the chunk ends at the request's last token: its logits give the next token."""
        return self.num_tokens > 0 and self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, long_prefill_token_threshold: int = 0, policy: str = "continuous"):
        for name, value, low in (("max_num_seqs", max_num_seqs, 1),
                                 ("max_num_batched_tokens", max_num_batched_tokens, 1),
                                 ("max_model_len", max_model_len, 1),
                                 ("long_prefill_token_threshold", long_prefill_token_threshold, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        # Read-only outside: running in admission order, waiting in FCFS order.
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}
        self._ghosts: list[Request] = []   # policy "static": finished members padding their slots
        self._busy_slots = 0          # sum over steps of requests that computed a real token
        self._num_steps = 0           # steps that computed anything
        self.num_real_tokens = 0      # tokens computed for requests
        self.num_pad_tokens = 0       # pad tokens computed (policy "static")

    # -------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def padding_requests(self) -> tuple[Request, ...]:
        """policy "static": the batch's finished members, still computing padding on their pages."""
        return tuple(self._ghosts)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def get(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    @property
    def slot_utilisation(self) -> float:
        """Over steps that computed anything: requests computing a real token / max_num_seqs
        (a static batch's padding slots are not busy)."""
        return self._busy_slots / (self._num_steps * self.max_num_seqs) if self._num_steps else 0.0

    @property
    def padding_fraction(self) -> float:
        """Pad tokens / all tokens computed: the static baseline's waste (0 otherwise)."""
        total = self.num_real_tokens + self.num_pad_tokens
        return self.num_pad_tokens / total if total else 0.0

    # ------------------------------------------------------- request life
    def max_pages_needed(self, req: Request) -> int:
        """Pages the request holds at its longest (every token but the last sampled one computed)."""
        max_tokens = getattr(req.params, "max_tokens", None)
        longest = self.max_model_len if max_tokens is None else req.num_prompt_tokens + max_tokens - 1
        longest = max(req.num_prompt_tokens, min(longest, self.max_model_len))
        return -(-longest // self.block_manager.page_size)

    def add_request(self, req: Request) -> None:
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already queued or running")
        if req.status != RequestStatus.WAITING or req.block_ids or req.num_computed_tokens:
            raise ValueError(f"req {req.request_id!r} must be new: status WAITING, no pages, nothing computed")
        n = req.num_prompt_tokens
        if n == 0:
            raise ValueError(f"prompt_token_ids of request {req.request_id!r} is empty")
        if n > self.max_model_len:
            raise ValueError(f"prompt_token_ids of request {req.request_id!r} has {n} tokens, "
                             f"more than max_model_len {self.max_model_len}")
        needed = self.max_pages_needed(req)
        if needed > self.block_manager.num_pages:
            # It could never finish: alone in the pool it would preempt itself forever.
            raise ValueError(
                f"prompt_token_ids of request {req.request_id!r}: {n} tokens plus its max_tokens need "
                f"{needed} pages of {self.block_manager.page_size} tokens, the pool has {self.block_manager.num_pages}")
        self._live[req.request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request; None if it is unknown or already finished."""
        req = self._live.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        if not isinstance(status, RequestStatus) or not status.finished:
            raise ValueError(f"status must be a FINISHED_* RequestStatus, got {status!r}")
        if self._live.get(req.request_id) is not req:
            raise ValueError(f"req {req.request_id!r} is not queued or running here")
        del self._live[req.request_id]
        was_running = req.status == RequestStatus.RUNNING
        if was_running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        if self.policy == "static" and was_running and status != RequestStatus.FINISHED_ABORTED and self.running:
            self._ghosts.append(req)  # keeps its slot and pages, computing padding, until the batch ends
        else:
            self.block_manager.free(req)
        if not self.running:
            self._end_batch()

    def _end_batch(self) -> None:
        for ghost in self._ghosts:
            self.block_manager.free(ghost)
        self._ghosts.clear()

    # ------------------------------------------------------------- stepping
    def update_from_step(self, chunk: ScheduledChunk) -> None:
        """Record that the engine computed chunk (call once per chunk, after the forward)."""
        req = chunk.request
        if self._live.get(req.request_id) is not req:
            return                    # aborted while its step was in flight: nothing to record
        if chunk.start != req.num_computed_tokens:
            raise RuntimeError(f"chunk of {req.request_id!r} starts at {chunk.start} but "
                               f"{req.num_computed_tokens} tokens are computed: a stale or repeated chunk")
        req.num_computed_tokens += chunk.num_tokens
        self.block_manager.cache_full_pages(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.policy == "continuous":
            self._schedule_continuous(out)
        else:
            self._schedule_static(out)
        out.num_batched_tokens = sum(c.num_tokens + c.num_pad for c in out.scheduled)
        if out.scheduled:
            self._num_steps += 1
            self._busy_slots += sum(c.num_tokens > 0 for c in out.scheduled)
            self.num_real_tokens += sum(c.num_tokens for c in out.scheduled)
            self.num_pad_tokens += sum(c.num_pad for c in out.scheduled)
        return out

    def _tokens_left(self, req: Request) -> int:
        # Never past max_model_len: the engine finishes a request that reaches it.
        return min(req.num_tokens + len(req.spec_token_ids), self.max_model_len) - req.num_computed_tokens

    def _chunk_size(self, req: Request, budget: int) -> int:
        n = min(self._tokens_left(req), budget)
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        if req.spec_token_ids and n < self._tokens_left(req):
            req.spec_token_ids.clear()      # drafts are verified whole or not at all: a split drops them
            return self._chunk_size(req, budget)
        return n

    def _schedule_continuous(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_size(req, budget)
            if n <= 0:
                i += 1
                continue
            if not self._allocate_or_preempt(req, n, out):
                break                 # req itself was preempted: everyone after it already was
            out.scheduled.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        # As vLLM: no admissions in a step that preempted, or the request just
        # pushed back would be readmitted at once and thrash.
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not out.preempted):
            n = self._admit(self.waiting[0], budget, out)
            if n == 0:
                break                 # FCFS: nobody overtakes the head of the queue
            budget -= n

    def _schedule_static(self, out: SchedulerOutput) -> None:
        if not self.running:
            self._end_batch()
            # A new batch: prompts prefilled whole, the token budget ignored.
            while self.waiting and len(self.running) < self.max_num_seqs:
                if self._admit(self.waiting[0], None, out) == 0:
                    break
            if self.policy == "static":
                self._pad_prompts(out)
            return
        for req in list(self.running):
            if req not in self.running:
                continue              # preempted earlier in this loop
            n = self._tokens_left(req)
            if n <= 0:
                continue
            if not self._allocate_or_preempt(req, n, out):
                break
            out.scheduled.append(ScheduledChunk(req, req.num_computed_tokens, n))
        for ghost in list(self._ghosts):
            pos = max(ghost.pad_end, ghost.num_computed_tokens)
            if pos >= self.max_model_len or not self.block_manager.reserve_slots(ghost, pos + 1):
                self._drop_ghost(ghost)   # no position or page left to pad on: its slot goes idle
                continue
            ghost.pad_end = pos + 1
            out.scheduled.append(ScheduledChunk(ghost, pos, 0, num_pad=1))

    def _pad_prompts(self, out: SchedulerOutput) -> None:
        """Right-pads every first chunk of a new batch to the batch's longest; while the
        padded batch does not fit the pool, its last member goes back to the queue."""
        bm = self.block_manager
        while out.scheduled:
            longest = max(c.start + c.num_tokens for c in out.scheduled)
            pages = -(-longest // bm.page_size)
            if sum(max(0, pages - len(c.request.block_ids)) for c in out.scheduled) <= bm.num_free_pages:
                break
            last = out.scheduled.pop()
            self.running.remove(last.request)
            self._preempt(last.request)
            out.preempted.append(last.request)
        for i, c in enumerate(out.scheduled):
            pad = longest - c.start - c.num_tokens
            if pad:
                if not bm.reserve_slots(c.request, longest):
                    raise AssertionError("the free pages counted for the padding are gone")
                c.request.pad_end = longest
                out.scheduled[i] = ScheduledChunk(c.request, c.start, c.num_tokens, num_pad=pad)

    def _drop_ghost(self, ghost: Request) -> None:
        self._ghosts.remove(ghost)
        self.block_manager.free(ghost)

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Pages for n more tokens of running req, preempting from the back; False if req went."""
        while not self.block_manager.allocate_slots(req, n):
            if self._ghosts:          # padding gives way before any request does
                self._drop_ghost(self._ghosts[-1])
                continue
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.pad_end = 0
        req.spec_token_ids.clear()
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _admit(self, req: Request, budget: int | None, out: SchedulerOutput) -> int:
        """Move the head of the waiting queue to running with its first chunk; 0 if it does not fit."""
        pages, num_hit = self.block_manager.get_computed_prefix(req)
        req.num_computed_tokens = num_hit
        n = self._tokens_left(req)
        if budget is not None:
            n = self._chunk_size(req, budget)
        if n <= 0 or not self.block_manager.allocate_slots(req, n, pages):
            req.num_computed_tokens = 0
            return 0
        self.waiting.popleft()
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledChunk(req, num_hit, n))
        return n

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """The page manager's invariants over the live requests, plus the queues' own."""
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running requests, max_num_seqs is {self.max_num_seqs}")
        for req in self.waiting:
            if req.status != RequestStatus.WAITING or req.block_ids or req.num_computed_tokens:
                raise AssertionError(f"waiting request {req.request_id!r} holds pages or computed tokens")
        for req in self.running:
            if req.status != RequestStatus.RUNNING:
                raise AssertionError(f"running request {req.request_id!r} has status {req.status}")
        if len(self._live) != len(self.running) + len(self.waiting):
            raise AssertionError("a live request is neither running nor waiting")
        for ghost in self._ghosts:
            if not ghost.status.finished or ghost.request_id in self._live:
                raise AssertionError(f"padding slot {ghost.request_id!r} is not a finished member of the batch")
        self.block_manager.check_invariants([*self._live.values(), *self._ghosts])
