"""serving's benchmark: the metric formulas on hand-built records, arrival
times, the datasets, run_offline against a fake engine on a fake clock, and
bench-serve's report files and arguments (no model, no real engine)."""
import json
import math

import numpy as np
import pytest

from serving import datasets
from serving.bench_metrics import RequestRecord, compute_metrics, format_table
from serving.benchmark import run_offline
from serving.datasets import SampleRequest, arrival_times
from serving.outputs import CompletionOutput, RequestOutput


# ---------------------------------------------------------------- a fake engine

class FakeClock:
    def __init__(self):
        self.t = 100.0          # any origin: run_offline reports times since its start

    def __call__(self):
        return self.t

    def sleep(self, s):
        assert s >= 0
        self.t += s


class FakeEngine:
    """Every running request gains one token per step (the first on the step
    after it is added); each step takes step_s on `advance`; stops at max_tokens."""

    def __init__(self, step_s, advance):
        self.step_s, self.advance = step_s, advance
        self.running = {}           # id -> (prompt, params, tokens)
        self.steps = 0

    def add_request(self, request_id, prompt_token_ids, params, *, cache_salt=None):
        params.validate(1000)
        self.running[request_id] = (prompt_token_ids, params, [])

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.advance(self.step_s)
        self.steps += 1
        outs = []
        for rid, (prompt, params, tokens) in list(self.running.items()):
            tokens.append(len(tokens) % 7)
            done = len(tokens) == params.max_tokens
            outs.append(RequestOutput(rid, prompt, [CompletionOutput(0, list(tokens), None,
                                                                     "length" if done else None, None)], done))
            if done:
                del self.running[rid]
        return outs

    def stats(self):
        return {"prefix_cache_hit_rate": 0.25, "slot_utilisation": 0.5, "kv_cache_usage": 0.1,
                "num_preemptions": 0}


def fake_run(requests, rate, step_s=0.01, **kw):
    clock = FakeClock()
    engine = FakeEngine(step_s, clock.sleep)
    records = run_offline(engine, requests, request_rate=rate, seed=0, clock=clock, sleep=clock.sleep,
                          progress=False, **kw)
    return records, engine


# ---------------------------------------------------------------- metrics

def hand_records():
    return [
        RequestRecord("a", 10, 0.0, [0.10, 0.15, 0.25], "length"),
        RequestRecord("b", 20, 0.5, [0.70], "length"),
        RequestRecord("c", 5, 0.2, [0.30, 0.40], "stop"),
        RequestRecord("d", 7, 0.1, [0.30], "abort", finish_time=0.3),     # failed: in no total
    ]


def test_metrics_formulas_on_hand_built_records():
    m = compute_metrics(hand_records(), duration_s=1.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 35, 6)
    assert m["request_throughput"] == pytest.approx(3.0)
    assert m["output_throughput"] == pytest.approx(6.0)
    assert m["total_token_throughput"] == pytest.approx(41.0)
    # ttft [100, 200, 100] ms
    assert m["mean_ttft_ms"] == pytest.approx(400 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(2 * (100 / 3) ** 2 / 3 + (200 / 3) ** 2 / 3))
    assert m["p99_ttft_ms"] == pytest.approx(198)           # 100 + 0.98 * (200 - 100)
    assert m["p50_ttft_ms"] == pytest.approx(100)
    # tpot: a (250 - 100) / 2 = 75, c (200 - 100) / 1 = 100; b has one token
    assert m["mean_tpot_ms"] == pytest.approx(87.5)
    assert m["p99_tpot_ms"] == pytest.approx(75 + 0.99 * 25)
    # itl pooled: a [50, 100], c [100]
    assert m["mean_itl_ms"] == pytest.approx(250 / 3)
    assert m["median_itl_ms"] == pytest.approx(100)
    # e2el [250, 200, 200]
    assert m["mean_e2el_ms"] == pytest.approx(650 / 3)
    assert m["median_e2el_ms"] == pytest.approx(200)


def test_duration_defaults_to_the_last_end_and_empty_latencies_are_zero():
    m = compute_metrics(hand_records())
    assert m["duration"] == pytest.approx(0.7)              # b's last token
    one_token = compute_metrics([RequestRecord("x", 3, 0.0, [0.2], "length")])
    assert one_token["mean_tpot_ms"] == 0 and one_token["p99_itl_ms"] == 0     # vLLM's convention
    assert one_token["mean_e2el_ms"] == pytest.approx(200)


