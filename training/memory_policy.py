"""The activation-memory policy: per layer, what autograd's saved tensors are
compressed to (8/4/2-bit groups via glm5_ops.compress, or kept), and which cheap
subgraphs are recomputed in backward instead of saved (torch.utils.checkpoint
on the norms and on the SwiGLU activation: elementwise work, no matmul).

Applied from outside the model (torchtitan style): apply_memory_policy wraps
submodules; the model code does not know about it.

    policy = MemoryPolicy.preset("full", n_layers=4)         # or MemoryPolicy.parse(...)
    apply_memory_policy(model, policy, meter=meter)

Presets: none | compress8 | compress4 | compress2 (every block, the embedding
and the head compressed; compress2s etc.: with stochastic rounding) | recompute (norms + activations recomputed, nothing
compressed) | full (8-bit compression and recomputation everywhere). Spec strings give a
per-layer policy: "0-1:c8+norm+act,2-3:c4" (layers not named: no policy),
"head:c8" compresses the embedding and head too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from glm5_ops.compress import SavedTensorMeter, compressed_activations

RECOMPUTABLE = ("norm", "act")   # RMSNorms; the SwiGLU activation (silu(gate) * up)


@dataclass
class LayerPolicy:
    bits: int | None = None                        # compress saved tensors to this many bits; None keeps them
    recompute: tuple[str, ...] = ()                # subset of RECOMPUTABLE
    stochastic: bool = False                       # stochastic rounding (unbiased) instead of nearest

    def __post_init__(self):
        if self.bits not in (None, 8, 4, 2):
            raise ValueError(f"bits must be None, 8, 4 or 2, got {self.bits!r}")
        bad = set(self.recompute) - set(RECOMPUTABLE)
        if bad:
            raise ValueError(f"recompute must name parts of {RECOMPUTABLE}, got {sorted(bad)}")


@dataclass
class MemoryPolicy:
    layers: list[LayerPolicy]
    head: LayerPolicy = field(default_factory=LayerPolicy)   # embedding + final norm + lm head + loss
    group_size: int = 128
    min_numel: int = 4096

    @classmethod
    def preset(cls, name: str, n_layers: int, group_size: int = 128) -> "MemoryPolicy":
        m = re.fullmatch(r"compress([842])(s?)", name)
        if name == "none":
            layer = LayerPolicy()
        elif m:
            layer = LayerPolicy(bits=int(m.group(1)), stochastic=bool(m.group(2)))
        elif name == "recompute":
            layer = LayerPolicy(recompute=RECOMPUTABLE)
        elif name == "full":
            layer = LayerPolicy(bits=8, recompute=RECOMPUTABLE)
        else:
            raise ValueError(f"unknown policy {name!r}: none, compress8|4|2 (suffix s: stochastic rounding), "
                             "recompute, full")
        return cls([LayerPolicy(layer.bits, layer.recompute, layer.stochastic) for _ in range(n_layers)],
                   head=LayerPolicy(layer.bits, ("norm",) if layer.recompute else (), layer.stochastic),
                   group_size=group_size)

    @classmethod
    def parse(cls, spec: str, n_layers: int, group_size: int = 128) -> "MemoryPolicy":
        """A preset name, or comma-separated "LAYERS:PARTS" items, LAYERS = i | i-j | head,
        PARTS = '+'-joined c8|c4|c2 (c2s: stochastic rounding)|norm|act, e.g.
        "0-1:c8+norm+act,2-3:c4,head:c8"."""
        if ":" not in spec:
            return cls.preset(spec, n_layers, group_size)
        policy = cls([LayerPolicy() for _ in range(n_layers)], group_size=group_size)
        for item in spec.split(","):
            where, _, parts = item.partition(":")
            bits, rec, sto = None, [], False
            for p in parts.split("+"):
                if re.fullmatch(r"c[842]s?", p):
                    bits, sto = int(p[1]), p.endswith("s")
                elif p in RECOMPUTABLE:
                    rec.append(p)
                else:
                    raise ValueError(f"policy part {p!r} in {item!r}: expected c8, c4, c2, norm or act")
            lp = LayerPolicy(bits, tuple(rec), sto)
            if where == "head":
                policy.head = lp
                continue
            lo, _, hi = where.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                if not 0 <= i < n_layers:
                    raise ValueError(f"layer {i} in {item!r} out of range (n_layers={n_layers})")
                policy.layers[i] = lp
        return policy

    def describe(self) -> str:
        def one(lp):
            parts = ([f"c{lp.bits}" + "s" * lp.stochastic] if lp.bits else []) + list(lp.recompute)
            return "+".join(parts) or "-"
        return ", ".join(f"{i}:{one(lp)}" for i, lp in enumerate(self.layers)) + f", head:{one(self.head)}"


class Recompute(nn.Module):
    """Runs `inner` without saving its intermediates; backward recomputes them
    from its inputs (which an enclosing compressed_activations compresses)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=False)


class Compressed(nn.Module):
    """Runs `inner` inside compressed_activations: what it saves for backward is
    kept as `bits`-bit groups (parameters of `params` excepted)."""

    def __init__(self, inner: nn.Module, bits: int, group_size: int, min_numel: int, params: nn.Module,
                 meter: SavedTensorMeter | None, stochastic: bool = False):
        super().__init__()
        self.inner = inner
        self.bits, self.group_size, self.min_numel, self.meter = bits, group_size, min_numel, meter
        self.stochastic = stochastic
        self._params = [params]   # a list, so the model is not registered as a submodule

    def forward(self, *args):
        with compressed_activations(self.bits, self.group_size, min_numel=self.min_numel,
                                    params=self._params[0], meter=self.meter, stochastic=self.stochastic):
            return self.inner(*args)


def apply_memory_policy(model: nn.Module, policy: MemoryPolicy, meter: SavedTensorMeter | None = None):
    """Wraps model.blocks[i] (and model.embed / model.head) per the policy, in place.
    The model must expose .blocks[i].norm1/.norm2/.mlp.act, .embed and .head
    (training/byte_lm.py does)."""
    if len(policy.layers) != len(model.blocks):
        raise ValueError(f"policy has {len(policy.layers)} layers, the model {len(model.blocks)}")

    def compress(module, lp):
        if lp.bits is None:
            return module
        return Compressed(module, lp.bits, policy.group_size, policy.min_numel, model, meter, lp.stochastic)

    for i, lp in enumerate(policy.layers):
        block = model.blocks[i]
        if "norm" in lp.recompute:
            block.norm1, block.norm2 = Recompute(block.norm1), Recompute(block.norm2)
        if "act" in lp.recompute:
            block.mlp.act = Recompute(block.mlp.act)
        model.blocks[i] = compress(block, lp)
    if "norm" in policy.head.recompute:
        model.head.norm = Recompute(model.head.norm)
    model.embed, model.head = compress(model.embed, policy.head), compress(model.head, policy.head)
    return model
