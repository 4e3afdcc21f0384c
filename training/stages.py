"""Staged training specs (`glm5-lab train --stages stages.toml`): parsing,
validation with errors that name the stage and the field, and the data each
stage reads. The runner is training/stage_runner.py.

    [lora]                      # optional: the adapters a `train = "lora"` stage trains
    r = 8
    lora_alpha = 16
    target_modules = ["q_a_proj", "kv_a_proj_with_mqa"]
    target_parameters = ["mlp.gate.weight"]   # the MoE routers

    [[stage]]
    name = "general"
    data = "stdlib"             # the standard library's .py sources ...
    exclude = ["email"]         # ... without these packages (held out for a later stage)
    steps = 200
    lr = 1e-3

    [[stage]]
    name = "domain"
    data = "stdlib:email"       # one package of the standard library
    train = "lora"              # only the [lora] adapters train; "all": every parameter
    steps = 60

    [[stage]]
    name = "reward"
    kind = "parse"              # policy-gradient steps rewarding completions that ast.parse accepts
    data = "stdlib:email"       # where the prompts come from
    steps = 20
    lr = 1e-4

Fields per stage (defaults in STAGE_DEFAULTS): name, kind ("lm" | "parse"),
data ("stdlib", "stdlib:PKG" or a file/directory), exclude, steps, seq,
batch, lr, train ("all" | "lora"), attn ("dense" | "dsa"); a parse stage also
has samples (completions per step), completion (their longest length in
bytes) and prompt (bytes of context before each). The last 5% of each
stage's data is its held-out set.
"""
from __future__ import annotations

import os
import sysconfig
import tomllib

import torch

from training.train import stdlib_py_files

# Directories a stage never reads: installed packages, caches, and the stdlib's own test suites.
STAGE_SKIP_DIRS = ("site-packages", "__pycache__", "test", "tests")
STAGE_DEFAULTS = dict(kind="lm", exclude=[], steps=20, seq=128, batch=8, lr=1e-3, train="all", attn="dsa",
                      samples=16, completion=48, prompt=64)
KINDS, TRAINS, ATTNS = ("lm", "parse"), ("all", "lora"), ("dense", "dsa")
LORA_FIELDS = {"r", "lora_alpha", "target_modules", "target_parameters", "modules_to_save"}
_INTS, _POSITIVE = ("steps", "seq", "batch", "samples", "completion", "prompt"), ("lr",)


class StageSpecError(ValueError):
    """A bad stage spec; the message names the stage and the field."""


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise StageSpecError(f"{where}: {msg}")


def parse_stages(text: str, source: str = "stages") -> dict:
    """The spec as {"lora": dict | None, "stages": [dict, ...]} with defaults filled in."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise StageSpecError(f"{source}: not valid TOML ({e})") from None
    unknown = set(raw) - {"stage", "lora"}
    _check(not unknown, source, f"unknown table(s) {sorted(unknown)} (expected [[stage]] and [lora])")
    stages = raw.get("stage")
    _check(isinstance(stages, list) and len(stages) > 0, source, "needs at least one [[stage]] table")
    lora = raw.get("lora")
    if lora is not None:
        bad = set(lora) - LORA_FIELDS
        _check(not bad, f"{source} [lora]", f"unknown field(s) {sorted(bad)} (allowed: {sorted(LORA_FIELDS)})")
    out, names = [], set()
    for i, stage in enumerate(stages):
        where = f"{source} stage {i}" + (f" ({stage.get('name')!r})" if isinstance(stage.get("name"), str) else "")
        bad = set(stage) - set(STAGE_DEFAULTS) - {"name", "data"}
        _check(not bad, where, f"unknown field(s) {sorted(bad)} (allowed: name, data, {', '.join(STAGE_DEFAULTS)})")
        s = dict(STAGE_DEFAULTS, **stage)
        _check(isinstance(s.get("name"), str) and s["name"] != "", where, "name must be a non-empty string")
        _check(s["name"] not in names, where, f"name {s['name']!r} is used by an earlier stage")
        names.add(s["name"])
        _check(isinstance(s.get("data"), str) and s["data"] != "", where,
               "data must be 'stdlib', 'stdlib:PACKAGE' or a path")
        for key in _INTS:
            v = s[key]
            _check(isinstance(v, int) and not isinstance(v, bool) and v > 0, where,
                   f"{key} must be a positive integer, got {v!r}")
        _check(isinstance(s["lr"], (int, float)) and not isinstance(s["lr"], bool) and s["lr"] > 0, where,
               f"lr must be a positive number, got {s['lr']!r}")
        _check(s["kind"] in KINDS, where, f"kind must be one of {KINDS}, got {s['kind']!r}")
        _check(s["train"] in TRAINS, where, f"train must be one of {TRAINS}, got {s['train']!r}")
        _check(s["attn"] in ATTNS, where, f"attn must be one of {ATTNS}, got {s['attn']!r}")
        _check(isinstance(s["exclude"], list) and all(isinstance(p, str) and p for p in s["exclude"]), where,
               f"exclude must be a list of package names, got {s['exclude']!r}")
        _check(not s["exclude"] or s["data"] == "stdlib", where, "exclude applies to data = 'stdlib' only")
        _check(s["train"] != "lora" or lora is not None, where, "train = 'lora' needs a [lora] table")
        out.append(s)
    return dict(lora=lora, stages=out)


def load_stages(path: str) -> dict:
    if not os.path.isfile(path):
        raise StageSpecError(f"--stages: {path!r} is not a file")
    with open(path) as f:
        return parse_stages(f.read(), path)


# -- data --------------------------------------------------------------------------

def stage_data(spec: str, exclude=(), max_bytes: int = 8 << 20) -> torch.Tensor:
    """The bytes a stage reads (uint8 [N]): 'stdlib' (without `exclude`), 'stdlib:PKG' or a path."""
    if spec == "stdlib" or spec.startswith("stdlib:"):
        package = spec.split(":", 1)[1] if ":" in spec else None
        if package is not None and not os.path.isdir(os.path.join(sysconfig.get_paths()["stdlib"], package)):
            raise StageSpecError(f"data: {spec!r}: the standard library has no package {package!r}")
        paths = stdlib_py_files(package, set(exclude), skip_dirs=STAGE_SKIP_DIRS)
    elif os.path.isfile(spec):
        paths = [spec]
    elif os.path.isdir(spec):
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs)
    else:
        raise StageSpecError(f"data: {spec!r} is neither 'stdlib', 'stdlib:PACKAGE' nor an existing path")
    data = bytearray()
    for p in paths:
        with open(p, "rb") as f:
            data += f.read(max_bytes - len(data)) + b"\n"
        if len(data) >= max_bytes:
            break
    if len(data) < 4096:
        raise StageSpecError(f"data: {spec!r} holds {len(data)} bytes; at least 4096 are needed")
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).clone()


def split_held_out(data: torch.Tensor, fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(data.numel() * (1 - fraction))
    return data[:cut], data[cut:]