@pytest.mark.parametrize("call, exc, message", [
    (lambda: compute_metrics([]), ValueError, "records must hold at least one"),
    (lambda: compute_metrics(hand_records(), duration_s=0), ValueError, "duration_s must be a finite number > 0"),
    (lambda: compute_metrics(hand_records(), duration_s="1"), TypeError, "duration_s must be a number"),
    (lambda: compute_metrics(hand_records(), percentiles=[101]), ValueError, "percentiles must be in"),
    (lambda: compute_metrics(hand_records(), percentiles="99"), TypeError, "percentiles must be a list"),
])
def test_metrics_bad_input(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_table_reads_like_vllms():
    m = compute_metrics(hand_records(), duration_s=1.0, percentiles=[99.9])
    table = format_table(m, extra={"prefix_cache_hit_rate": 0.5})
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     3" in table
    assert "---------------Time to First Token----------------" in table
    assert "-----Time per Output Token (excl. 1st token)------" in table
    assert "P99.9 ITL (ms):" in table and "Mean E2EL (ms):" in table
    assert "prefix_cache_hit_rate:" in table


# ---------------------------------------------------------------- arrivals and datasets

def test_poisson_arrivals_mean_interval_and_shape():
    rate = 5.0
    t = np.asarray(arrival_times(20000, rate, seed=1))
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)     # exponential: cv 1
    bursty = np.diff(arrival_times(20000, rate, burstiness=4.0, seed=1))
    assert bursty.std() / bursty.mean() == pytest.approx(0.5, abs=0.05)  # gamma(4): cv 1/sqrt(4)
    assert arrival_times(50, rate, seed=1) == arrival_times(50, rate, seed=1) != arrival_times(50, rate, seed=2)
    assert arrival_times(7, float("inf")) == [0.0] * 7
    assert arrival_times(3, 2.0, burstiness=float("inf")) == [0.5, 1.0, 1.5]


@pytest.mark.parametrize("kw, exc, message", [
    (dict(request_rate=0.0), ValueError, "request_rate must be > 0"),
    (dict(request_rate=float("nan")), TypeError, "request_rate must be a number"),
    (dict(request_rate=1.0, burstiness=0.0), ValueError, "burstiness must be > 0"),
])
def test_arrival_bad_input(kw, exc, message):
    with pytest.raises(exc, match=message):
        arrival_times(4, **kw)


def test_random_dataset_lengths_in_range_and_seeded():
    reqs = datasets.random_requests(300, input_len=(4, 9), output_len=(2, 3), vocab_size=50, seed=3)
    assert {r.prompt_len for r in reqs} == set(range(4, 10))
    assert {r.output_len for r in reqs} == {2, 3}
    assert all(0 <= t < 50 for r in reqs for t in r.prompt_token_ids)
    again = datasets.random_requests(300, input_len=(4, 9), output_len=(2, 3), vocab_size=50, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    with pytest.raises(ValueError, match="input_len must have lo <= hi"):
        datasets.random_requests(3, input_len=(9, 4), output_len=(2, 3), vocab_size=50)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        datasets.random_requests(3, input_len=(4, 9), output_len=(2, 3), vocab_size=0)


def test_prefix_repetition_shares_prefixes_as_specified():
    kw = dict(prefix_len=16, suffix_len=8, output_len=5, vocab_size=1000, seed=0)
    reqs = datasets.prefix_repetition_requests(10, num_prefixes=3, **kw)
    assert all(r.prompt_len == 24 and r.output_len == 5 for r in reqs)
    groups = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt_token_ids[:16]), []).append(tuple(r.prompt_token_ids[16:]))
    assert sorted(len(g) for g in groups.values()) == [3, 3, 4]
    assert len({s for g in groups.values() for s in g}) == 10          # every suffix its own
    distinct = datasets.prefix_repetition_requests(10, num_prefixes=3, distinct_prefixes=True, **kw)
    assert len({tuple(r.prompt_token_ids[:16]) for r in distinct}) == 10
    assert all(r.prompt_len == 24 for r in distinct)


# ---------------------------------------------------------------- run_offline

def test_run_offline_all_at_once_matches_the_fake_engine():
    reqs = [SampleRequest([1, 2], 1), SampleRequest([3, 4, 5], 2), SampleRequest([6], 3)]
    records, engine = fake_run(reqs, float("inf"))
    assert engine.steps == 3
    assert [r.send_time for r in records] == [0.0, 0.0, 0.0]
    expect = [[0.01], [0.01, 0.02], [0.01, 0.02, 0.03]]
    assert all(r.token_times == pytest.approx(e) for r, e in zip(records, expect))
    assert [r.finish_reason for r in records] == ["length"] * 3
    assert [r.prompt_len for r in records] == [2, 3, 1]
    m = compute_metrics(records)
    assert m["duration"] == pytest.approx(0.03)
    assert m["mean_ttft_ms"] == pytest.approx(10) and m["mean_itl_ms"] == pytest.approx(10)
    assert m["mean_tpot_ms"] == pytest.approx(10) and m["total_output_tokens"] == 6


def test_run_offline_sends_on_schedule_and_sleeps_when_idle():
    reqs = [SampleRequest([1] * 4, 3) for _ in range(5)]
    records, _ = fake_run(reqs, rate=1.0, step_s=0.001)     # arrivals ~1 s apart, 3 ms of work each
    arrivals = arrival_times(5, 1.0, seed=0)
    for rec, t in zip(records, arrivals):
        assert rec.send_time == t
        assert rec.token_times == pytest.approx([t + 0.001, t + 0.002, t + 0.003])
        assert rec.ttft == pytest.approx(0.001)


