"""Training checkpoints through torch.distributed.checkpoint (DCP): model,
optimizer (with its learning rates), the data loader's position, RNG states,
stage and step; synchronous or asynchronous, full or incremental, resharded
on load (save under one mesh, resume under another).

    ckpt = Checkpointer(root, trainer, async_save=True, incremental=True)
    ckpt.save(step, extra={"data_rng": gen.get_state()})   # every process; waits for the previous save
    ckpt.poll()                                             # each step: commits a finished async save
    ckpt.close()                                            # waits for the last one
    extra = Checkpointer(root, trainer).load()              # the newest complete checkpoint (None: none)

Layout: root/step_000010/ holds DCP's files (one .distcp per process and
.metadata) and, written last, manifest.json. A checkpoint is complete only
once its manifest exists: process 0 writes it (to a temporary name, then
os.replace, so it appears whole or not at all) after its save future is done,
and DCP completes process 0's future only after every process's data and the
.metadata are written. A process killed at any moment therefore leaves
either a complete checkpoint or a directory without a manifest, which
load() never reads and a resume deletes.

Incremental: with incremental=True, a save after a full one writes only the
parameters that still train (requires_grad), the buffers, the optimizer
state (which covers only trainable parameters) and the extras, and names the
full checkpoint it builds on in its manifest; the frozen parameters are read
from that base on load. It is only taken while the set of trainable
parameters is the one the base saw (a parameter frozen since then is
unchanged since then); otherwise the save is full. A LoRA-only stage thus
writes its adapters and their Adam state, not the frozen model.

Retention: after each commit the `keep` newest complete checkpoints, and the
full checkpoints they build on, are kept; older ones are deleted.

Async: dcp.async_save copies the state to CPU memory (the only part that
blocks training) and writes it from a background thread over a process group
of its own (gloo), so its collectives never interleave with training's. At
most one save is in flight: the next save() waits for it. The copy goes into
CPU buffers kept from one save to the next (training/ckpt_staging.py): the
first save allocates them, later ones only copy (reuse_staging=False: fresh
buffers every save, DCP's default).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from training.ckpt_staging import ReusedStagingBuffers, StagingWriter

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{9})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:09d}")


def read_manifest(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def complete_checkpoints(root: str) -> list[tuple[int, str, dict]]:
    """(step, path, manifest) of every complete checkpoint under root whose base (if any) is complete, oldest first."""
    if not os.path.isdir(root):
        return []
    found = {}
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        manifest = read_manifest(path) if m else None
        if manifest is not None:
            found[name] = (int(m.group(1)), path, manifest)
    return sorted(v for v in found.values() if v[2].get("base") is None or v[2]["base"] in found)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under root, or None."""
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


