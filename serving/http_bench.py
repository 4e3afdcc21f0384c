"""The serving benchmark over HTTP: an async client that streams completions
from any OpenAI-compatible server (ours, vLLM's) and times every token, for
serving/bench_metrics.py (vLLM's `bench serve` metrics).

    records, duration = asyncio.run(run_http(base_url, model, requests, request_rate=4.0))

Prompts go as token ids (the OpenAI completions API takes them), with
max_tokens = the request's output_len and ignore_eos (vLLM's extension), so
every server generates the same lengths. Tokens are counted from each chunk's
token_ids when the server returns them (return_token_ids), else one per
non-empty text chunk (vLLM's client's rule). Send times are the scheduled
arrivals, as the offline benchmark (no coordinated omission).
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time

from .bench_metrics import RequestRecord
from .datasets import SampleRequest, arrival_times


async def _one(client, url: str, model: str, rid: str, req: SampleRequest, send_time: float, start: float,
               temperature: float, limit, headers) -> RequestRecord:
    rec = RequestRecord(rid, req.prompt_len, send_time, expected_output_len=req.output_len)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    async with limit:
        try:
            async with client.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter() - start
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = str(chunk["error"])
                        break
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids")
                        n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                        rec.token_times.extend([now] * n)
                        if choice.get("finish_reason"):
                            rec.finish_reason, rec.finish_time = choice["finish_reason"], now
                    usage = chunk.get("usage") or {}
                    rec.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        except Exception as e:      # a failed request counts as failed, the run goes on
            rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_http(base_url: str, model: str, requests: list[SampleRequest], *, request_rate: float,
                   burstiness: float = 1.0, seed: int = 0, temperature: float = 0.0, max_concurrency: int | None = None,
                   api_key: str | None = None, progress: bool = True, timeout_s: float = 600.0):
    """Sends every request on its schedule; returns (records in order, wall-clock duration)."""
    import httpx

    if not requests:
        raise ValueError("requests must hold at least one SampleRequest, got none")
    arrivals = arrival_times(len(requests), request_rate, burstiness=burstiness, seed=seed)
    url = base_url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    conns = max_concurrency or len(requests)
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=conns,
                                                                         max_keepalive_connections=conns)) as client:
        start = time.perf_counter()

        async def scheduled(i, req):
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
            return await _one(client, url, model, f"bench-{i}", req, arrivals[i], start, temperature, limit, headers)
        tasks = [asyncio.ensure_future(scheduled(i, r)) for i, r in enumerate(requests)]
        last = -math.inf
        while progress and not all(t.done() for t in tasks):
            await asyncio.sleep(0.2)
            t = time.perf_counter() - start
            if t - last >= 1.0:
                last = t
                print(f"[bench-serve] {t:7.1f}s  {sum(x.done() for x in tasks)}/{len(tasks)} requests done",
                      file=sys.stdout, flush=True)
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


async def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id the server lists (GET /v1/models)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(base_url.rstrip("/") + "/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
