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
from typing import NamedTuple

import torch

from glm5_ops.memory import weights_on_huge_pages

from .config import GLM5Config

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


class _Source(NamedTuple):
    file: str
    key: str
    shape: tuple
    dtype: str


def _index_checkpoint(path: str) -> dict[str, _Source]:
    """Every tensor's file, shape and dtype, read from the headers only."""
    from safetensors import safe_open
    sources = {}
    for file in _shard_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                sources[key] = _Source(file, key, tuple(sl.get_shape()), sl.get_dtype())
    return sources


# A target tensor is filled from one source (whole), or from several sources
# written into slices of it (per-expert weights into the stacked layout).
class _Piece(NamedTuple):
    source: _Source
    index: tuple          # where in the target: () = the whole tensor


def _plan(sources: dict, num_layers: int) -> tuple[dict[str, list[_Piece]], dict[str, tuple], int]:
    """(target name -> pieces, target name -> shape, MTP depth) in our module names."""
    pieces: dict[str, list[_Piece]] = {}
    shapes: dict[str, tuple] = {}
    experts: dict[str, dict[int, dict[str, _Source]]] = {}
    depth = 0
    for key, src in sources.items():
        name, mtp = _rename_mtp(key, num_layers)
        if name is None:
            continue
        depth = max(depth, mtp)
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = src
            continue
        pieces[name] = [_Piece(src, ())]
        shapes[name] = src.shape
    for prefix, group in experts.items():
        E = max(group) + 1
        absent = [j for j in range(E) if set(group.get(j, {})) != {"gate_proj", "up_proj", "down_proj"}]
        if absent:
            raise ValueError(f"checkpoint: {prefix} lacks gate/up/down weights for experts {absent[:8]}")
        I, D = group[0]["gate_proj"].shape
        pieces[f"{prefix}.gate_up_proj"] = [p for j in range(E) for p in (
            _Piece(group[j]["gate_proj"], (j, slice(0, I))), _Piece(group[j]["up_proj"], (j, slice(I, 2 * I))))]
        shapes[f"{prefix}.gate_up_proj"] = (E, 2 * I, D)
        pieces[f"{prefix}.down_proj"] = [_Piece(group[j]["down_proj"], (j,)) for j in range(E)]
        shapes[f"{prefix}.down_proj"] = (E, D, I)
    return pieces, shapes, depth


def _rename_mtp(key: str, num_layers: int) -> tuple[str | None, int]:
    """model.layers.{L+j}.X -> (model.mtp.{j}.X with decoder parts under .layer, j+1);
    the MTP layer's copies of the embedding and head -> (None, j+1); others unchanged."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", key)
    if not m or int(m.group(1)) < num_layers:
        return key, 0
    j, rest = int(m.group(1)) - num_layers, m.group(2)
    if rest in _MTP_DUPLICATES:
        return None, j + 1
    if rest.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "shared_head"):
        rest = "layer." + rest
    return f"model.mtp.{j}.{rest}", j + 1


def _mismatch_report(model, shapes: dict) -> list[str]:
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    problems = []
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:10]}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:10]}")
    for name in sorted(set(expected) & set(shapes)):
        if tuple(expected[name].shape) != tuple(shapes[name]):
            problems.append(f"shape mismatch for {name}: model expects {tuple(expected[name].shape)}, "
                            f"checkpoint has {tuple(shapes[name])}")
    return problems


_FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load_pretrained(cls, path: str, *, dtype=None, device="cpu", verbose: bool = True, **model_kwargs):
    """Builds `cls` from the directory's config.json and loads its tensors,
    one tensor at a time into preallocated parameters (peak memory: the model
    plus one tensor). dtype: None keeps the checkpoint's (router weight and
    bias stay fp32, as in transformers)."""
    from safetensors import safe_open
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected config.json + safetensors)")
    from .quantization import QUANT_FILE, load_quantized
    if os.path.exists(os.path.join(path, QUANT_FILE)):   # written by quantization.save_quantized
        return load_quantized(cls, path, device=device, **model_kwargs)
    config = GLM5Config.from_json(path)
    pieces, shapes, depth = _plan(_index_checkpoint(path), config.num_hidden_layers)
    if config.tie_word_embeddings:
        pieces.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)
    if depth != config.num_nextn_predict_layers:
        if verbose and depth == 0:
            print(f"[glm5] {path}: no MTP layer in the checkpoint (transformers does not save one); "
                  "building the model without MTP")
        config = config.replace(num_nextn_predict_layers=depth)
    with torch.device("meta"):
        model = cls(config, **model_kwargs)
    problems = _mismatch_report(model, shapes)
    if problems:
        raise ValueError(f"checkpoint {path} does not fit GLM5ForCausalLM({config.num_hidden_layers} layers):\n  "
                         + "\n  ".join(problems))
    if dtype is None:
        stored = {_FILE_DTYPES.get(p.source.dtype) for ps in pieces.values() for p in ps}
        dtype = next((d for d in (torch.bfloat16, torch.float16) if d in stored), torch.float32)
    keep_fp32 = ("gate.weight", "e_score_correction_bias")
    state = {}
    handles = {}
    try:
        for name, parts in pieces.items():
            target = torch.empty(shapes[name], device=device,
                                 dtype=torch.float32 if name.endswith(keep_fp32) else dtype)
            for piece in parts:
                f = handles.get(piece.source.file)
                if f is None:
                    f = handles[piece.source.file] = safe_open(piece.source.file, "pt")
                target[piece.index].copy_(f.get_tensor(piece.source.key))
            state[name] = target
    finally:
        handles.clear()
    if config.tie_word_embeddings:     # one tensor under both names
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    weights_on_huge_pages(model)   # decode streams them: glm5_ops/memory.py says why
    return model.eval()
