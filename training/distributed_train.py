"""One process's share of GLM-5 training across processes: the model built
and parallelized (training/parallelize.py, training/pipeline.py), its
optimizer, and the optimizer step over one global batch.

    trainer = Trainer(config, dims, mesh, micro_batches=4, lr=1e-3)   # mesh None for one process
    loss = trainer.step(x, y)          # x, y: the whole global batch [B, S], the same on every process
    params = trainer.full_parameters() # this stage's parameters, whole (a collective)

The model is built on the meta device, split and parallelized there, and
each process then allocates and fills only its own shards
(training/meta_init.py): no process holds the whole model, and the values
are those of the eager single-process model of the same seed (seeded, then
GLM5ForCausalLM.init_weights), which is what the parity tests compare
against. meta_init=False builds the whole model eagerly in every process
first (needed with LoRA, whose adapters are built from the base weights). Each data-parallel process ("dp" =
dp_shard x ep) takes its contiguous B / dp rows. Gradient accumulation: with
pp = 1 the rows are split into K micro-batches whose losses are scaled by
1/K, and FSDP2 synchronises gradients after the last one only
(set_requires_gradient_sync); with pp > 1 the K micro-batches are the
pipeline schedule's, and the schedule does the same.

The Trainer fixes glibc's mmap threshold at 64 KiB for its process
(training/allocator.py; mmap_threshold=None leaves malloc alone): without
it, memory a step frees stays resident and the process's peak grows.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from models.glm5 import GLM5ForCausalLM
from models.glm5.config import GLM5Config
from training.activation_policy import apply_activation_policy
from training.allocator import set_mmap_threshold
from training.meta_init import materialize, record_init, seeded_init
from training.parallelize import ParallelDims, data_rank, parallelize
from training.pipeline import SCHEDULES, build_schedule, keep_layers, lm_loss, split_layers

DEFAULT_MMAP_THRESHOLD = 64 * 1024   # training/allocator.py: what a step frees leaves RSS


class Trainer:
    def __init__(self, config: GLM5Config, dims: ParallelDims, mesh=None, *, attn: str = "dsa", lr: float = 1e-3,
                 micro_batches: int = 1, schedule: str = "1f1b", seed: int = 0, param_dtype=None,
                 overlap: bool = True, device: str | torch.device = "cpu", lora=None, meta_init: bool | None = None,
                 memory_policy: str = "none", mmap_threshold: int | None = DEFAULT_MMAP_THRESHOLD):
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        if dims.pp > 1 and micro_batches < dims.pp:
            raise ValueError(f"micro_batches ({micro_batches}) must be at least pp ({dims.pp}): the pipeline "
                             "schedules need a micro-batch per stage")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if mesh is None and dims.world_size != 1:
            raise ValueError(f"a mesh is needed for {dims.world_size} processes")
        dims.validate(config, dims.world_size)
        if mmap_threshold is not None:   # before the model's memory: freed tensors go back to the system
            set_mmap_threshold(mmap_threshold)
        self.config, self.dims, self.mesh, self.K = config, dims, mesh, micro_batches
        self.schedule_name, self.param_dtype, self.device = schedule, param_dtype, torch.device(device)
        self.stage = mesh["pp"].get_local_rank() if mesh is not None else 0
        self.first, self.last = self.stage == 0, self.stage == dims.pp - 1
        self.data_rank = data_rank(mesh) if mesh is not None else 0

        if meta_init is None:
            meta_init = lora is None
        if meta_init and lora is not None:
            raise ValueError("meta_init=True cannot be combined with lora: the adapters are built from the "
                             "base weights' values (pass meta_init=False)")
        self.meta_init = meta_init
        with torch.device("meta" if meta_init else self.device):
            model = GLM5ForCausalLM(config.replace(num_nextn_predict_layers=0), attn=attn)
        if meta_init:
            plan = record_init(model)
        else:
            seeded_init(model, seed)
        keep_layers(model, split_layers(config, dims.pp)[self.stage], first=self.first, last=self.last)
        apply_activation_policy(model, memory_policy)
        self.lora = lora
        if lora is not None:   # adapters before parallelize: FSDP2 shards them like any parameter
            from training.lora import apply_lora
            apply_lora(model, lora, tp=dims.tp, ep=dims.ep)
        if mesh is not None:
            parallelize(model, mesh, dims, param_dtype=param_dtype, overlap=overlap)
        if meta_init:
            materialize(model, plan, seed, self.device)
        self.model = model
        # foreach=False: the parameters mix DTensors of different meshes and plain tensors.
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                           foreach=False)
        self.fsdp = isinstance(model, FSDPModule)
        self._schedule = None

    # -- one optimizer step ----------------------------------------------------
    def local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This process's contiguous slice of the global batch."""
        dp = self.dims.data_parallel
        if t.shape[0] % (dp * self.K):
            raise ValueError(f"the global batch ({t.shape[0]} rows) must divide into dp_shard x ep = {dp} "
                             f"processes x {self.K} micro-batches")
        b = t.shape[0] // dp
        return t[self.data_rank * b:(self.data_rank + 1) * b].to(self.device)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch (x, y) [B, S]; returns its mean loss (on every process)."""
        loss = self.backward(x, y)
        self.optimizer_step()
        return loss

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of every micro-batch, gradients synchronised; the batch's mean loss."""
        x, y = self.local_rows(x), self.local_rows(y)
        if self.dims.pp > 1:
            loss = self._pipeline_step(x, y)
        else:
            loss = torch.zeros((), device=self.device)
            for i, (mx, my) in enumerate(zip(x.chunk(self.K), y.chunk(self.K))):
                if self.fsdp:
                    self.model.set_requires_gradient_sync(i == self.K - 1)
                micro = lm_loss(self.model(mx), my) / self.K
                micro.backward()
                loss += micro.detach()
        return self._global_mean(loss)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The mean loss of the global batch (x, y) without training on it (pp = 1)."""
        if self.dims.pp > 1:
            raise NotImplementedError("eval_loss runs the whole model in each process: pp must be 1")
        x, y = self.local_rows(x), self.local_rows(y)
        return self._global_mean(lm_loss(self.model(x), y))

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _pipeline_step(self, x, y) -> torch.Tensor:
        if self._schedule is None:
            self._schedule = build_schedule(
                self.model, self.stage, self.dims.pp, micro_batches=self.K, schedule=self.schedule_name,
                example=x[:x.shape[0] // self.K], hidden_size=self.config.hidden_size,
                dtype=self.param_dtype or torch.float32, device=self.device, group=self.mesh["pp"].get_group())
        losses = []
        self._schedule.step(*((x,) if self.first else ()), target=y if self.last else None, losses=losses)
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack([l.detach() for l in losses]).mean()

    def _global_mean(self, loss: torch.Tensor) -> float:
        """The batch's mean loss: data-parallel processes' losses averaged; the last stage's, once per tp group."""
        if self.mesh is None:
            return float(loss)
        counts = self.last and self.mesh["tp"].get_local_rank() == 0
        total = (loss if counts else torch.zeros_like(loss)).reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / self.dims.data_parallel

    # -- inspection --------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of parameters, their gradients (as held at the optimizer step:
        one per parameter the optimizer has state for) and the optimizer state
        this process holds: its shards only."""
        def local(t):
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()
        total = sum(local(p) for p in self.model.parameters())
        for p, state in self.optimizer.state.items():
            total += local(p) + sum(local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
        return total

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> the whole tensor (CPU) for every parameter of this stage; a
        collective: every process of the stage calls it."""
        return self._gather(lambda p: p)

    def save_pretrained(self, path: str) -> None:
        """Writes config.json and model.safetensors (experts stacked, every
        stage's tensors, fp32) that GLM5ForCausalLM.from_pretrained loads. A
        collective: every process calls it; process 0 writes."""
        from safetensors.torch import save_file
        tensors = self.full_parameters()
        tensors.update({n: b.detach().cpu().clone() for n, b in self.model.named_buffers()})
        if self.lora is not None:
            from training.lora import merged_tensors
            tensors = merged_tensors(tensors, self.lora)
        rank = dist.get_rank() if self.mesh is not None else 0
        if self.mesh is not None:
            owner = self.mesh["dp"].get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0
            parts = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(tensors if owner else None, parts, dst=0)
            if rank == 0:
                tensors = {n: t for part in parts if part is not None for n, t in part.items()}
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            self.config.replace(num_nextn_predict_layers=0).to_json(os.path.join(path, "config.json"))
            save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(path, "model.safetensors"))

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """name -> the whole gradient (CPU) of every parameter of this stage that has one (a collective)."""
        return self._gather(lambda p: p.grad)

    def _gather(self, tensor_of) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.model.named_parameters():
            t = tensor_of(p)
            if t is None:
                continue
            t = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if self.dims.ep > 1 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                parts = [torch.empty_like(t) for _ in range(self.dims.ep)]
                dist.all_gather(parts, t.contiguous(), group=self.mesh["ep"].get_group())
                t = torch.cat(parts)
            out[name] = t.detach().float().cpu().clone()
        return out
