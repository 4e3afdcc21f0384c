"""The offline serving benchmark: drive an Engine in this process with requests
arriving on a (Poisson / gamma) schedule, and time every output token.

    records = run_offline(engine, requests, request_rate=4.0, seed=0)
    metrics = bench_metrics.compute_metrics(records)

A request's send time is its scheduled arrival, not when the loop got round
to adding it: a request that arrives while a step runs waits in a real
server's queue too, and that wait belongs in its TTFT (no coordinated
omission). Each token is stamped when the step() that produced it returns.
"""
from __future__ import annotations

import math
import sys
import time

from .bench_metrics import RequestRecord
from .datasets import SampleRequest, arrival_times
from .params import SamplingParams

PROGRESS_EVERY_S = 1.0


def run_offline(engine, requests: list[SampleRequest], *, request_rate: float, seed: int = 0,
                burstiness: float = 1.0, temperature: float = 0.0, progress: bool = True,
                clock=time.perf_counter, sleep=time.sleep) -> list[RequestRecord]:
    """Runs every request to completion; one RequestRecord per request, in order.
    Requests decode greedily by default (vLLM's bench default) with
    max_tokens = their output_len; `clock` / `sleep` are for tests."""
    if not requests:
        raise ValueError("requests must hold at least one SampleRequest, got none")
    arrivals = arrival_times(len(requests), request_rate, burstiness=burstiness, seed=seed)
    ids = [f"bench-{i}" for i in range(len(requests))]
    records = {rid: RequestRecord(rid, r.prompt_len, t, expected_output_len=r.output_len)
               for rid, r, t in zip(ids, requests, arrivals)}
    meter = _Progress(len(requests), progress)
    start = clock()
    sent = done = 0
    slept_until = 0.0
    while done < len(requests):
        # after sleeping to an arrival it is due, even if the clock's float arithmetic reads a hair short
        now = max(clock() - start, slept_until)
        while sent < len(requests) and arrivals[sent] <= now:
            params = SamplingParams(max_tokens=requests[sent].output_len, temperature=temperature)
            engine.add_request(ids[sent], list(requests[sent].prompt_token_ids), params)
            sent += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            t = clock() - start
            done += _record(outputs, records, t)
            meter.update(t, done, records)
        elif sent < len(requests):
            sleep(max(0.0, arrivals[sent] - (clock() - start)))     # idle until the next arrival
            slept_until = arrivals[sent]
        else:
            missing = [rid for rid, r in records.items() if r.finish_reason is None]
            raise RuntimeError(f"the engine has no unfinished request but never finished {missing[:5]} "
                               f"({len(missing)} in all)")
    meter.close(clock() - start, done, records)
    return [records[rid] for rid in ids]


def _record(outputs, records: dict, t: float) -> int:
    """Stamps the new tokens of each output at time t; returns how many requests finished."""
    finished = 0
    for out in outputs:
        rec = records.get(out.request_id)
        if rec is None or rec.finish_reason is not None:
            continue
        completion = out.outputs[0] if out.outputs else None
        if completion is not None:
            new = len(completion.token_ids) - len(rec.token_times)   # token_ids are cumulative
            rec.token_times.extend([t] * max(new, 0))
        rec.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            rec.finish_reason = (completion.finish_reason if completion is not None else None) or "abort"
            rec.finish_time = t
            finished += 1
    return finished


class _Progress:
    """done/total and output tokens/s, at most once a second."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.last = total, enabled, -math.inf

    def update(self, t: float, done: int, records: dict) -> None:
        if self.enabled and t - self.last >= PROGRESS_EVERY_S:
            self.last = t
            self._print(t, done, records)

    def close(self, t: float, done: int, records: dict) -> None:
        if self.enabled:
            self._print(t, done, records)

    def _print(self, t, done, records):
        tokens = sum(len(r.token_times) for r in records.values())
        rate = tokens / t if t > 0 else 0.0
        print(f"[bench-serve] {t:7.1f}s  {done}/{self.total} requests done  {tokens} output tokens "
              f"({rate:.1f} tok/s)", file=sys.stdout, flush=True)
