"""Staged training (training/stages.py, training/stage_runner.py) at tiny
sizes: general -> LoRA domain -> parse-reward stages run end to end, each
stage trains only its part, every stage's held-out loss and the parse rate
before/after are reported; a run cut short in the reward stage resumes from
its checkpoint to the uninterrupted run's parameters bit for bit; bad specs
are refused with the stage and field named (CLI: exit 2)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from models.glm5.config import preset
from profiling import cli
from training.parse_reward import line_parses, sample
from training.stage_runner import run_stages
from training.stages import StageSpecError, parse_stages

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SPEC = """
[lora]
r = 2
lora_alpha = 4
target_modules = ["q_a_proj"]
target_parameters = ["mlp.gate.weight"]

[[stage]]
name = "general"
data = "stdlib:json"
steps = 3
seq = 32
batch = 4

[[stage]]
name = "domain"
data = "stdlib:email"
train = "lora"
steps = 2
seq = 32
batch = 4

[[stage]]
name = "reward"
kind = "parse"
data = "stdlib:email"
train = "lora"
steps = {reward_steps}
samples = 4
prompt = 16
completion = 8
lr = 1e-3
"""


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _run(tmp_path, name, reward_steps=3, **kw):
    spec = parse_stages(SPEC.format(reward_steps=reward_steps))
    return run_stages(spec, preset("tiny"), str(tmp_path / name), eval_batches=1, parse_samples=8,
                      log=lambda *_: None, **kw)


def test_three_stages_end_to_end_and_resume_bit_identical(tmp_path):
    trainer, summaries = _run(tmp_path, "a", checkpoint_every=1)
    assert [s["stage"] for s in summaries] == ["general", "domain", "reward"]
    for s in summaries:
        assert set(s["held_out"]) == {"general", "domain", "reward"}
        assert all(v > 0 for v in s["held_out"].values())
    reward = summaries[2]
    assert 0 <= reward["parse_rate_before"] <= 1 and 0 <= reward["parse_rate_after"] <= 1
    # the LoRA stages trained the adapters only: 3 q_a_proj + 2 routers, A and B each
    assert summaries[1]["trainable"] == summaries[2]["trainable"] < summaries[0]["trainable"]
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert sum("loss" in r for r in rows) == 5 and sum("reward" in r for r in rows) == 3
    final = _params(trainer)

    # cut short after 1 reward step, then resumed with the full spec: the same parameters, bit for bit
    _run(tmp_path, "b", reward_steps=1, checkpoint_every=1)
    resumed, rest = _run(tmp_path, "b", resume=str(tmp_path / "b"), checkpoint_every=1)
    assert [s["stage"] for s in rest] == ["reward"]
    got = _params(resumed)
    assert all(torch.equal(got[n], final[n]) for n in final), [n for n in final if not torch.equal(got[n], final[n])]


def test_stage_trains_only_its_part(tmp_path):
    spec = parse_stages(SPEC.format(reward_steps=1))
    spec["stages"] = spec["stages"][:1]
    trainer, _ = run_stages(spec, preset("tiny"), str(tmp_path), eval_batches=1, log=lambda *_: None)
    # the general stage trains everything but the (zero-initialised) adapters: B stays exactly 0
    lora_b = [p for n, p in trainer.model.named_parameters() if n.endswith(".lora_B")]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)


def test_sampling_stays_in_the_byte_range():
    """The tiny preset's vocabulary is 512 ids; a sampled id >= 256 crashed the
    reward (bytes() of it) in examples/stages.toml's reward stage."""
    def model(ids):  # every id but 300 impossible
        logits = torch.full((*ids.shape, 512), -1e9)
        logits[..., 300] = 0.0
        logits[..., 10] = -5.0
        return logits
    out, lengths = sample(model, torch.full((3, 4), 97), 6, torch.Generator().manual_seed(0))
    assert out.max() < 256 and (out == 10).all() and lengths.tolist() == [1, 1, 1]


def test_line_parses():
    assert line_parses(b"    x = f(a, b)") and line_parses(b"def f(x):") and line_parses(b"return x")
    assert not line_parses(b"x = (") and not line_parses(b"   ") and not line_parses(b"def f(:")


@pytest.mark.parametrize("text,message", [
    ("x = [", "not valid TOML"),
    ("", "at least one"),
    ('[[stage]]\nname = "a"\ndata = "stdlib"\nstep = 3', r"unknown field\(s\) \['step'\]"),
    ('[[stage]]\nname = "a"\ndata = "stdlib"\nsteps = 0', "stage 0 \\('a'\\): steps must be a positive integer"),
    ('[[stage]]\nname = "a"\ndata = "stdlib"\nkind = "rl"', "kind must be one of"),
    ('[[stage]]\nname = "a"\ndata = "stdlib"\ntrain = "lora"', r"needs a \[lora\] table"),
    ('[[stage]]\nname = "a"\ndata = "stdlib"\n[[stage]]\nname = "a"\ndata = "stdlib"', "used by an earlier stage"),
    ('[[stage]]\nname = "a"\ndata = "stdlib:email"\nexclude = ["json"]', "exclude applies to data = 'stdlib'"),
    ('[lora]\nrank = 2\n[[stage]]\nname = "a"\ndata = "stdlib"', r"\[lora\]: unknown field"),
])
def test_bad_specs_are_named(text, message):
    with pytest.raises(StageSpecError, match=message):
        parse_stages(text)


def test_cli_refuses_bad_spec_with_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[stage]]\nname = "a"\ndata = "stdlib:no_such_package"\n')
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--stages", str(bad), "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert "no package 'no_such_package'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run" / "checkpoint")
