"""The OpenAI server end to end: a real uvicorn server on a free loopback port,
the official `openai` client. Completions and chat, streaming and not, give
the offline engine's greedy tokens with usage counting exactly them; 64
concurrent streams all complete correctly; 200 clients that disconnect
mid-stream are aborted and leave the page pool whole."""
import asyncio
import copy

import httpx
import openai
import pytest

from serving import Engine, SamplingParams
from serving.api import ByteTokenizer, ServerConfig, create_app
from serving.api.chat import ChatRenderer
from server_helpers import running_server, scaled_model

MODEL = "glm5-tiny"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def served():
    model = scaled_model()
    offline_model = copy.deepcopy(model)         # the server's engine thread owns `model`
    tok = ByteTokenizer(model.config.vocab_size)
    engine = Engine(model, max_num_seqs=16, num_pages=160, page_size=16, max_model_len=MAX_MODEL_LEN,
                    enable_prefix_caching=True, log=False)
    app = create_app(engine, tok, ServerConfig(model_name=MODEL, max_queue=256))
    with running_server(app) as srv:
        srv.tok = tok
        srv.offline = Engine(offline_model, max_num_seqs=64, num_pages=512, page_size=16,
                             max_model_len=MAX_MODEL_LEN, log=False)
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield srv


def _offline(srv, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=srv.tok.eos_token_ids)
    return [o.outputs[0].token_ids for o in srv.offline.generate(prompts, params, use_tqdm=False)]


PROMPTS = ["The quick brown fox", "héllo wörld, ", "def f(x):\n    return", "1 2 3 4 5 6 7"]


def test_completions_greedy_equal_offline_engine(served):
    want = _offline(served, [served.tok.encode(p) for p in PROMPTS], 12)
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert len(r.choices) == len(PROMPTS)
    for c, ids in zip(r.choices, want):
        assert c.model_extra["token_ids"] == ids
        assert c.text == served.tok.decode(ids)
        assert c.finish_reason == ("length" if len(ids) == 12 else "stop")
    assert r.usage.completion_tokens == sum(len(ids) for ids in want)
    assert r.usage.prompt_tokens == sum(len(served.tok.encode(p)) for p in PROMPTS)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_stream_matches_whole_and_counts_usage(served):
    whole = served.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                             extra_body={"return_token_ids": True})
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"return_token_ids": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert text == whole.choices[0].text and ids == whole.choices[0].model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(served.tok.encode(PROMPTS[2]))


def _chat_messages(i=0):
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Question {i}: 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def test_chat_greedy_equal_offline_engine_stream_and_not(served):
    prompt = ChatRenderer(served.tok, reinject_system_every=5).render(
        _chat_messages(), max_prompt_tokens=MAX_MODEL_LEN - 10).token_ids
    want = _offline(served, [prompt], 10)[0]
    r = served.client.chat.completions.create(model=MODEL, messages=_chat_messages(), max_tokens=10, temperature=0,
                                              extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == served.tok.decode(want)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
    stream = list(served.client.chat.completions.create(
        model=MODEL, messages=_chat_messages(), max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=2))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    logprobs = [lp for c in stream if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(logprobs) == len(want) and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    # greedy: the chosen token is the most likely one
    assert all(lp.logprob == pytest.approx(lp.top_logprobs[0].logprob) for lp in logprobs)
    assert stream[-1].usage.completion_tokens == len(want) and stream[-1].usage.prompt_tokens == len(prompt)


def test_n_seed_and_stop_string(served):
    r = served.client.completions.create(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, n=3, seed=7,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    again = served.client.completions.create(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, n=3,
                                             seed=7, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and ids == [c.model_extra["token_ids"] for c in again.choices]
    assert len(set(map(tuple, ids))) > 1, "choice i draws with seed + i: the choices differ"
    assert r.usage.completion_tokens == 24
    # a stop string: the text ends before it, finish_reason "stop"
    whole = served.client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    printable = [ch for ch in text[1:] if ch.isprintable() and ch != "\ufffd"]
    if not printable:
        pytest.skip("the greedy text has no printable character to stop at")
    stop = printable[0]
    cut = served.client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_chat_return_prompt_shows_reinjection(served):
    messages = [{"role": "system", "content": "SYS"}]
    for i in range(1, 7):
        messages += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    messages.append({"role": "user", "content": "u7"})
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": messages, "max_tokens": 1, "return_prompt": True}).json()
    assert r["prompt_truncation"] == {"dropped_turns": 0, "reinjected_before_turns": [5]}
    assert r["prompt"].count("<|system|>\nSYS") == 2 and "<|system|>\nSYS<|user|>\nu5" in r["prompt"]


def test_64_concurrent_streams_then_200_disconnects_leave_the_pool_whole(served):
    prompts = [f"request {i}: " + "xyz"[i % 3] * (i % 7) for i in range(64)]
    want = _offline(served, [served.tok.encode(p) for p in prompts], 6)

    async def one(client, prompt):
        ids = []
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids

    async def all_streams():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))
    assert asyncio.run(all_streams()) == want

    before = served.metrics()

    async def leave_mid_stream(client, i):
        body = {"model": MODEL, "prompt": f"bye {i}", "max_tokens": 200, "stream": True,
                "temperature": 0, "ignore_eos": True}
        async with client.stream("POST", served.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    return              # one token arrived: hang up

    async def disconnects():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=50)) as client:
            for wave in range(4):
                await asyncio.gather(*(leave_mid_stream(client, 50 * wave + i) for i in range(50)))
    asyncio.run(disconnects())
    m = served.wait_idle()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["glm5_lab:kv_cache_free_pages"] == m["glm5_lab:kv_cache_pages"], "every page is back in the pool"
    key = 'vllm:request_success_total{finished_reason="abort"}'
    assert m[key] - before[key] == 200
    # aborted early: far fewer tokens than 200 requests x 200 tokens
    engine_tokens = "glm5_lab:engine_generated_tokens_total"
    assert m[engine_tokens] - before[engine_tokens] < 200 * 200 / 4
    assert served.client.completions.create(model=MODEL, prompt="still here", max_tokens=2).usage.completion_tokens


def test_bench_serve_over_http_counts_every_token(served, tmp_path):
    from profiling.cli import main

    rc = main(["bench-serve", "--base-url", served.url, "--preset", "tiny", "--dataset", "prefix_repetition",
               "--num-prompts", "8", "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "4",
               "--prefix-repetition-output-len", "5", "--request-rate", "50", "--max-concurrency", "4",
               "--out", str(tmp_path)])
    assert rc == 0
    import json
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 8 and result["failed"] == 0 and result["total_output_tokens"] == 8 * 5
    assert result["total_input_tokens"] == 8 * 36 and result["config"]["model"] == MODEL
    assert all(len(itl) == 4 for itl in result["itls"]) and result["mean_ttft_ms"] > 0
    assert sum(result["num_cached_tokens"]) > 0            # the server's prefix cache served the shared prefixes
    assert (tmp_path / "result.txt").read_text().startswith("=")
