"""The serving engine: continuous batching over one shared paged KV pool.

    engine = Engine(model, max_num_seqs=32, max_num_batched_tokens=2048, kv_cache_memory="2GiB")
    engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=64, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
    # or: engine.generate([ids, ids2], SamplingParams(...)) -> one RequestOutput per prompt, in order
    Engine(model, quantization="int8_weight_only")   # or "w8a8": models.glm5.quantize(model) first, in place

Each step: the scheduler (scheduler.py) picks chunks within the token budget,
decodes first; packing.py packs them into one forward of the model over the
pool; the chunks that reach the end of their request's tokens are sampled
(sampler.py). Pages (block_manager.py) are refcounted and, with prefix
caching, shared between requests whose prompts start alike.
"""
from __future__ import annotations

import sys
import time

import torch

from models.glm5.cache import KVPool
from models.glm5.quantization import ensure_quantized

from .block_manager import BlockManager
from .memory import format_bytes, parse_bytes
from .outputs import CompletionOutput, RequestOutput
from .packing import pack
from .params import SamplingParams
from .request import Request, RequestStatus
from .sampler import Sampler
from .scheduler import Scheduler
from .speculative import MTPDrafter


class Engine:
    def __init__(self, model, *, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 kv_cache_memory="1GiB", num_pages: int | None = None, page_size: int = 64,
                 enable_prefix_caching: bool = False, policy: str = "continuous",
                 long_prefill_token_threshold: int = 0, max_model_len: int | None = None,
                 speculative: bool = False, quantization: str | None = None, log=True):
        self.quantization = ensure_quantized(model, quantization)
        self.model, self.config = model, model.config
        p = next(model.parameters())
        self.device = p.device
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if not isinstance(self.max_model_len, int) or not 2 <= self.max_model_len <= self.config.max_position_embeddings:
            raise ValueError(f"max_model_len must be an int in [2, max_position_embeddings="
                             f"{self.config.max_position_embeddings}], got {max_model_len!r}")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        page_bytes = KVPool.bytes_per_token(self.config, p.dtype) * page_size
        if num_pages is None:
            num_pages = parse_bytes(kv_cache_memory) // page_bytes
            if num_pages < 1:
                raise ValueError(f"kv_cache_memory={kv_cache_memory!r} holds no page of {page_size} tokens "
                                 f"({format_bytes(page_bytes)} each)")
        self.pool = KVPool(self.config, num_pages, page_size, dtype=p.dtype, device=self.device)
        self.block_manager = BlockManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   long_prefill_token_threshold=long_prefill_token_threshold, policy=policy)
        self.sampler = Sampler()
        if speculative and enable_prefix_caching:
            raise ValueError("speculative=True and enable_prefix_caching=True together are not supported: a cached "
                             "page's MTP keys depend on the token after the page (serving/speculative.py)")
        if speculative and policy == "static":
            raise ValueError("speculative=True and policy='static' together are not supported: the padded "
                             "baseline computes pad rows the MTP drafter has no tokens for")
        self.drafter = MTPDrafter(model) if speculative else None
        self.requests: dict[str, Request] = {}     # unfinished ones
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.num_preemptions = 0
        if log:
            print(f"[engine] KV pool: {num_pages} pages x {page_size} tokens = {self.max_tokens_in_pool} tokens "
                  f"({format_bytes(num_pages * page_bytes)}, {format_bytes(page_bytes / page_size)} per token)",
                  file=sys.stderr)

    @property
    def max_tokens_in_pool(self) -> int:
        return self.pool.num_pages * self.pool.page_size

    # -- requests ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queues a request; raises ValueError/TypeError naming the bad argument (nothing is queued then)."""
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        prompt = self._check_prompt(prompt_token_ids)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.config.vocab_size)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        need = min(len(prompt) + params.max_tokens, self.max_model_len)
        if need > self.max_tokens_in_pool:
            raise ValueError(f"max_tokens: the prompt's {len(prompt)} tokens plus max_tokens={params.max_tokens} "
                             f"need {need} cache slots, more than the whole pool holds ({self.max_tokens_in_pool})")
        req = Request(request_id, prompt, params, time.monotonic() if arrival_time is None else arrival_time,
                      cache_salt)
        self.scheduler.add_request(req)
        self.requests[request_id] = req

    def _check_prompt(self, prompt_token_ids) -> list[int]:
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
        V = self.config.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                raise ValueError(f"prompt_token_ids must be ints in [0, vocab_size={V}), got {t!r}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: the prompt's {len(prompt_token_ids)} tokens leave no room to "
                             f"generate within the model's context (max_model_len={self.max_model_len})")
        return list(prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Stops a request wherever it is (waiting, mid-prefill, mid-decode) and frees its pages."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort_request(request_id)
            self.sampler.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one forward over what the scheduler picks; returns the requests that got a token."""
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if not plan.scheduled:
            return []
        self.num_steps += 1
        batch = pack(plan.scheduled, self.pool, self.device)
        hidden = self.model.packed_hidden_states(batch.input_ids, batch.positions, batch.segments)
        for chunk in batch.chunks:
            self.scheduler.update_from_step(chunk)
        finished, outputs = [], []
        if batch.sampled:
            logits = self.model.logits(hidden[0, batch.sample_rows]).float()
            now = time.monotonic()
            for req, tokens, logprobs, top in self._choose(batch.sampled, logits):
                status = self._append(req, tokens, logprobs, top, now)
                if status is not None:
                    finished.append((req, status))
                outputs.append(req)
        if self.drafter is not None:     # before finishing: the MTP layer writes to these requests' pages
            done = {id(r) for r, _ in finished}
            self.drafter.draft(batch, hidden, lambda r: id(r) not in done and self._may_draft(r))
        for req, status in finished:
            self.scheduler.finish_request(req, status)
            self.requests.pop(req.request_id, None)
            self.sampler.release(req.request_id)
        return [self._output(req) for req in outputs]

    def _choose(self, chunks, logits):
        """(request, new tokens, their logprobs, their top logprobs) per sampled chunk: drafts
        verified greedily, other requests through the sampler in one batch."""
        plain, plain_rows, out, row = [], [], [], 0
        for chunk in chunks:
            req, k = chunk.request, len(chunk.request.spec_token_ids)
            if k:
                rows = logits[row:row + 1 + k]
                tokens = self.drafter.verify(req, rows)
                lp, top = self.sampler.logprobs(rows[:len(tokens)], torch.tensor(tokens), [req] * len(tokens))
                out.append((req, tokens, lp, top))
                req.spec_token_ids = []
                # the rejected drafts' slots hold nothing valid: they are computed again
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens + len(tokens) - 1)
            else:
                plain.append(req)
                plain_rows.append(row)
            row += 1 + k
        if plain:
            tokens, logprobs, top = self.sampler.sample(logits[plain_rows], plain)
            out += [(req, [t], [lp], [tp]) for req, t, lp, tp in zip(plain, tokens, logprobs, top)]
        return out

    def _append(self, req: Request, tokens: list[int], logprobs, tops, now: float):
        """Appends tokens until one finishes the request; returns its finish status or None."""
        for token, logprob, top in zip(tokens, logprobs, tops):
            req.output_token_ids.append(token)
            req.token_times.append(now)
            if req.params.logprobs is not None:
                req.output_logprobs.append(logprob)
                req.output_top_logprobs.append(top)
            self.num_generated_tokens += 1
            status = self._finish_status(req, token)
            if status is not None:
                return status
        return None

    def _may_draft(self, req: Request) -> bool:
        """A draft pays when the request is greedy and has two more tokens to go within its limits."""
        return (req.params.greedy and len(req.output_token_ids) + 2 <= req.params.max_tokens
                and req.num_tokens + 2 <= self.max_model_len)

    def _finish_status(self, req: Request, token: int):
        if token in req.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _output(req: Request) -> RequestOutput:
        finished = req.status.finished
        stopped = req.status == RequestStatus.FINISHED_STOPPED
        completion = CompletionOutput(0, list(req.output_token_ids),
                                      list(req.output_logprobs) if req.params.logprobs is not None else None,
                                      req.status.value if finished else None,
                                      req.output_token_ids[-1] if stopped else None,
                                      list(req.output_top_logprobs) if req.params.logprobs else None)
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], finished, req.num_cached_tokens)

    # -- offline ---------------------------------------------------------------------
    def generate(self, prompts, params=None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Every prompt (a list of token ids) to completion: one RequestOutput per prompt, in order.
        params: one SamplingParams for all, or one per prompt."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if isinstance(prompts[0], int):
            prompts = [prompts]
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt ({len(prompts)}), "
                             f"got {len(per_prompt)}")
        ids = [f"generate-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per_prompt):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        progress = Progress(len(prompts), enabled=use_tqdm)
        while len(done) < len(prompts):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
            progress.update(len(done), self.num_generated_tokens)
        progress.close()
        return [done[rid] for rid in ids]

    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return {"prefix_cache_hit_rate": bm.hit_rate, "slot_utilisation": sched.slot_utilisation,
                "padding_fraction": sched.padding_fraction,
                "kv_cache_usage": bm.usage, "num_preemptions": self.num_preemptions,
                "num_running": sched.num_running, "num_waiting": sched.num_waiting,
                "generated_tokens": self.num_generated_tokens, "steps": self.num_steps,
                "pool_tokens": self.max_tokens_in_pool, **(self.drafter.stats() if self.drafter else {}),
                **({"quantization": self.quantization} if self.quantization else {})}


class Progress:
    """A one-line progress report on stderr, at most twice a second."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled, self.start, self.last = total, enabled, time.monotonic(), 0.0

    def update(self, done: int, tokens: int) -> None:
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or done == self.total):
            self.last = now
            rate = tokens / max(now - self.start, 1e-9)
            print(f"\r[generate] {done}/{self.total} requests, {tokens} tokens, {rate:.1f} tok/s",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)
