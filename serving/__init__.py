"""Serving GLM-5: continuous batching over a shared paged cache (engine.py),
with vLLM's offline API names (Engine, SamplingParams, RequestOutput)."""
from .engine import Engine
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]
