"""INT8 quantisation of a GLM-5 model, in place (the shape of torchao's quantize_).

    from models.glm5 import quantize
    quantize(model, mode="int8_weight_only")        # or "w8a8"; skip=None keeps DEFAULT_SKIP
    quantize(model, mode="w8a8", skip=())           # everything, the key layers too
    save_quantized(model, "ckpt/")  ...  GLM5ForCausalLM.from_pretrained("ckpt/")

What gets int8 (per output channel, symmetric; glm5_ops/int8.py):
- every nn.Linear (attention projections, the indexer's wq_b/wk, dense MLPs,
  shared experts, MTP's eh_proj) -> Int8Linear
- the routed experts (gate_up_proj, down_proj, one scale per output row) -> Int8Experts
- when not skipped: the embedding -> Int8Embedding (one scale per token row) and the
  router's weight, which moe_route reads as a float matrix: it is rounded
  through int8 and kept in fp32 (the numerics of int8 storage, none of the bytes).

DEFAULT_SKIP keeps in their original precision (docs/INT8.md has the measurement):
- `lm_head`, `model.embed_tokens`: the vocabulary's rows; an error there moves
  every logit (the torchao and HF recipes leave them alone too);
- `*.mlp.gate` (the router): which experts run is a discrete choice; a small
  error flips it, and the router is 0.05% of the weights;
- `*.indexer.weights_proj`: the indexer's head weights decide which keys DSA
  keeps (HF's FP8 DeepSeek-V3.2 recipe keeps the router and this unquantised);
Norms are never quantised (they are not matrices).

Modes: "int8_weight_only" (int8 weights, float activations: decode reads a
quarter of fp32's bytes); "w8a8" (activations quantised per token at run time;
calls with at most W8A8_MIN_ROWS rows, i.e. decode, run weight-only, where
reading the weights is the cost and int8 activations would only add error).
"""
from __future__ import annotations

import fnmatch
import json
import os

import torch
from torch import nn

import glm5_ops
from glm5_ops.int8 import W8A8_MIN_ROWS, pack_rows, packed_experts_pay, unpack_rows
from glm5_ops.memory import on_huge_pages, weights_on_huge_pages

from .moe import Experts, Router

MODES = ("int8_weight_only", "w8a8")
DEFAULT_SKIP = ("lm_head", "model.embed_tokens", "*.mlp.gate", "*.indexer.weights_proj")
QUANT_FILE = "quantization.json"


