"""The server's errors: each bad request gets its status and OpenAI's error body
({"error": {message, type, param, code}}), naming the parameter; malformed,
mistyped and oversized bodies never crash it (it answers the next request);
500 generated bodies never get a 5xx; without the API key a request gets 401
and schedules no work; a full queue answers 503."""
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import Engine
from serving.api import ByteTokenizer, ServerConfig, create_app
from server_helpers import running_server, scaled_model

MODEL = "glm5-tiny"
MAX_LEN = 64


def _app(engine_cls=Engine, max_num_seqs=8, **config):
    model = scaled_model()
    engine = engine_cls(model, max_num_seqs=max_num_seqs, num_pages=64, page_size=16, max_model_len=MAX_LEN,
                        log=False)
    return create_app(engine, ByteTokenizer(model.config.vocab_size),
                      ServerConfig(model_name=MODEL, max_body_bytes=4096, **config))


@pytest.fixture(scope="module")
def srv():
    with running_server(_app()) as s:
        s.http = httpx.Client(base_url=s.url, timeout=30)
        yield s
        s.http.close()


def _assert_error(r, status, param=...):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not ...:
        assert err["param"] == param, err


C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_PARAMS = [  # (route, change, param named)
    (C, {"temperature": -1}, "temperature"), (C, {"temperature": "hot"}, "temperature"),
    (C, {"temperature": 3.0}, "temperature"), (C, {"top_p": 0}, "top_p"), (C, {"top_p": "1"}, "top_p"),
    (C, {"n": 0}, "n"), (C, {"n": 17}, "n"), (C, {"n": "2"}, "n"), (C, {"n": 1.5}, "n"),
    (C, {"max_tokens": 0}, "max_tokens"), (C, {"max_tokens": "5"}, "max_tokens"),
    (C, {"max_tokens": 10**9}, "max_tokens"), (C, {"seed": "x"}, "seed"), (C, {"seed": 2**70}, "seed"),
    (C, {"stop": ["a", "b", "c", "d", "e"]}, "stop"), (C, {"stop": 1}, "stop"), (C, {"logprobs": 6}, "logprobs"),
    (C, {"logprobs": True}, "logprobs"), (C, {"stream": "yes"}, "stream"),
    (C, {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (C, {"prompt": 5}, "prompt"), (C, {"prompt": ""}, "prompt"), (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [1, 99999]}, "prompt"), (C, {"prompt": "x" * (MAX_LEN + 5)}, "prompt"),
    (C, {"top_k": -2}, "top_k"), (C, {"stop_token_ids": [10**6]}, "stop_token_ids"),
    (C, {"frequency_penalty": 0.5}, "frequency_penalty"), (C, {"echo": True}, "echo"),
    (C, {"no_such_thing": 1}, "no_such_thing"), (C, {"prompt": None}, "prompt"),
    (CHAT, {"messages": []}, "messages"), (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages.0.role"), (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"), (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"max_tokens": MAX_LEN}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
]


@pytest.mark.parametrize("route,change,param", BAD_PARAMS, ids=[f"{r[-16:]}-{p}" for r, _, p in BAD_PARAMS])
def test_bad_parameter_is_400_naming_it(srv, route, change, param):
    body = {**(OK_C if route == C else OK_CHAT), **change}
    _assert_error(srv.http.post(route, json=body), 400, param)


def test_unknown_model_and_route_are_404(srv):
    _assert_error(srv.http.post(C, json={**OK_C, "model": "gpt-4"}), 404, "model")
    _assert_error(srv.http.get("/v1/models/gpt-4"), 404, "model")
    _assert_error(srv.http.get("/v1/nothing"), 404)
    _assert_error(srv.http.get(C), 405)
    assert srv.http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


MALFORMED = [b"{", b"not json", b"[1, 2]", b'{"prompt": "a",}', b"\xff\xfe", b"", b"null", b'{"prompt": ' * 350]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_json_is_400_and_the_server_goes_on(srv, body):
    for route in (C, CHAT):
        _assert_error(srv.http.post(route, content=body, headers={"content-type": "application/json"}), 400)
    assert srv.http.post(C, json=OK_C).status_code == 200


def test_oversized_body_is_413_declared_or_chunked(srv):
    big = json.dumps({**OK_C, "prompt": "x" * 5000}).encode()
    _assert_error(srv.http.post(C, content=big, headers={"content-type": "application/json"}), 413)

    def chunks():                   # no content-length: the limit counts the bytes as they come
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]
    _assert_error(srv.http.post(C, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert srv.http.get("/health").json() == {"status": "ok"}
    assert srv.http.post(C, json=OK_C).status_code == 200


# Small ints or far-out ones: a valid body generates at most a few tokens (the test stays fast).
_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([65, 10**6, -(10**6), 2**64, -(2**70)]),
                    st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(-2, 600), max_size=5),
                    st.lists(st.text(max_size=3), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                 max_size=2))
_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
         "stop", "stream", "stream_options", "logprobs", "top_logprobs", "top_k", "ignore_eos", "stop_token_ids",
         "echo", "best_of", "return_token_ids", "return_prompt", "presence_penalty", "user", "junk"]
_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                            "content": st.one_of(st.text(max_size=20), st.none(), st.integers())}),
                     max_size=4)


@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from([C, CHAT]), changes=st.dictionaries(st.sampled_from(_KEYS), _values, max_size=4),
       messages=_messages, as_text=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(srv, route, changes, messages, as_text):
    body = {**(OK_C if route == C else OK_CHAT), "max_tokens": 1, **changes}
    if route == CHAT and "messages" not in changes and messages:
        body["messages"] = messages
    content = json.dumps(body) if as_text else json.dumps(body)[: len(json.dumps(body)) // 2]   # half: malformed
    r = srv.http.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        _assert_error(r, r.status_code)


def test_api_key_401_without_bearer_and_no_work_scheduled():
    with running_server(_app(api_key="sekrit")) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        before = s.metrics()
        _assert_error(http.post(C, json=OK_C), 401)
        _assert_error(http.post(C, json=OK_C, headers={"Authorization": "Bearer wrong"}), 401)
        _assert_error(http.post(CHAT, json=OK_CHAT, headers={"Authorization": "sekrit"}), 401)
        _assert_error(http.get("/v1/models"), 401)
        after = s.metrics()
        for name in ("vllm:prompt_tokens_total", "glm5_lab:engine_steps_total",
                     "glm5_lab:engine_generated_tokens_total"):
            assert after[name] == before[name], name
        assert http.post(C, json=OK_C, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert http.get("/health").status_code == 200          # health and metrics stay open


class SlowEngine(Engine):
    """Each step takes >= 40 ms: requests stay in flight long enough to fill the queue."""

    def step(self):
        time.sleep(0.04)
        return super().step()


def test_full_queue_is_503_then_served_again():
    with running_server(_app(SlowEngine, max_num_seqs=2, max_queue=1)) as s:
        started = threading.Barrier(4)
        statuses = []

        def stream():
            body = {**OK_C, "max_tokens": 20, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", s.url + C, json=body, timeout=30) as r:
                statuses.append(r.status_code)
                started.wait(10)
                r.read()
        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(10)                 # 3 in flight = max_num_seqs 2 + max_queue 1
        r = httpx.post(s.url + C, json=OK_C, timeout=30)
        _assert_error(r, 503)
        assert r.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(30)
        assert statuses == [200, 200, 200]
        assert s.metrics()["glm5_lab:requests_rejected_total"] == 1
        assert httpx.post(s.url + C, json=OK_C, timeout=30).status_code == 200
