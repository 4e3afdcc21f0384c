"""The OpenAI-compatible HTTP server over serving.Engine (`glm5-lab serve`).

    from serving.api import ServerConfig, create_app, load_tokenizer
    app = create_app(engine, load_tokenizer(None, vocab_size), ServerConfig(model_name="glm5-tiny"))

app.py (routes, middleware), handlers.py (requests -> engine -> responses),
protocol.py (bodies, errors), runner.py (the engine thread), tokenizer.py,
chat.py (template, re-injection, truncation), textstream.py (detokenising,
stop strings), metrics.py (Prometheus text). docs/SERVING_API.md has the use.
"""
from .app import ServerConfig, create_app
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ServerConfig", "create_app", "load_tokenizer", "ByteTokenizer"]
