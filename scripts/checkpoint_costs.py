"""What checkpoints cost, measured in one run (one process, CPU; default the
`small` preset): how long a synchronous save blocks training against an
asynchronous one (full fine-tuning state: weights + AdamW), the bytes of an
incremental checkpoint during a LoRA-only stage against its full one, and
the time to resume (load + first step) from the LoRA chain against loading
the full fine-tuning checkpoint.

    python scripts/checkpoint_costs.py --preset small --json costs.json

Needs about 4 x the model's fp32 bytes of memory while saving the full
state (weights, gradients, two Adam moments, and async_save's CPU copy).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from models.glm5.config import preset  # noqa: E402
from training.checkpoint import Checkpointer, complete_checkpoints  # noqa: E402
from training.distributed_train import Trainer  # noqa: E402
from training.lora import LoraConfig, trainable_fraction  # noqa: E402
from training.parallelize import ParallelDims  # noqa: E402


def log(msg):
    print(f"[costs] {msg}", flush=True)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--only-async", action="store_true", help="stop after the synchronous/asynchronous save timings")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    config = preset(args.preset)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, args.seq + 1), generator=g)
    batch = (x[:, :-1], x[:, 1:])
    out = dict(preset=args.preset)
    work = args.workdir or tempfile.mkdtemp(prefix="ckpt_costs_")
    try:
        log(f"{args.preset}: full fine-tuning, one step")
        trainer = Trainer(config, ParallelDims(), None, lr=1e-4)
        trainer.step(*batch)
        full_root = os.path.join(work, "full")
        sync = Checkpointer(full_root, trainer)
        _, out["sync_save_s"] = timed(lambda: sync.save(1))
        out["full_state_bytes"] = complete_checkpoints(full_root)[-1][2]["bytes"]
        log(f"sync save: {out['sync_save_s']:.2f} s, {out['full_state_bytes'] / 2**20:.0f} MiB")
        # DCP's default staging (fresh CPU buffers each save) against buffers kept across saves
        fresh = Checkpointer(os.path.join(work, "async_fresh"), trainer, async_save=True, reuse_staging=False)
        _, out["async_fresh_blocking_s"] = timed(lambda: fresh.save(1))
        fresh.close()
        shutil.rmtree(os.path.join(work, "async_fresh"))
        asyn = Checkpointer(os.path.join(work, "async"), trainer, async_save=True, keep=1)
        _, out["async_first_blocking_s"] = timed(lambda: asyn.save(1))   # allocates the buffers
        asyn.wait()
        _, out["async_blocking_s"] = timed(lambda: asyn.save(2))         # copies into them
        # training while the write runs in the background: what the write costs a step
        _, out["step_during_write_s"] = timed(lambda: trainer.step(*batch))
        _, out["async_remaining_s"] = timed(asyn.close)
        _, out["step_alone_s"] = timed(lambda: trainer.step(*batch))
        for key in ("async_fresh_blocking", "async_first_blocking", "async_blocking"):
            out[key + "_fraction"] = out[key + "_s"] / out["sync_save_s"]
        log(f"async save, fresh buffers (DCP's default): blocked {out['async_fresh_blocking_s']:.2f} s "
            f"({100 * out['async_fresh_blocking_fraction']:.0f}% of sync)")
        log(f"async save, reused buffers: first (allocates) {out['async_first_blocking_s']:.2f} s, then "
            f"{out['async_blocking_s']:.2f} s ({100 * out['async_blocking_fraction']:.1f}% of sync); a step during "
            f"the background write {out['step_during_write_s']:.2f} s against {out['step_alone_s']:.2f} s alone")
        if args.only_async:
            return _finish(out, args, work)
        del trainer, sync, asyn
        gc.collect()

        targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=targets,
                          target_parameters=["mlp.gate.weight"])
        log(f"LoRA-only stage (r={args.lora_rank} on {targets} and the routers)")
        trainer = Trainer(config, ParallelDims(), None, lr=1e-4, lora=lora)
        trainable, total = trainable_fraction(trainer.model)
        out["lora_trainable_fraction"] = trainable / total
        lora_root = os.path.join(work, "lora")
        ckpt = Checkpointer(lora_root, trainer, incremental=True)
        trainer.step(*batch)
        ckpt.save(1)
        trainer.step(*batch)
        _, out["incremental_save_s"] = timed(lambda: ckpt.save(2))
        (_, _, base), (_, _, inc) = complete_checkpoints(lora_root)
        assert base["kind"] == "full" and inc["kind"] == "incremental", (base, inc)
        out["lora_full_bytes"], out["incremental_bytes"] = base["bytes"], inc["bytes"]
        out["incremental_fraction"] = inc["bytes"] / base["bytes"]
        log(f"LoRA stage: trainable {100 * out['lora_trainable_fraction']:.2f}%; full checkpoint "
            f"{base['bytes'] / 2**20:.1f} MiB, incremental {inc['bytes'] / 2**20:.2f} MiB "
            f"({100 * out['incremental_fraction']:.2f}%)")
        del trainer, ckpt
        gc.collect()

        for name, root, cfg in (("full", full_root, None), ("lora_chain", lora_root, lora)):
            trainer = Trainer(config, ParallelDims(), None, lr=1e-4, seed=1, lora=cfg)
            _, load_s = timed(lambda: Checkpointer(root, trainer).load())
            _, step_s = timed(lambda: trainer.step(*batch))
            out[f"resume_{name}_load_s"], out[f"resume_{name}_first_step_s"] = load_s, step_s
            log(f"resume from {name}: load {load_s:.2f} s + first step {step_s:.2f} s")
            del trainer
            gc.collect()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return _finish(out, args, work)


def _finish(out, args, work) -> int:
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
