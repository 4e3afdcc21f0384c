"""A verifiable reward for a byte-level code LM: does a sampled line parse?

A prompt is `prompt` bytes of source ending at a line break; the model
samples the next line (until a newline, at most `completion` bytes). The
reward is 1 when that line, stripped of its indentation, is non-empty and
`ast.parse` accepts it (a block opener ending in ":" is given a body of
`pass`), else 0; a line cut off at `completion` bytes gets 0. REINFORCE
with the batch's mean reward as the baseline raises the parse rate:
loss = -mean((r - mean r) * sum log p(completion)).
"""
from __future__ import annotations

import ast

import torch
import torch.nn.functional as F

NEWLINE = ord("\n")
# The model is byte-level but its vocabulary can be larger (the tiny preset has 512 ids):
# sampling and the policy's log-probabilities are over the 256 byte ids only, so every
# sampled line is bytes.
BYTES = 256


def line_parses(line: bytes) -> bool:
    text = line.decode("utf-8", errors="replace").strip()
    if not text or "\ufffd" in text:
        return False
    for candidate in (text, text + " pass") if text.endswith(":") else (text,):
        try:
            ast.parse(candidate)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def prompts(data: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[n, length] windows of data, each ending just after a newline."""
    ends = (data[length:] == NEWLINE).nonzero().flatten() + length + 1
    if ends.numel() == 0:
        raise ValueError(f"data holds no newline after its first {length} bytes: no prompt can be cut")
    pick = ends[torch.randint(0, ends.numel(), (n,), generator=gen)]
    return torch.stack([data[e - length:e] for e in pick.tolist()]).long()


@torch.no_grad()
def sample(model, prompt: torch.Tensor, max_new: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled continuations [B, max_new] (temperature 1) and their lengths
    through the first newline (max_new + 1 when none came: cut off)."""
    ids = prompt
    for _ in range(max_new):
        logits = model(ids)[:, -1, :BYTES].float()
        nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt], 1)
    out = ids[:, prompt.shape[1]:]
    is_nl = out == NEWLINE
    first = torch.where(is_nl.any(1), is_nl.float().argmax(1) + 1, torch.full_like(out[:, 0], max_new + 1))
    return out, first


def rewards(completions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    out = []
    for row, n in zip(completions.tolist(), lengths.tolist()):
        cut_off = n > len(row)
        out.append(0.0 if cut_off else float(line_parses(bytes(row[:n - 1]))))
    return torch.tensor(out)


def parse_rate(model, data: torch.Tensor, *, n: int, prompt: int, completion: int, seed: int) -> float:
    """Fraction of n sampled lines that parse, prompts and sampling seeded (the same before and after)."""
    gen = torch.Generator().manual_seed(seed)
    p = prompts(data, n, prompt, gen)
    comp, lengths = sample(model, p, completion, gen)
    return float(rewards(comp, lengths).mean())


def policy_gradient_step(model, optimizer, data: torch.Tensor, *, samples: int, prompt: int, completion: int,
                         gen: torch.Generator) -> float:
    """One REINFORCE step on `samples` sampled lines; returns their mean reward."""
    p = prompts(data, samples, prompt, gen)
    comp, lengths = sample(model, p, completion, gen)
    r = rewards(comp, lengths)
    advantage = r - r.mean()
    if advantage.abs().sum() > 0:
        ids = torch.cat([p, comp], 1)
        logp = F.log_softmax(model(ids[:, :-1])[..., :BYTES].float(), -1)
        taken = logp[:, prompt - 1:].gather(-1, comp.unsqueeze(-1)).squeeze(-1)   # [B, completion]
        mask = torch.arange(comp.shape[1]).unsqueeze(0) < lengths.clamp(max=comp.shape[1]).unsqueeze(1)
        loss = -(advantage * (taken * mask).sum(1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(r.mean())
