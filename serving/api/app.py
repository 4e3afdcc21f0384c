"""The OpenAI-compatible HTTP server on the lab's Engine (FastAPI on uvicorn).

    app = create_app(engine, tokenizer, ServerConfig(model_name="glm5-tiny"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(both with stream), GET /health, GET /metrics. Every error is OpenAI's
{"error": {"message", "type", "param", "code"}} with its status. The engine
steps in its own thread (runner.py), started and stopped with the app.
"""
from __future__ import annotations

import asyncio
import hmac
import sys
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import metrics
from .chat import ChatRenderer
from .handlers import (Bodies, Generation, chat_choice_fields, chat_prompt, completion_choice, new_id, sse,
                       usage)
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from .runner import EngineRunner


@dataclass
class ServerConfig:
    model_name: str = "glm5"
    api_key: str | None = None              # set: /v1/* needs "Authorization: Bearer <key>"
    max_queue: int = 256                    # engine requests waiting beyond max_num_seqs before 503
    max_body_bytes: int = 1 << 20           # larger request bodies get 413
    reinject_system_every: int = 5          # 0: never


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Gate:
    """ASGI middleware in front of everything: the API key (before any body is
    read, so no work is done for a stranger) and the body-size limit (the body
    is read here, at most max_body_bytes of it, and replayed to the app)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and scope["path"].startswith("/v1"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return await _error_response(APIError(
                    401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                    code="invalid_api_key"))(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()        # then the real stream: http.disconnect when the client leaves
        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        await _error_response(APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                       code="request_too_large"))(scope, receive, send)


class SSEResponse(StreamingResponse):
    """A stream that stops when the client disconnects, and always runs `cleanup`
    (which aborts the engine requests left), even if the body never started."""

    def __init__(self, content, cleanup):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            done = asyncio.Event()

            async def stream():
                try:
                    await self.stream_response(send)
                except OSError:
                    pass            # the client went away mid-write
                finally:
                    done.set()
            task = asyncio.ensure_future(stream())
            listener = asyncio.ensure_future(self.listen_for_disconnect(receive))
            await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
            for t in (task, listener):
                t.cancel()
            await asyncio.gather(task, listener, return_exceptions=True)
        finally:
            await self.body_iterator.aclose()
            self.cleanup()


async def _until_disconnect(request: Request, work):
    """Runs `work` (a coroutine) unless the client disconnects first; then it is
    cancelled (its finally aborts the engine requests) and None is returned."""
    task = asyncio.ensure_future(work)

    async def listen():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    if task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


class OpenAIServer:
    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.max_model_len = engine.max_model_len
        if self.max_model_len > engine.max_tokens_in_pool:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the KV pool ({engine.max_tokens_in_pool} "
                             f"tokens): a long request could never finish; give more kv_cache_memory or a smaller "
                             f"max_model_len")
        if not isinstance(config.max_queue, int) or config.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {config.max_queue!r}")
        self.runner = EngineRunner(engine)
        self.counters = metrics.ServerCounters()
        self.renderer = ChatRenderer(tokenizer, reinject_system_every=config.reinject_system_every)
        self.gen = Generation(self.runner, tokenizer, self.counters, vocab_size=engine.config.vocab_size,
                              max_model_len=self.max_model_len,
                              max_in_flight=engine.scheduler.max_num_seqs + config.max_queue)
        self.bodies = Bodies(tokenizer, config.model_name)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.config.model_name}`)",
                           param="model", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "glm5-lab",
                "root": self.config.model_name, "max_model_len": self.max_model_len}

    # ------------------------------------------------------------ /v1/completions
    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            texts = [p]
        elif p and isinstance(p[0], int):
            return [self.gen.check_prompt(list(p), "prompt")]
        elif p and isinstance(p[0], list):
            return [self.gen.check_prompt(list(x), f"prompt[{i}]") for i, x in enumerate(p)]
        else:
            texts = p
        if not texts:
            raise APIError(400, "prompt is empty", param="prompt")
        return [self.gen.check_prompt(self.tokenizer.encode(t, add_special_tokens=True), "prompt") for t in texts]

    async def completions(self, request: Request):
        req = parse(CompletionRequest, await request.body())
        self.check_model(req.model)
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
        prompts = self._completion_prompts(req)
        stop = self.gen.stop_strings(req)
        params = [[self.gen.sampling_params(req, self.gen.max_tokens(req.max_tokens, len(p)), req.logprobs, i)
                   for i in range(req.n)] for p in prompts]
        rid = new_id("cmpl")
        run = self.gen.start(rid, prompts, params, stop)
        if req.stream:
            return SSEResponse(self._completion_stream(req, rid, run), run.close)
        return await _until_disconnect(request, self._completion_whole(req, rid, run)) or Response(status_code=499)

    async def _completion_whole(self, req, rid, run):
        texts = {c.index: "" for c in run.choices}
        async for ev in run:
            texts[ev.choice.index] += ev.text
        choices = [completion_choice(self.bodies, req, c, run.prompts, texts[c.index], 0, 0, False)
                   for c in run.choices]
        return {**self.bodies.header(rid, "text_completion"), "choices": choices,
                "usage": usage(run.prompts, run.choices, req.n)}

    async def _completion_stream(self, req, rid, run):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        offsets = {c.index: 0 for c in run.choices}
        try:
            async for ev in run:
                c = ev.choice
                chunk = {**self.bodies.header(rid, "text_completion"),
                         "choices": [completion_choice(self.bodies, req, c, run.prompts, ev.text, ev.first_token,
                                                       offsets[c.index], True)]}
                offsets[c.index] += len(ev.text)
                if include_usage or continuous:
                    chunk["usage"] = usage(run.prompts, run.choices, req.n) if continuous else None
                yield sse(chunk)
            if include_usage:
                yield sse({**self.bodies.header(rid, "text_completion"), "choices": [],
                           "usage": usage(run.prompts, run.choices, req.n)})
        except APIError as e:
            yield sse(e.body())
        yield sse("[DONE]")

    # ------------------------------------------------------------ /v1/chat/completions
    async def chat(self, request: Request):
        req = parse(ChatCompletionRequest, await request.body())
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        asked, param = (req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens \
            else (req.max_tokens, "max_tokens")
        if asked is not None and asked >= self.max_model_len:
            raise APIError(400, f"{param}={asked} leaves no room for a prompt in this model's context of "
                                f"{self.max_model_len} tokens", param=param, code="context_length_exceeded")
        rendered = chat_prompt(self.renderer, req, self.max_model_len, asked or 1)
        prompt = self.gen.check_prompt(rendered.token_ids, "messages")
        max_tokens = self.gen.max_tokens(asked, len(prompt), param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        stop = self.gen.stop_strings(req)
        params = [[self.gen.sampling_params(req, max_tokens, logprobs, i) for i in range(req.n)]]
        rid = new_id("chatcmpl")
        run = self.gen.start(rid, [prompt], params, stop)
        extra = {}
        if req.return_prompt:
            extra = {"prompt": rendered.text, "prompt_truncation": {
                "dropped_turns": rendered.dropped_turns, "reinjected_before_turns": rendered.reinjected_before}}
        if req.return_token_ids:
            extra["prompt_token_ids"] = prompt
        if req.stream:
            return SSEResponse(self._chat_stream(req, rid, run, extra), run.close)
        return await _until_disconnect(request, self._chat_whole(req, rid, run, extra)) or Response(status_code=499)

    async def _chat_whole(self, req, rid, run, extra):
        texts = {c.index: "" for c in run.choices}
        async for ev in run:
            texts[ev.choice.index] += ev.text
        choices = [{"index": c.index, "message": {"role": "assistant", "content": texts[c.index]},
                    **chat_choice_fields(self.bodies, req, c, 0)} for c in run.choices]
        return {**self.bodies.header(rid, "chat.completion"), "choices": choices,
                "usage": usage(run.prompts, run.choices, req.n), **extra}

    async def _chat_stream(self, req, rid, run, extra):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def chunk(choice: dict, with_usage=None) -> str:
            body = {**self.bodies.header(rid, "chat.completion.chunk"), "choices": [choice]}
            if include_usage or continuous:
                body["usage"] = usage(run.prompts, run.choices, req.n) if continuous else None
            return sse(body)
        try:
            for c in run.choices:          # the role first, as OpenAI (and the extras, once)
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield chunk(first) if c.index or not extra else \
                    sse({**self.bodies.header(rid, "chat.completion.chunk"), "choices": [first], **extra})
            async for ev in run:
                c = ev.choice
                delta = {"content": ev.text} if ev.text else {}
                yield chunk({"index": c.index, "delta": delta, **chat_choice_fields(self.bodies, req, c,
                                                                                      ev.first_token)})
            if include_usage:
                yield sse({**self.bodies.header(rid, "chat.completion.chunk"), "choices": [],
                           "usage": usage(run.prompts, run.choices, req.n)})
        except APIError as e:
            yield sse(e.body())
        yield sse("[DONE]")


def create_app(engine, tokenizer, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts the engine thread and stops it."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app):
        server.runner.start()
        try:
            yield
        finally:
            server.runner.stop()

    app = FastAPI(title="glm5-lab OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        # OpenAI's words for a route it does not have
        message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code in (404, 405) \
            else str(e.detail)
        return _error_response(APIError(e.status_code, message))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        traceback.print_exception(e, file=sys.stderr)
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.get("/health")
    async def health():
        if not server.runner.alive:
            return JSONResponse({"status": "engine down", "error": server.runner.last_error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(config.model_name, server.runner.snapshot, server.counters),
                                 media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        server.check_model(name)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.chat(request)

    gate = Gate(app, config.api_key, config.max_body_bytes)
    gate.server, gate.fastapi = server, app     # for tests and the CLI
    return gate
