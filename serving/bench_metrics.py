"""Serving metrics from per-request timings, as vLLM's `bench serve` defines
them (same names, same formulas, same table), so the numbers compare. Pure:
the offline benchmark (serving/benchmark.py) and an HTTP load client both
feed it RequestRecords.

Times are seconds since the benchmark started. For a successful request
(finished with "stop" or "length", at least one token) with send time s and
output token times t_1 <= ... <= t_n, end time e (t_n unless given):
    ttft  = t_1 - s                           time to first token
    e2el  = e - s                             end-to-end latency
    tpot  = (e2el - ttft) / (n - 1)           time per output token after the first; only requests with n > 1
    itl   = [t_{i+1} - t_i for i < n]         inter-token latencies, pooled over every request
Over the run (D = duration: the caller's wall clock, or the last end time):
    completed              = successful requests (failed ones count in no total)
    total_input_tokens     = sum of their prompt lengths
    total_output_tokens    = sum of their n
    request_throughput     = completed / D
    output_throughput      = total_output_tokens / D
    total_token_throughput = (total_input_tokens + total_output_tokens) / D
For ttft, tpot, itl, e2el: mean, median, std (population, numpy's) and each
requested percentile (numpy's linear interpolation), in ms; 0 where there
are no values (vLLM's convention: e.g. tpot when every request made 1 token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LATENCIES = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))
SUCCESS = ("stop", "length")


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    send_time: float                                        # s since the start
    token_times: list[float] = field(default_factory=list)  # s since the start, one per output token
    finish_reason: str | None = None                        # "stop", "length", "abort"; None: never finished
    finish_time: float | None = None                        # when the last output arrived
    expected_output_len: int | None = None                  # max_tokens asked for
    num_cached_tokens: int = 0                              # prompt tokens served from the prefix cache
    error: str = ""

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def success(self) -> bool:
        return self.finish_reason in SUCCESS and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        end = self.finish_time if self.finish_time is not None else self.token_times[-1]
        return end - self.send_time

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def end_time(self) -> float:
        if self.finish_time is not None:
            return self.finish_time
        return self.token_times[-1] if self.token_times else self.send_time


def percentile_key(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's keys)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def _check_percentiles(percentiles) -> list[float]:
    if isinstance(percentiles, (str, bytes)) or not hasattr(percentiles, "__iter__"):
        raise TypeError(f"percentiles must be a list of numbers in [0, 100], got {percentiles!r}")
    out = []
    for p in percentiles:
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"percentiles must hold numbers, got {p!r}")
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must be in [0, 100], got {p}")
        out.append(float(p))
    return out


def compute_metrics(records: list[RequestRecord], *, duration_s: float | None = None,
                    percentiles=(99,)) -> dict:
    """The run's metrics as a flat dict with vLLM's JSON keys (mean_ttft_ms, p99_itl_ms, ...)."""
    if not records:
        raise ValueError("records must hold at least one request, got none")
    pcts = _check_percentiles(percentiles)
    if duration_s is None:
        duration_s = max(r.end_time for r in records)
    if isinstance(duration_s, bool) or not isinstance(duration_s, (int, float)):
        raise TypeError(f"duration_s must be a number of seconds, got {duration_s!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    values = {"ttft": [r.ttft for r in ok], "tpot": [(r.e2el - r.ttft) / (r.output_len - 1)
                                                     for r in ok if r.output_len > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    m = {"duration": float(duration_s), "completed": len(ok), "failed": len(records) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
         "total_token_throughput": (total_in + total_out) / duration_s}
    for name, _, _ in LATENCIES:
        v = np.asarray(values[name] or [0.0], dtype=np.float64) * 1000.0
        m[f"mean_{name}_ms"] = float(v.mean())
        m[f"median_{name}_ms"] = float(np.median(v))
        m[f"std_{name}_ms"] = float(v.std())
        for p in pcts:
            m[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(v, p))
    m["percentiles"] = pcts
    return m


def format_table(metrics: dict, extra: dict | None = None) -> str:
    """vLLM's result table; `extra` (label -> value) adds an engine section."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value):
        if isinstance(value, (list, tuple)):      # e.g. MTP acceptance per draft position
            value = " ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in value)
        fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
        lines.append(fmt.format(label, value))

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total Token throughput (tok/s):", metrics["total_token_throughput"])
    for name, short, header in LATENCIES:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", metrics[f"median_{name}_ms"])
        for p in metrics["percentiles"]:
            key = percentile_key(p)
            row(f"{key.upper()} {short} (ms):", metrics[f"{key}_{name}_ms"])
    if extra:
        lines.append("{s:{c}^{n}}".format(s="Engine", n=50, c="-"))
        for label, value in extra.items():
            row(f"{label}:", value)
    lines.append("=" * 50)
    return "\n".join(lines)
