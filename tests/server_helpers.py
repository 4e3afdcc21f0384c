"""A real uvicorn server on a free loopback port, in a background thread, for the server tests.

    with running_server(engine, tokenizer, ServerConfig(...)) as srv:
        srv.url, srv.app.server (the OpenAIServer), srv.metrics() -> {name: value}

It stops by itself when the block ends (should_exit, then a bounded join).
"""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import torch
import uvicorn

from models.glm5 import GLM5ForCausalLM, preset
from serving.api import metrics as metrics_mod

START_TIMEOUT_S = 20.0


def scaled_model(name="tiny", attn="dsa", seed=0, **changes):
    """Weights of std 1/sqrt(fan_in) (as test_serving_engine): greedy tokens vary with the prompt."""
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(preset(name).replace(**changes), attn=attn).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


class RunningServer:
    def __init__(self, app, port: int):
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"

    def metrics(self) -> dict[str, float]:
        return metrics_mod.parse(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Polls /metrics until no request is running, waiting or in flight; returns the last reading."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                    and m["glm5_lab:requests_in_flight"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(app):
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(app, port)
    finally:
        server.should_exit = True
        thread.join(10)
