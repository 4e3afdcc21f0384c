"""LoRA for GLM-5, with peft's field names, as a low-rank delta on the weight
itself (torch.nn.utils.parametrize): W_eff = W + (lora_alpha / r) * B @ A.

    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_a_proj", "o_proj"], target_parameters=["mlp.gate.weight"])
    apply_lora(model, cfg)          # before parallelize(); freezes everything else
    merge(model); unmerge(model)    # fold the delta into W and take it back out

Why a delta on the weight and not peft's extra branch on the input: the
places that matter read weights directly instead of calling a module. The
MoE router hands `gate.weight` to glm5_ops.moe_route (so an adapter there
changes which experts are chosen), MLA's absorbed form multiplies by
kv_b_proj's weight (W_UK, W_UV), and the fused routed experts are [E, out,
in] tensors (peft's `target_parameters`: one A, B pair per expert). The cost
is one [out, in] delta per forward, small next to the activations at these
sizes. B starts at zero, so a fresh adapter adds exact zeros: the logits are
bit-identical to the base model's.

Limits (refused with a ValueError): lora_dropout must be 0 (a delta on the
weight has no per-input dropout); with tp > 1 the tensor-parallel linears
(q_b_proj, kv_b_proj, o_proj, the MLP and shared-expert projections) cannot
carry adapters (ColwiseParallel would shard A like the weight); with ep > 1
the routed experts cannot (expert parallelism replaces those parameters).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

# Modules training/parallelize.apply_tp shards: no adapters on them when tp > 1.
TP_SHARDED = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROUTER = "mlp.gate.weight"
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass
class LoraConfig:
    """peft's LoraConfig fields. target_modules: nn.Linear names matched as
    peft does (the whole name or its last dotted parts); target_parameters:
    parameter names matched the same way (the router's weight, the fused
    experts); modules_to_save: modules trained in full alongside the adapters."""
    r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"])
    target_parameters: list[str] = field(default_factory=list)
    modules_to_save: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"r must be a positive int, got {self.r!r}")
        if not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be a positive number, got {self.lora_alpha!r}")
        if self.lora_dropout != 0:
            raise ValueError(f"lora_dropout must be 0, got {self.lora_dropout!r}: the adapter is a delta on the "
                             "weight, which has no per-input dropout")
        for name in ("target_modules", "target_parameters", "modules_to_save"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(s, str) and s for s in v):
                raise TypeError(f"{name} must be a list of non-empty names, got {v!r}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r


def _matches(name: str, patterns) -> bool:
    return any(name == p or name.endswith("." + p) for p in patterns)


class LoraDelta(nn.Module):
    """The parametrization W -> W + scaling * B @ A (batched over experts for a 3-D W)."""

    def __init__(self, weight: torch.Tensor, r: int, scaling: float):
        super().__init__()
        *lead, out_f, in_f = weight.shape
        self.scaling, self.merged = scaling, False
        self.lora_A = nn.Parameter(torch.empty(*lead, r, in_f, dtype=torch.float32, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(*lead, out_f, r, dtype=torch.float32, device=weight.device))
        for a in self.lora_A.view(-1, r, in_f):
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))   # peft's default for A; B = 0

    def delta(self) -> torch.Tensor:
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return weight
        return weight + self.delta().to(weight.dtype)


def apply_lora(model: nn.Module, config: LoraConfig, *, tp: int = 1, ep: int = 1) -> list[str]:
    """Adds adapters in place, freezes every parameter but the adapters and
    modules_to_save; returns the adapted parameters' names. Call before parallelize."""
    targets = []
    for mname, module in model.named_modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            full = f"{mname}.{pname}" if mname else pname
            on_linear = isinstance(module, nn.Linear) and pname == "weight" and _matches(mname, config.target_modules)
            if on_linear or _matches(full, config.target_parameters):
                if tp > 1 and isinstance(module, nn.Linear) and mname.rsplit(".", 1)[-1] in TP_SHARDED:
                    raise ValueError(f"target_modules: {mname} is sharded by tensor parallelism (tp={tp}); "
                                     f"adapters go on {TP_SHARDED} only with tp=1")
                if ep > 1 and _matches(full, EXPERTS):
                    raise ValueError(f"target_parameters: {full} is split by expert parallelism (ep={ep}); "
                                     "adapters on the routed experts need ep=1")
                targets.append((module, pname, full, p))
    if not targets:
        raise ValueError(f"no parameter matches target_modules={config.target_modules} or "
                         f"target_parameters={config.target_parameters}")
    for p in model.parameters():
        p.requires_grad_(False)
    for mname, module in model.named_modules():
        if _matches(mname, config.modules_to_save):
            for p in module.parameters():
                p.requires_grad_(True)
    for module, pname, _full, p in targets:
        parametrize.register_parametrization(module, pname, LoraDelta(p.detach(), config.r, config.scaling))
    model.lora_config = config
    return [t[2] for t in targets]


