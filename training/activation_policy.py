"""The activation-memory policy for GLM-5 training across processes, applied
from outside the model per decoder layer (torchtitan applies activation
checkpointing the same way, before FSDP2):

    none       autograd keeps what each layer saves
    recompute  each layer keeps only its input; backward reruns its forward
               (torch.utils.checkpoint, non-reentrant)
    compress8  what each layer saves is kept as 8-bit groups (glm5_ops.compress)
    full       both: the layer inputs kept for recomputation, 8-bit

The layer keeps its class and parameter names (its forward is replaced on
the instance, no wrapper module), so checkpoints and FSDP2 units are as
without a policy. Parameters are never compressed: FSDP2's gathered
weights are nn.Parameters, which compressed_activations leaves alone.
training/memory_policy.py is the per-layer policy of the byte-level LM.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from glm5_ops.compress import compressed_activations

POLICIES = ("none", "recompute", "compress8", "full")


def apply_activation_policy(model: nn.Module, policy: str) -> nn.Module:
    """Applies `policy` to every decoder layer of `model` (a GLM5ForCausalLM or a pipeline stage), in place."""
    if policy not in POLICIES:
        raise ValueError(f"memory policy must be one of {POLICIES}, got {policy!r}")
    if policy == "none":
        return model
    recompute, bits = policy in ("recompute", "full"), (8 if policy in ("compress8", "full") else None)
    layers = model.model.layers
    for layer in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        layer.forward = _policy_forward(layer.forward, recompute, bits)
    return model


def _policy_forward(inner, recompute: bool, bits: int | None):
    def forward(*args):
        saving = compressed_activations(bits) if bits and torch.is_grad_enabled() else contextlib.nullcontext()
        with saving:
            if recompute and torch.is_grad_enabled():
                return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False)
            return inner(*args)
    return forward
