"""A random-weight GLM-5 checkpoint written by transformers, with the lab's GLM
tokenizer beside it: the one input all three engines (ours, transformers,
llama.cpp via its converter) read.

Weights as in tests/test_model.py's parity checkpoints: matrices ~ N(0, 1/fan_in),
norm weights 1 + 0.1 N(0, 1) and routing biases 0.1 N(0, 1), so that norms and the
router's correction bias take part in the comparison (ones and zeros would hide
a swapped or dropped tensor).
"""
from __future__ import annotations

import torch

from .tokenizer import write_glm_tokenizer


def write_checkpoint(config, path: str, seed: int = 0) -> None:
    """config: a models.glm5 GLM5Config. Writes config.json, model.safetensors and
    tokenizer files into `path` (created if needed)."""
    import transformers
    torch.manual_seed(seed)
    hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**config.to_hf_dict()))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    hf.save_pretrained(path)
    write_glm_tokenizer(path, config.vocab_size)