def test_run_offline_counts_a_queued_arrival_from_its_scheduled_time():
    # the second request arrives during a long step: its TTFT includes the wait
    reqs = [SampleRequest([1], 1), SampleRequest([2], 1)]
    records, _ = fake_run(reqs, rate=float("inf"), step_s=0.5)
    assert [r.ttft for r in records] == pytest.approx([0.5, 0.5])
    slow = fake_run([SampleRequest([1], 4)] + [SampleRequest([2], 1)], rate=1.0, step_s=0.6)[0]
    arrivals = arrival_times(2, 1.0, seed=0)
    assert slow[1].send_time == arrivals[1]
    assert slow[1].ttft > 0.6                       # queued behind the running step, not hidden


def test_run_offline_progress_and_bad_input(capsys):
    clock = FakeClock()
    run_offline(FakeEngine(0.6, clock.sleep), [SampleRequest([1], 3)], request_rate=float("inf"), clock=clock,
                sleep=clock.sleep)
    out = capsys.readouterr().out
    assert "1/1 requests done" in out and "tok/s" in out
    with pytest.raises(ValueError, match="requests must hold at least one"):
        run_offline(FakeEngine(0.1, clock.sleep), [], request_rate=1.0)


# ---------------------------------------------------------------- bench-serve

def test_bench_and_report_writes_json_table_and_png(tmp_path, capsys):
    import time

    from profiling.bench_serve_cmd import bench_and_report

    reqs = datasets.random_requests(6, input_len=(2, 5), output_len=(1, 4), vocab_size=100, seed=0)
    engine = FakeEngine(0.002, time.sleep)
    result = bench_and_report(engine, reqs, out_dir=str(tmp_path), config={"dataset": "random"},
                              request_rate=200.0, metric_percentiles=[90, 99], progress=False)
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["completed"] == 6 and data["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert data["config"] == {"dataset": "random"} and data["engine_stats"]["prefix_cache_hit_rate"] == 0.25
    assert data["p90_ttft_ms"] > 0 and "p99_e2el_ms" in data and data == json.loads(json.dumps(result))
    assert data["output_lens"] == [r.output_len for r in reqs]
    assert (tmp_path / "result.txt").read_text().startswith("============ Serving Benchmark Result")
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def parse(argv):
    from profiling.cli import build_parser
    return build_parser().parse_args(["bench-serve", *argv])


def test_bench_serve_arguments_map_to_the_dataset_and_engine():
    from profiling import bench_serve_cmd as cmd

    args = parse(["--offline", "--dataset", "prefix_repetition", "--prefix-repetition-num-prefixes", "2",
                  "--num-prompts", "6", "--enable-prefix-caching", "--num-pages", "40", "--request-rate", "3"])
    assert args.request_rate == 3.0
    kw = cmd.engine_kwargs(args)
    assert kw["enable_prefix_caching"] and kw["num_pages"] == 40 and "kv_cache_memory" not in kw
    reqs = cmd.make_requests(args, vocab_size=500)
    assert len(reqs) == 6 and len({tuple(r.prompt_token_ids[:args.prefix_repetition_prefix_len]) for r in reqs}) == 2
    args = parse(["--offline", "--random-input-len", "100", "--random-range-ratio", "0.5",
                  "--random-output-len", "3-9"])
    reqs = cmd.make_requests(args, vocab_size=500)
    assert all(50 <= r.prompt_len <= 150 and 3 <= r.output_len <= 9 for r in reqs)
    assert cmd.max_request_tokens(args) == 159


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny"], "bench-serve needs --offline"),
    (["--offline", "--random-input-len", "9-3"], "argument --random-input-len: expected positive lengths"),
    (["--offline", "--random-range-ratio", "1.5"], "argument --random-range-ratio"),
    (["--offline", "--request-rate", "0"], "argument --request-rate: expected a positive number"),
    (["--offline", "--kv-cache-memory", "1GiB", "--num-pages", "4"], "not allowed with argument"),
    (["--offline", "--metric-percentiles", "99,120"], "argument --metric-percentiles"),
    (["--offline", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--offline", "--random-input-len", "32000-33000"], "exceeds the model's max_position_embeddings"),
])
def test_bench_serve_argument_errors(capsys, argv, message):
    from profiling.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench-serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: glm5-lab") and message in err and "Traceback" not in err


def test_run_offline_refuses_an_engine_that_drops_requests():
    class Dropper(FakeEngine):
        def step(self):
            self.running.clear()
            return []

    clock = FakeClock()
    with pytest.raises(RuntimeError, match=r"never finished \['bench-0'\]"):
        run_offline(Dropper(0.1, clock.sleep), [SampleRequest([1], 2)], request_rate=float("inf"), clock=clock,
                    sleep=clock.sleep, progress=False)