class Int8Linear(nn.Module):
    """nn.Linear with an int8 weight [N,K] and fp32 scales [N]; output in the input's dtype."""

    def __init__(self, qweight, scale, bias, mode: str, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.mode, self.dtype = mode, dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str) -> "Int8Linear":
        q, s = _quantize(linear.weight)
        return cls(q, s, linear.bias, mode, linear.weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, for code that reads the matrix (a fresh tensor each time)."""
        return glm5_ops.reference.int8_dequantize_rows(self.qweight, self.scale, self.dtype)

    def forward(self, x):
        if self.mode == "w8a8" and x.numel() > W8A8_MIN_ROWS * x.shape[-1]:
            return glm5_ops.w8a8_linear(x, self.qweight, self.scale, self.bias)
        return glm5_ops.int8_linear(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


class Int8Embedding(nn.Module):
    """nn.Embedding with int8 rows and one fp32 scale per row."""

    def __init__(self, qweight, scale, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.dtype = dtype

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> "Int8Embedding":
        return cls(*_quantize(emb.weight), emb.weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return glm5_ops.reference.int8_dequantize_rows(self.qweight, self.scale, self.dtype)

    def forward(self, ids):
        return (self.qweight[ids].float() * self.scale[ids][..., None]).to(self.dtype)


class Int8Experts(nn.Module):
    """The routed experts with int8 weights: gate_up [E,2I,D] + scales [E,2I], down [E,D,I] + [E,D].

    Where the CPU decode kernel reads them fastest (glm5_ops.int8.packed_experts_pay),
    gate_up_q and down_q are kept in pack_rows's row layout: `packed` says which. The
    layout follows the device (.to() re-decides it); state_dict() and checkpoints always
    hold plain rows, and load_state_dict takes plain rows."""

    _PACKED = ("gate_up_q", "down_q")

    def __init__(self, gate_up, gate_up_scale, down, down_scale, mode: str, dtype: torch.dtype):
        super().__init__()
        for name, t in (("gate_up_q", gate_up), ("gate_up_scale", gate_up_scale), ("down_q", down),
                        ("down_scale", down_scale)):
            self.register_buffer(name, t)
        self.mode, self.dtype = mode, dtype
        self.packed = False
        self.place()

    def place(self) -> None:
        """Packs or unpacks the weights as their device's decode kernel prefers."""
        E, I2, D = self.gate_up_q.shape
        want = not self.gate_up_q.is_meta and packed_experts_pay(self.gate_up_q.device, D, I2 // 2)
        if want != self.packed:
            layout = pack_rows if want else unpack_rows
            for name in self._PACKED:   # new tensors: onto huge pages again (decode streams them)
                setattr(self, name, on_huge_pages(layout(getattr(self, name))))
            self.packed = want

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.place()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed:
            for name in self._PACKED:
                destination[prefix + name] = unpack_rows(destination[prefix + name])

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if self.packed:   # the incoming plain rows, in this module's layout (load_state_dict copies the dict)
            for name in self._PACKED:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = pack_rows(state_dict[prefix + name])
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.place()   # assign=True may have brought plain tensors onto a device that packs

    def _plain(self, name):
        t = getattr(self, name)
        return unpack_rows(t) if self.packed else t

    @classmethod
    def from_experts(cls, experts: Experts, mode: str) -> "Int8Experts":
        return cls(*_quantize(experts.gate_up_proj), *_quantize(experts.down_proj), mode, experts.gate_up_proj.dtype)

    # The unfused MoE path (fused=False) reads the matrices: dequantised copies.
    @property
    def gate_up_proj(self):
        return glm5_ops.reference.int8_dequantize_rows(self._plain("gate_up_q"), self.gate_up_scale, self.dtype)

    @property
    def down_proj(self):
        return glm5_ops.reference.int8_dequantize_rows(self._plain("down_q"), self.down_scale, self.dtype)

    def forward(self, h, weights, ids):
        return glm5_ops.fused_moe_int8(h, self.gate_up_q, self.gate_up_scale, self.down_q, self.down_scale,
                                       weights, ids, w8a8=self.mode == "w8a8", packed=self.packed)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, packed={self.packed}"


def _quantize(w: torch.Tensor):
    """(q, scale) of a weight; on the meta device (load_quantized builds the skeleton) empty tensors."""
    if w.is_meta:
        return torch.empty(w.shape, dtype=torch.int8, device="meta"), torch.empty(w.shape[:-1], device="meta")
    return glm5_ops.quantize_int8(w.detach())


def _patterns(skip) -> tuple[str, ...]:
    if skip is None:
        return DEFAULT_SKIP
    if isinstance(skip, str):
        return (skip,)
    try:
        patterns = tuple(skip)
    except TypeError:
        raise TypeError(f"skip must be None, a name or pattern, or a sequence of them, got {type(skip).__name__}") \
            from None
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip must hold module names or fnmatch patterns (str), got {bad!r}")
    return patterns


def skipped(name: str, patterns) -> bool:
    """Whether module `name` (as in named_modules) matches a name or pattern of `patterns`."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@torch.no_grad()
def quantize(model: nn.Module, mode: str = "int8_weight_only", skip=None) -> nn.Module:
    """Quantises `model` in place and returns it. mode: "int8_weight_only" or "w8a8";
    skip: None (DEFAULT_SKIP), a module name / fnmatch pattern, or a sequence of them
    (() quantises everything). model.quantization records what was done."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    patterns = _patterns(skip)
    done = []
    for name, module in list(model.named_modules()):
        if not name or skipped(name, patterns):
            continue
        if isinstance(module, nn.Linear):
            new = Int8Linear.from_linear(module, mode)
        elif isinstance(module, Experts):
            new = Int8Experts.from_experts(module, mode)
        elif isinstance(module, nn.Embedding):
            new = Int8Embedding.from_embedding(module)
        elif isinstance(module, Router):
            if not module.weight.is_meta:
                module.weight.copy_(glm5_ops.reference.int8_dequantize_rows(*_quantize(module.weight),
                                                                            module.weight.dtype))
            done.append(name)
            continue
        else:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
        done.append(name)
    model.quantization = {"mode": mode, "skip": list(patterns), "quantized": done}
    weights_on_huge_pages(model)   # the new int8 weights: decode streams them (glm5_ops/memory.py)
    return model


def ensure_quantized(model: nn.Module, mode) -> str | None:
    """What the CLI and the serving engine call: quantises model in place with
    DEFAULT_SKIP when `mode` is given and the model is still float; returns the
    model's mode afterwards (None: float). A model already quantised (say, loaded
    from save_quantized's checkpoint) keeps its int8 weights: the same mode is a
    no-op, another one an error (its float weights are gone)."""
    have = (getattr(model, "quantization", None) or {}).get("mode")
    if mode is None:
        return have
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"quantization must be None or one of {MODES}, got {mode!r}")
    if have is not None and have != mode:
        raise ValueError(f"quantization={mode!r}: the model is already quantised as {have!r} (its float weights "
                         "are gone); build it again from float weights")
    if have is None:
        quantize(model, mode)
    return mode


def quantize_model(model: nn.Module, mode: str = "int8_weight_only", skip=None) -> nn.Module:
    """The same as quantize (the name the lab's issue used)."""
    return quantize(model, mode, skip)


def _plain_tensors(t: torch.Tensor):
    """t itself, or for a wrapper tensor subclass (torchao's Int8Tensor: its own
    storage is a placeholder) the plain tensors it holds."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        for name in t.__tensor_flatten__()[0]:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


def weight_bytes(model: nn.Module) -> dict:
    """Bytes of parameters and buffers, each storage once: total, in int8 modules
    (int8 weights + their scales) and the rest. Tensor subclasses count the plain
    tensors they hold."""
    seen, total, quant = set(), 0, 0
    for mod_name, mod in model.named_modules():
        is_q = isinstance(mod, (Int8Linear, Int8Embedding, Int8Experts))
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            for p in _plain_tensors(t):
                key = p.untyped_storage().data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                total += p.untyped_storage().nbytes()
                quant += p.untyped_storage().nbytes() if is_q else 0
    return {"total": total, "int8_modules": quant, "other": total - quant}


def save_quantized(model: nn.Module, path: str) -> None:
    """config.json + quantization.json + model.safetensors (int8 weights and fp32 scales as stored)."""
    from safetensors.torch import save_file
    info = getattr(model, "quantization", None)
    if info is None:
        raise ValueError("model must be quantised first (models.glm5.quantize), it has no .quantization")
    os.makedirs(path, exist_ok=True)
    model.config.to_json(os.path.join(path, "config.json"))
    with open(os.path.join(path, QUANT_FILE), "w") as f:
        json.dump({"mode": info["mode"], "skip": info["skip"]}, f, indent=1)
    state, seen = {}, {}
    for k, v in model.state_dict().items():   # tied tensors: safetensors stores each storage once
        ptr = v.untyped_storage().data_ptr()
        state[k] = v.detach().clone().contiguous() if ptr in seen else v.detach().contiguous()
        seen[ptr] = k
    save_file(state, os.path.join(path, "model.safetensors"))


def load_quantized(cls, path: str, *, device="cpu", **model_kwargs):
    """The model save_quantized wrote: built on the meta device, quantised as
    recorded (empty int8 buffers), then the stored tensors assigned."""
    from safetensors.torch import load_file
    from .config import GLM5Config
    with open(os.path.join(path, QUANT_FILE)) as f:
        info = json.load(f)
    config = GLM5Config.from_json(path)
    with torch.device("meta"):
        model = cls(config, **model_kwargs)
    quantize(model, info["mode"], info["skip"])
    state = load_file(os.path.join(path, "model.safetensors"), device=str(device))
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    weights_on_huge_pages(model)   # decode streams them: glm5_ops/memory.py says why
    return model.eval()
