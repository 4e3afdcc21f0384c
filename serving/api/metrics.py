"""GET /metrics: Prometheus text (exposition format 0.0.4) with vLLM's metric
names where vLLM has one, so its dashboards read this server too.

Gauges come from the engine thread's last snapshot; counters from the
server's own tallies (ServerCounters), which only the event loop writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ServerCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    rejected_full: int = 0          # 503: the waiting queue was full
    in_flight: int = 0              # engine requests admitted and not yet done (a gauge)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(model_name: str, snapshot: dict, counters: ServerCounters) -> str:
    lab = f'model_name="{_label(model_name)}"'
    rows = []

    def metric(name, kind, help_text, value, extra=""):
        rows.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}")
        labels = lab + (f",{extra}" if extra else "")
        rows.append(f"{name}{{{labels}}} {float(value)!r}")

    metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", snapshot["num_running"])
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", snapshot["num_waiting"])
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage: 1 means every page is in use.",
           snapshot["kv_cache_usage"])
    metric("vllm:prefix_cache_queries_total", "counter", "Prefix-cache lookups (pages).",
           snapshot["prefix_cache_queries"])
    metric("vllm:prefix_cache_hits_total", "counter", "Prefix-cache hits (pages).", snapshot["prefix_cache_hits"])
    metric("glm5_lab:prefix_cache_hit_rate", "gauge", "Prefix-cache hits / lookups since start.",
           snapshot["prefix_cache_hit_rate"])
    metric("vllm:num_preemptions_total", "counter", "Requests preempted (recomputed later).",
           snapshot["num_preemptions"])
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens admitted.", counters.prompt_tokens)
    metric("vllm:generation_tokens_total", "counter", "Tokens generated and delivered.", counters.generation_tokens)
    rows.append("# HELP vllm:request_success_total Finished requests by finish reason.\n"
                "# TYPE vllm:request_success_total counter")
    for reason, count in counters.finished.items():
        rows.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {float(count)!r}')
    metric("glm5_lab:kv_cache_pages", "gauge", "Pages in the KV pool.", snapshot["num_pages"])
    metric("glm5_lab:kv_cache_free_pages", "gauge", "Free pages (cached pages no request holds count as free).",
           snapshot["num_free_pages"])
    metric("glm5_lab:engine_steps_total", "counter", "Engine steps run.", snapshot["steps"])
    metric("glm5_lab:engine_generated_tokens_total", "counter",
           "Tokens the engine sampled (with those of requests aborted before delivery).", snapshot["generated_tokens"])
    metric("glm5_lab:requests_in_flight", "gauge", "Engine requests admitted by the server, not yet done.",
           counters.in_flight)
    metric("glm5_lab:requests_rejected_total", "counter", "Requests refused with 503: the queue was full.",
           counters.rejected_full)
    return "\n".join(rows) + "\n"


def parse(text: str) -> dict[str, float]:
    """{name: value} of a render() output, for tests and clients; labels other
    than model_name stay in the key: 'vllm:request_success_total{finished_reason="abort"}'."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name, _, labels = name_labels.partition("{")
            rest = [x for x in labels.rstrip("}").split(",") if x and not x.startswith("model_name=")]
            out[name + ("{" + ",".join(rest) + "}" if rest else "")] = float(value)
    return out
