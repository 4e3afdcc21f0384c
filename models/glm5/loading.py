"""GLM5ForCausalLM.from_pretrained: HF-format directories (config.json +
model.safetensors, or shards listed in model.safetensors.index.json).

Checkpoints store routed experts one by one
(`mlp.experts.{j}.{gate,up,down}_proj.weight`, as GLM-5's release and
transformers' save_pretrained write them) or already stacked
(`mlp.experts.gate_up_proj` [E,2I,D], `mlp.experts.down_proj` [E,D,I]); both
load into the stacked layout the fused kernels read. The MTP layers follow
the decoder as `model.layers.{L+j}` (transformers drops them when it loads
and never writes them): present, they load into `model.mtp.{j}`; absent, the
model is built without MTP (num_nextn_predict_layers=0) and says so.
Missing or unexpected tensors and shape mismatches raise one error listing them.
"""
from __future__ import annotations

import json
import os
import re

import torch

from .config import GLM5Config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")   # the main model's, repeated


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(f"{path}: shards listed in the index are missing: {missing}")
    return [os.path.join(path, f) for f in files]


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors = {}
    for file in _shard_files(path):
        tensors.update(load_file(file))
    return tensors


def _stack_experts(tensors: dict) -> dict:
    """Per-expert weights -> [E,2I,D] gate_up and [E,D,I] down, per layer."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, experts in groups.items():
        E = max(experts) + 1
        absent = [j for j in range(E) if set(experts.get(j, {})) != {"gate_proj", "up_proj", "down_proj"}]
        if absent:
            raise ValueError(f"checkpoint: {prefix} lacks gate/up/down weights for experts {absent[:8]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[j]["gate_proj"], experts[j]["up_proj"]], dim=0) for j in range(E)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[j]["down_proj"] for j in range(E)])
    return out


def _rename_mtp(tensors: dict, num_layers: int) -> tuple[dict, int]:
    """model.layers.{L+j}.X -> model.mtp.{j}.X (decoder parts under .layer)."""
    out, depth = {}, 0
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
    for name, t in tensors.items():
        m = pattern.match(name)
        if not m or int(m.group(1)) < num_layers:
            out[name] = t
            continue
        j, rest = int(m.group(1)) - num_layers, m.group(2)
        depth = max(depth, j + 1)
        if rest in _MTP_DUPLICATES:
            continue
        head = rest.split(".")[0]
        if head not in ("enorm", "hnorm", "eh_proj", "shared_head"):
            rest = "layer." + rest
        out[f"model.mtp.{j}.{rest}"] = t
    return out, depth


def _mismatch_report(model, tensors: dict) -> list[str]:
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:10]}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:10]}")
    for name in sorted(set(expected) & set(tensors)):
        if tuple(expected[name].shape) != tuple(tensors[name].shape):
            problems.append(f"shape mismatch for {name}: model expects {tuple(expected[name].shape)}, "
                            f"checkpoint has {tuple(tensors[name].shape)}")
    return problems


def load_pretrained(cls, path: str, *, dtype=None, device="cpu", verbose: bool = True, **model_kwargs):
    """Builds `cls` from the directory's config.json and loads its tensors.
    dtype: None keeps the checkpoint's (router weight and bias stay fp32, as in transformers)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected config.json + safetensors)")
    config = GLM5Config.from_json(path)
    tensors = _stack_experts(read_checkpoint(path))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors, depth = _rename_mtp(tensors, config.num_hidden_layers)
    if depth != config.num_nextn_predict_layers:
        if verbose and depth == 0:
            print(f"[glm5] {path}: no MTP layer in the checkpoint (transformers does not save one); "
                  "building the model without MTP")
        config = config.replace(num_nextn_predict_layers=depth)
    with torch.device("meta"):
        model = cls(config, **model_kwargs)
    problems = _mismatch_report(model, tensors)
    if problems:
        raise ValueError(f"checkpoint {path} does not fit GLM5ForCausalLM({config.num_hidden_layers} layers):\n  "
                         + "\n  ".join(problems))
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if dtype is None:
        dtype = torch.bfloat16 if torch.bfloat16 in floating else torch.float16 if torch.float16 in floating \
            else torch.float32
    keep_fp32 = ("gate.weight", "e_score_correction_bias")
    state = {name: t.to(device=device, dtype=torch.float32 if name.endswith(keep_fp32) else dtype)
             for name, t in tensors.items()}
    if config.tie_word_embeddings:     # one tensor under both names
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
