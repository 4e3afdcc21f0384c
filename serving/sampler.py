"""The next token of every scheduled request, from one batch of logits.

Greedy rows take the argmax. Sampled rows are scaled by their temperature,
cut to their top_k / top_p nucleus (models/glm5/generate.py's rule, per row)
and drawn. A seeded request draws from its own torch.Generator, so its tokens
depend on its seed and its logits only, never on the batch around it; the
others draw from torch's default generator (torch.manual_seed makes a run
repeatable). Logprobs are those of the raw logits (log_softmax before
temperature and cuts), as vLLM reports by default.
"""
from __future__ import annotations

import torch

from models.glm5.generate import top_k_top_p_filter

from .request import Request


class Sampler:
    def __init__(self):
        # request_id -> its generator; the engine calls release() when a request ends
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        g = self._generators.get(request.request_id)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(request.params.seed)
            self._generators[request.request_id] = g
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]):
        """logits [N, V], row i for requests[i] -> (token_ids, logprobs, top_logprobs),
        three lists of N: the chosen id; its logprob (None where params.logprobs
        is None); {token id: logprob} of the top params.logprobs ids plus the
        chosen one (None where params.logprobs is None or 0)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise ValueError(f"logits must be a tensor [N, V], got "
                             f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
        if logits.shape[0] != len(requests):
            raise ValueError(f"logits must have one row per request: {len(requests)} requests, "
                             f"got shape {tuple(logits.shape)}")
        n = len(requests)
        if n == 0:
            return [], [], []
        logits = logits.float()
        chosen = logits.argmax(-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            chosen[sampled] = self._draw(logits[sampled], [requests[i] for i in sampled])
        token_ids = chosen.tolist()
        logprobs, top_logprobs = self.logprobs(logits, chosen, requests)
        return token_ids, logprobs, top_logprobs

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One softmax over every sampled row; the draws per generator."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=dev, dtype=torch.float32)
        top_k = torch.tensor([max(r.params.top_k, 0) for r in requests], device=dev, dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in requests], device=dev, dtype=torch.float32)
        probs = top_k_top_p_filter(logits / temps[:, None], top_k, top_p).softmax(-1)
        out = torch.empty(len(requests), dtype=torch.long, device=dev)
        shared = [i for i, r in enumerate(requests) if r.params.seed is None]
        if shared:
            out[shared] = torch.multinomial(probs[shared], 1)[:, 0]
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                out[i] = torch.multinomial(probs[i:i + 1], 1, generator=self._generator(r, dev))[0, 0]
        return out

    @staticmethod
    def logprobs(logits, chosen, requests):
        """(logprob of each chosen id, {id: logprob} of its top params.logprobs ids plus the chosen) per
        row, None where the request did not ask: log_softmax of the raw logits, as vLLM reports."""
        n = len(requests)
        logprobs: list = [None] * n
        top_logprobs: list = [None] * n
        asked = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not asked:
            return logprobs, top_logprobs
        lp = logits[asked].log_softmax(-1)
        picked = lp.gather(-1, chosen[asked][:, None])[:, 0].tolist()
        most = max(requests[i].params.logprobs for i in asked)
        top_vals, top_ids = lp.topk(min(most, lp.shape[-1]), dim=-1) if most else (None, None)
        for row, i in enumerate(asked):
            logprobs[i] = picked[row]
            k = requests[i].params.logprobs
            if k:
                top = dict(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist()))
                top.setdefault(int(chosen[i]), picked[row])
                top_logprobs[i] = top
        return logprobs, top_logprobs