class _SlowWriter(StagingWriter):
    """Tests only (GLM5_CKPT_WRITE_DELAY_S): holds each process's data written
    but the save unfinished (no .metadata, no manifest) for that long, so a
    kill can land inside a save."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        time.sleep(float(os.environ["GLM5_CKPT_WRITE_DELAY_S"]))
        return fut


class Checkpointer:
    def __init__(self, root: str, trainer, *, async_save: bool = False, incremental: bool = False, keep: int = 2,
                 reuse_staging: bool = True):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self.root, self.trainer, self.async_save, self.incremental, self.keep = root, trainer, async_save, \
            incremental, keep
        self.distributed = dist.is_initialized()
        # async: the background thread's collectives get a group of their own
        self.group = dist.new_group(backend="gloo") if async_save and self.distributed else None
        self._pending = None          # (future, path, manifest) of the save in flight
        self._base = None             # (name, trainable names) of the newest full checkpoint
        self.last_blocking_s = 0.0    # how long the last save() held training up
        self.staging = ReusedStagingBuffers() if async_save and reuse_staging else None

    # -- state ---------------------------------------------------------------------
    def _trainable(self) -> set[str]:
        return {n for n, p in self.trainer.model.named_parameters() if p.requires_grad}

    def _state(self, extra: dict | None, *, frozen: bool = True) -> dict:
        model_sd, optim_sd = get_state_dict(self.trainer.model, self.trainer.optimizer)
        if not frozen:
            keep = self._trainable() | {n for n, _ in self.trainer.model.named_buffers()}
            model_sd = {n: t for n, t in model_sd.items() if n in keep}
        extra = {k: torch.as_tensor(v) for k, v in (extra or {}).items()}
        return {"model": model_sd, "optim": optim_sd, "extra": extra,
                "rng": {f"rank{_rank()}": torch.get_rng_state()}}

    # -- save ------------------------------------------------------------------------
    def save(self, step: int, extra: dict | None = None) -> str:
        """A checkpoint of this step (every process calls it); returns its directory.
        Synchronous: complete on return. Async: complete once a later poll(), save() or close() commits it."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.wait()
        t0 = time.perf_counter()
        trainable = self._trainable()
        everything = len(trainable) == sum(1 for _ in self.trainer.model.parameters())
        full = everything or not (self.incremental and self._base is not None and self._base[1] == trainable)
        path = step_dir(self.root, step)
        state = self._state(dict(extra or {}, step=step), frozen=full)
        writer_cls = _SlowWriter if os.environ.get("GLM5_CKPT_WRITE_DELAY_S") else StagingWriter
        writer = writer_cls(path, self.staging, "full" if full else "incremental")
        manifest = dict(step=step, kind="full" if full else "incremental",
                        base=None if full else self._base[0], world=dist.get_world_size() if self.distributed else 1,
                        time=time.time())
        if full:
            self._base = (os.path.basename(path), trainable)
        if self.async_save:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            fut = getattr(fut, "upload_completion", fut)   # AsyncSaveResponse on newer stagers
            self._pending = (fut, path, manifest)
        else:
            dcp.save(state, storage_writer=writer)
            self._commit(path, manifest)
        self.last_blocking_s = time.perf_counter() - t0
        return path

    def poll(self) -> bool:
        """Commits the save in flight if it has finished; True when none is left in flight."""
        if self._pending is not None and self._pending[0].done():
            self.wait()
        return self._pending is None

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is written, then commits it."""
        if self._pending is not None:
            fut, path, manifest = self._pending
            self._pending = None
            fut.result()
            self._commit(path, manifest)

    def close(self) -> None:
        """Waits for the save in flight and frees the staging buffers."""
        self.wait()
        if self.staging is not None:
            self.staging.clear()

    def _commit(self, path: str, manifest: dict) -> None:
        if _rank() != 0:
            return
        manifest["bytes"] = _dir_bytes(path)
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))
        self._retain()

    def _retain(self) -> None:
        done = complete_checkpoints(self.root)
        kept = {os.path.basename(p) for _, p, _ in done[-self.keep:]}
        kept |= {m["base"] for _, _, m in done[-self.keep:] if m.get("base")}
        newest = done[-1][0] if done else -1
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            # older than the newest commit and not kept: a superseded or a crashed save
            if m and name not in kept and int(m.group(1)) < newest:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # -- load ------------------------------------------------------------------------
    def load(self, path: str | None = None) -> dict | None:
        """Restores model, optimizer and this process's RNG from `path` (default:
        the newest complete checkpoint under root, composing an incremental one
        with its base) under this trainer's mesh, whatever mesh saved it; deletes
        unfinished saves. Returns the extras (step, ...) or None when there is none."""
        if path is None:
            path = latest_checkpoint(self.root)
            if path is None:
                return None
        manifest = read_manifest(path)
        if manifest is None:
            raise ValueError(f"path: {path!r} is not a complete checkpoint (no {MANIFEST})")
        if _rank() == 0:
            self._drop_unfinished()
        state = self._state({"step": 0, **self._extra_template(path)})
        planner = DefaultLoadPlanner(allow_partial_load=True)   # another world size: another rank's RNG
        if manifest.get("base"):
            base = os.path.join(os.path.dirname(path), manifest["base"])
            frozen = {n: t for n, t in state["model"].items() if n not in self._trainable()}
            dcp.load({"model": frozen}, checkpoint_id=base, planner=DefaultLoadPlanner(allow_partial_load=True))
            partial = self._state({"step": 0, **self._extra_template(path)}, frozen=False)
            dcp.load(partial, checkpoint_id=path, planner=planner)
            state["model"].update(partial["model"])
            state["optim"], state["extra"], state["rng"] = partial["optim"], partial["extra"], partial["rng"]
        else:
            dcp.load(state, checkpoint_id=path, planner=planner)
        set_state_dict(self.trainer.model, self.trainer.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        rng = state["rng"][f"rank{_rank()}"]
        if manifest["world"] == (dist.get_world_size() if self.distributed else 1):
            torch.set_rng_state(rng)
        self._base = (manifest.get("base") or os.path.basename(path), self._trainable())
        if self.distributed:
            dist.barrier()   # no process saves into a directory process 0 is still deleting
        return {k: (v.item() if v.dim() == 0 else v) for k, v in state["extra"].items()}

    def _extra_template(self, path: str) -> dict:
        """Tensors shaped like the saved extras (DCP loads in place), read from the checkpoint's metadata."""
        meta = dcp.FileSystemReader(path).read_metadata()
        out = {}
        for key, md in meta.state_dict_metadata.items():
            if key.startswith("extra.") and key != "extra.step":
                out[key[len("extra."):]] = torch.empty(md.size, dtype=md.properties.dtype)
        return out

    def _drop_unfinished(self) -> None:
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if _STEP_DIR.match(name) and read_manifest(path) is None:
                shutil.rmtree(path, ignore_errors=True)
