"""The two generating endpoints: a request body -> engine requests -> the OpenAI response.

Each choice of each prompt is one engine request (the engine serves n=1);
their outputs arrive on one asyncio queue, fed by the engine thread. A
request leaves the engine when it finishes, when a stop string appears in its
text, or when the client goes away (the generator's finally aborts what is
left, so its pages return to the pool).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from serving.params import SamplingParams

from .chat import ChatRenderer
from .metrics import ServerCounters
from .protocol import MAX_STOP, APIError, ChatCompletionRequest, CompletionRequest
from .textstream import TextStream

_SEED_SPAN = 2**64
LOGPROB_FLOOR = -9999.0      # as vLLM: JSON has no -inf


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)     # per token: {id: logprob} or None
    finish_reason: str | None = None
    num_cached_tokens: int = 0


@dataclass
class Event:
    choice: Choice
    text: str                   # new text to send
    first_token: int            # choice.token_ids[first_token:] are new


class Generation:
    """Admission, the engine requests, and the events they produce."""

    def __init__(self, runner, tokenizer, counters: ServerCounters, *, vocab_size: int, max_model_len: int,
                 max_in_flight: int):
        self.runner, self.tokenizer, self.counters = runner, tokenizer, counters
        self.vocab_size, self.max_model_len, self.max_in_flight = vocab_size, max_model_len, max_in_flight

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param} is empty: at least one token is needed", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside [0, vocab_size={self.vocab_size})", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{param}: this model's maximum context length is {self.max_model_len} tokens, "
                                f"the prompt has {len(ids)}: no room to generate", param=param,
                           code="context_length_exceeded")
        return ids

    def max_tokens(self, asked: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        room = self.max_model_len - prompt_len
        if asked is None:
            return room
        if asked > room:
            raise APIError(400, f"{param}={asked} is too large: this model's maximum context length is "
                                f"{self.max_model_len} tokens and the prompt has {prompt_len}", param=param,
                           code="context_length_exceeded")
        return asked

    def sampling_params(self, req, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        stop_ids = list(req.stop_token_ids or [])
        if not req.ignore_eos:
            stop_ids += [t for t in self.tokenizer.eos_token_ids if t not in stop_ids and t < self.vocab_size]
        seed = req.seed
        if seed is not None and index:                     # vLLM: choice i of a seeded request draws with seed + i
            seed = (seed + index) if seed + index < _SEED_SPAN else seed - index
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=seed,
                                stop_token_ids=tuple(stop_ids), logprobs=logprobs)
        try:
            params.validate(self.vocab_size)
        except (ValueError, TypeError) as e:
            param = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=param) from None
        return params

    @staticmethod
    def stop_strings(req) -> list[str]:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")
        return stop

    def admit(self, count: int) -> None:
        if self.counters.in_flight + count > self.max_in_flight:
            self.counters.rejected_full += 1
            raise APIError(503, f"the server is at capacity ({self.max_in_flight} requests in flight or waiting): "
                                f"retry later", type="server_error", code="server_overloaded")
        if not self.runner.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_down")

    def start(self, prefix: str, prompts: list[list[int]], params: list[list[SamplingParams]],
              stop: list[str]) -> "Run":
        """Admits (or 503s) and queues every choice's engine request; the caller must close() the Run."""
        return Run(self, prefix, prompts, params, stop)

    def update(self, c: Choice, item) -> Event:
        if isinstance(item, (ValueError, TypeError)):
            raise APIError(400, str(item), param=str(item).split(" ", 1)[0])
        if isinstance(item, Exception):
            raise APIError(500, str(item), type="server_error")
        out = item.outputs[0]
        first = len(c.token_ids)
        new = out.token_ids[first:]
        c.token_ids.extend(new)
        c.num_cached_tokens = item.num_cached_tokens
        if out.logprobs is not None:
            c.logprobs.extend(max(lp, LOGPROB_FLOOR) for lp in out.logprobs[first:])
            c.top_logprobs.extend(out.top_logprobs[first:] if out.top_logprobs else [None] * len(new))
        self.counters.generation_tokens += len(new)
        text = c.text.add(new)
        if c.text.stopped is not None:
            c.finish_reason = "stop"
            self.runner.abort(c.request_id)
        elif item.finished:
            text += c.text.finish()
            c.finish_reason = out.finish_reason
        return Event(c, text, first)