def deltas(model: nn.Module):
    """(module, parameter name, LoraDelta) for every adapter in the model."""
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for pname, plist in module.parametrizations.items():
                for p in plist:
                    if isinstance(p, LoraDelta):
                        yield module, pname, p


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Folds every adapter into its weight (W += scaling * B @ A): the forward then skips the delta."""
    for module, pname, d in deltas(model):
        if not d.merged:
            original = module.parametrizations[pname].original
            original.add_(d.delta().to(original.dtype))
            d.merged = True


@torch.no_grad()
def unmerge(model: nn.Module) -> None:
    """Takes every merged adapter back out of its weight."""
    for module, pname, d in deltas(model):
        if d.merged:
            original = module.parametrizations[pname].original
            original.sub_(d.delta().to(original.dtype))
            d.merged = False


def trainable_fraction(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), counted as whole tensors (unsharded shapes)."""
    def n(p):
        return math.prod(p.shape)
    params = list(model.parameters())
    return sum(n(p) for p in params if p.requires_grad), sum(n(p) for p in params)


# -- whole-model tensors (gathered by Trainer.full_parameters) ----------------------

_ORIG, _A, _B = ".original", ".0.lora_A", ".0.lora_B"


def _split(name: str):
    """'x.parametrizations.weight.original' -> ('x', 'weight'); None for other names."""
    if ".parametrizations." not in name:
        return None
    prefix, rest = name.split(".parametrizations.", 1)
    return prefix, rest.split(".", 1)[0]


def merged_tensors(tensors: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """The base model's names and merged weights from whole tensors of an adapted model."""
    out = {}
    for name, t in tensors.items():
        split = _split(name)
        if split is None:
            out[name] = t
        elif name.endswith(_ORIG):
            prefix, pname = split
            base = f"{prefix}.parametrizations.{pname}"
            out[f"{prefix}.{pname}"] = t + config.scaling * (tensors[base + _B] @ tensors[base + _A]).to(t.dtype)
    return out


def save_adapter(path: str, tensors: dict[str, torch.Tensor], config: LoraConfig) -> None:
    """peft's layout: adapter_config.json and adapter_model.safetensors with
    keys base_model.model.<module>.lora_A.weight (<module>.<param> for target_parameters)."""
    from safetensors.torch import save_file
    out = {}
    for name, t in tensors.items():
        split = _split(name)
        if split and name.endswith((_A, _B)):
            prefix, pname = split
            where = prefix if pname == "weight" else f"{prefix}.{pname}"
            out[f"base_model.model.{where}.lora_{'A' if name.endswith(_A) else 'B'}.weight"] = t.contiguous()
        elif _matches(name.rsplit(".", 1)[0], config.modules_to_save):
            out[f"base_model.model.{name}"] = t.contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", task_type="CAUSAL_LM", bias="none", **asdict(config)), f, indent=2)
