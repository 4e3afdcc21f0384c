"""Runs a staged training spec (training/stages.py) in one process: each
stage sets which parameters train, its attention mode, learning rate and
data, trains (next-byte LM steps, or policy-gradient steps for a "parse"
stage), then reports the held-out loss of every stage's data, so what a
later stage costs an earlier stage's data shows. A parse stage also reports
its parse rate (training/parse_reward.py) before and after.

Checkpoints (every `checkpoint_every` steps within a stage, and at each
stage's end) record the stage index, the step within it and the data
generator's state; a resume reads the stage from the newest complete
checkpoint first, sets that stage up (its trainable set is the optimizer's),
then loads. With LoRA stages the adapters exist from the start (a fresh
adapter adds exact zeros, so earlier stages are unaffected) and stay frozen
outside them; a LoRA stage's checkpoints are incremental (its adapters only).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from models.glm5.attention_modes import attention_mode
from training.checkpoint import Checkpointer, latest_checkpoint
from training.distributed_train import Trainer
from training.parallelize import ParallelDims
from training.parse_reward import parse_rate, policy_gradient_step
from training.stages import split_held_out, stage_data
from training.train import batch as sample_batch

_ADAPTER = (".lora_A", ".lora_B")


def configure_stage(trainer: Trainer, stage: dict) -> int:
    """Trainable set, attention mode and a fresh AdamW for `stage`; returns the trainable parameter count."""
    lora_only = stage["train"] == "lora"
    params = []
    for name, p in trainer.model.named_parameters():
        p.requires_grad_(name.endswith(_ADAPTER) == lora_only)
        if p.requires_grad:
            params.append(p)
    trainer.model.attention_mode = attention_mode(stage["attn"])
    trainer.optimizer = torch.optim.AdamW(params, lr=stage["lr"], betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    return sum(p.numel() for p in params)


def _peek_position(path: str) -> tuple[int, int]:
    where = {"extra": {"stage": torch.tensor(0), "stage_step": torch.tensor(0)}}
    dcp.load(where, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    return int(where["extra"]["stage"]), int(where["extra"]["stage_step"])


def held_out_losses(trainer: Trainer, stages, held, batches: int) -> dict[str, float]:
    out = {}
    for stage, data in zip(stages, held):
        gen = torch.Generator().manual_seed(1234)
        seq = min(stage["seq"], data.numel() // 4)
        out[stage["name"]] = sum(trainer.eval_loss(*sample_batch(data, stage["batch"], seq, gen))
                                 for _ in range(batches)) / batches
    return out


def run_stages(spec: dict, config, out: str, *, seed: int = 0, checkpoint_every: int | None = None,
               resume: str | None = None, eval_batches: int = 4, parse_samples: int = 64, log=print) -> list[dict]:
    """Trains the stages in order; returns the Trainer and one summary per stage trained (also written to
    out/metrics.jsonl)."""
    from training.lora import LoraConfig
    stages = spec["stages"]
    lora = LoraConfig(**spec["lora"]) if spec["lora"] is not None else None
    trainer = Trainer(config, ParallelDims(), None, attn=stages[0]["attn"], lr=stages[0]["lr"], seed=seed, lora=lora)
    data = [split_held_out(stage_data(s["data"], s["exclude"])) for s in stages]
    held = [h for _, h in data]
    os.makedirs(out, exist_ok=True)
    root = os.path.join(out, "ckpt")
    ckpt = Checkpointer(root, trainer, incremental=True) if checkpoint_every or resume else None
    first_stage, first_step, gen_state = 0, 0, None
    if resume is not None:
        path = latest_checkpoint(os.path.join(resume, "ckpt"))
        if path is None:
            raise ValueError(f"resume: no complete checkpoint under {os.path.join(resume, 'ckpt')!r}")
        first_stage, first_step = _peek_position(path)
        configure_stage(trainer, stages[first_stage])
        extra = Checkpointer(os.path.join(resume, "ckpt"), trainer).load(path)
        gen_state = extra["data_rng"]
        log(f"[stages] resumed at stage {first_stage} ({stages[first_stage]['name']}) step {first_step}")
    metrics = open(os.path.join(out, "metrics.jsonl"), "a" if resume else "w")
    summaries = []
    try:
        for i in range(first_stage, len(stages)):
            s, (train, _) = stages[i], data[i]
            n_train = configure_stage(trainer, s)
            gen = torch.Generator().manual_seed(seed + 1000 * i)
            start = first_step if i == first_stage else 0
            if start >= s["steps"]:
                continue
            if gen_state is not None and i == first_stage:
                gen.set_state(gen_state)
            summary = dict(stage=s["name"], kind=s["kind"], train=s["train"], trainable=n_train, steps=s["steps"])
            rate = dict(n=parse_samples, prompt=s["prompt"], completion=s["completion"], seed=seed + 7)
            if s["kind"] == "parse":
                summary["parse_rate_before"] = parse_rate(trainer.model, held[i], **rate)
            log(f"[stages] stage {i} {s['name']!r}: {s['kind']}, train {s['train']} ({n_train} parameters), "
                f"{s['steps']} steps, lr {s['lr']}, attn {s['attn']}")
            for step in range(start, s["steps"]):
                if s["kind"] == "lm":
                    value = dict(loss=trainer.step(*sample_batch(train, s["batch"], s["seq"], gen)))
                else:
                    value = dict(reward=policy_gradient_step(
                        trainer.model, trainer.optimizer, train, samples=s["samples"], prompt=s["prompt"],
                        completion=s["completion"], gen=gen))
                metrics.write(json.dumps(dict(stage=s["name"], step=step, **value)) + "\n")
                done = step + 1 == s["steps"]
                if ckpt is not None and (done or (checkpoint_every and (step + 1) % checkpoint_every == 0)):
                    # a finished stage is recorded as (stage, steps): a resume loads it under that stage's
                    # trainable set and optimizer, then moves on
                    ckpt.save(sum(t["steps"] for t in stages[:i]) + step + 1,
                              dict(stage=i, stage_step=step + 1, data_rng=gen.get_state()))
            summary["held_out"] = held_out_losses(trainer, stages, held, eval_batches)
            if s["kind"] == "parse":
                summary["parse_rate_after"] = parse_rate(trainer.model, held[i], **rate)
            log(f"[stages] after {s['name']!r}: held-out loss " + ", ".join(
                f"{k} {v:.4f}" for k, v in summary["held_out"].items()) + (
                f"; parse rate {summary['parse_rate_before']:.3f} -> {summary['parse_rate_after']:.3f}"
                if s["kind"] == "parse" else ""))
            metrics.write(json.dumps(summary) + "\n")
            metrics.flush()
            summaries.append(summary)
    finally:
        metrics.close()
        if ckpt is not None:
            ckpt.close()
    return trainer, summaries