class Run:
    """One HTTP request's engine requests: iterate for Events; close() (idempotent)
    aborts what has not finished and gives its slots back."""

    def __init__(self, gen: Generation, prefix: str, prompts, params, stop):
        self.gen, self.prompts = gen, prompts
        self.choices, subs = [], []
        for p, (prompt, per_choice) in enumerate(zip(prompts, params)):
            for sp in per_choice:
                c = Choice(len(self.choices), f"{prefix}-{len(self.choices)}", p, TextStream(gen.tokenizer, stop))
                self.choices.append(c)
                subs.append((c, prompt, sp))
        gen.admit(len(self.choices))
        counters = gen.counters
        counters.in_flight += len(self.choices)
        counters.prompt_tokens += sum(len(p) * len(per) for p, per in zip(prompts, params))
        self._closed = False
        self._pending = len(self.choices)
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        for c, prompt, sp in subs:
            gen.runner.add(c.request_id, prompt, sp,
                           lambda item, i=c.index: loop.call_soon_threadsafe(self._queue.put_nowait, (i, item)))

    async def __aiter__(self):
        try:
            while self._pending:
                i, item = await self._queue.get()
                c = self.choices[i]
                if c.finish_reason is not None:
                    continue                      # outputs that crossed a stop-string abort
                event = self.gen.update(c, item)
                if c.finish_reason is not None:
                    self._pending -= 1
                    finished = self.gen.counters.finished
                    finished[c.finish_reason] = finished.get(c.finish_reason, 0) + 1
                yield event
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.choices:
            if c.finish_reason is None:
                self.gen.runner.abort(c.request_id)
                self.gen.counters.finished["abort"] += 1
        self.gen.counters.in_flight -= len(self.choices)


# ---------------------------------------------------------------- response bodies
def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompts: list[list[int]], choices, n: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(max(c.num_cached_tokens for c in choices if c.prompt_index == i) for i in range(len(prompts)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


class Bodies:
    """OpenAI's JSON for completion and chat choices, whole or as stream chunks."""

    def __init__(self, tokenizer, model_name: str):
        self.tokenizer, self.model_name = tokenizer, model_name

    def _token(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def completion_logprobs(self, c: Choice, start: int, offset: int) -> dict:
        tokens = [self._token(t) for t in c.token_ids[start:]]
        offsets, pos = [], offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        tops = [None if top is None else {self._token(t): lp for t, lp in top.items()}
                for top in c.top_logprobs[start:]]
        return {"tokens": tokens, "token_logprobs": c.logprobs[start:], "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, c: Choice, start: int, top_n: int) -> dict:
        content = []
        for t, lp, top in zip(c.token_ids[start:], c.logprobs[start:], c.top_logprobs[start:]):
            ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": self._token(t), "logprob": lp, "bytes": self.tokenizer.token_bytes(t),
                            "top_logprobs": [{"token": self._token(i), "logprob": v,
                                              "bytes": self.tokenizer.token_bytes(i)} for i, v in ranked]})
        return {"content": content}

    def header(self, rid: str, kind: str) -> dict:
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False) if not isinstance(data, str) else data}\n\n"


def completion_choice(bodies: Bodies, req: CompletionRequest, c: Choice, prompts, text: str, start: int,
                      text_offset: int, stream: bool) -> dict:
    body = {"index": c.index, "text": text,
            "logprobs": bodies.completion_logprobs(c, start, text_offset) if req.logprobs is not None else None,
            "finish_reason": c.finish_reason if (c.finish_reason or not stream) else None,
            "stop_reason": c.text.stopped}
    if req.return_token_ids:
        body["token_ids"] = c.token_ids[start:]
        if not stream or start == 0:
            body["prompt_token_ids"] = prompts[c.prompt_index]
    return body


def chat_choice_fields(bodies: Bodies, req: ChatCompletionRequest, c: Choice, start: int) -> dict:
    body = {"logprobs": bodies.chat_logprobs(c, start, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": c.finish_reason, "stop_reason": c.text.stopped}
    if req.return_token_ids:
        body["token_ids"] = c.token_ids[start:]
    return body


def chat_prompt(renderer: ChatRenderer, req: ChatCompletionRequest, max_model_len: int, room: int):
    """The rendered chat, fitted to max_model_len - room tokens (room: the tokens to generate, >= 1)."""
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if not isinstance(m.content, list) else
                 [{"type": p.type, "text": p.text} for p in m.content]} for m in req.messages]
    try:
        return renderer.render(messages, max_prompt_tokens=max_model_len - room,
                               add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages",
                       code="context_length_exceeded" if "context" in str(e) else "invalid_parameter") from None
    except Exception as e:          # the template raised (raise_exception, or a template bug)
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
