"""glm5-lab train: GLM-5 trained across processes (launched by torchrun), or in one.

    torchrun --nproc_per_node=4 -m profiling train --preset tiny --dp-shard 2 --tp 2 --steps 50 --out runs/train
    glm5-lab train --preset tiny --steps 20 --out runs/train          # one process, no torchrun

Every argument is checked before any process group is created: a mesh whose
dp_shard x tp x pp x ep is not the world size, tp not dividing the heads (or
the MLP widths), ep not dividing the routed experts, pp over the layer count,
or a batch that does not split over the data-parallel processes and
micro-batches exits with argparse's usage error (status 2) on every process.

Data: --data stdlib reads the Python standard library's .py sources as bytes
(training/train.py's load_corpus; token = byte, so the vocabulary must hold
256); --data PATH reads a file, or a directory's files, as bytes. The last 5%
is held out. Each step prints a progress line (loss, tokens/s, peak memory,
time in torch.distributed collectives) and rank 0 appends the same as one
JSON object to DIR/metrics.jsonl; the held-out loss is printed at the end
(pp = 1 only: the pipeline schedules have no forward-only step on every
release this lab supports), and DIR/checkpoint gets config.json and
model.safetensors (fp32, experts stacked) that GLM5ForCausalLM.from_pretrained
loads, and a byte-level tokenizer.json (training/byte_tokenizer.py).
"""
from __future__ import annotations

import json
import os
import resource
import time

import torch

from .args import UsageError, nonnegative_int, positive_float, positive_int

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def add_parser(subparsers) -> None:
    from models.glm5.config import PRESETS
    p = subparsers.add_parser(
        "train", help="train GLM-5 across processes (FSDP2, TP, PP, EP; launch with torchrun)",
        description=__doc__.split("\n\n")[2])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--data", default="stdlib", help="stdlib (the standard library's sources) or a file/directory")
    p.add_argument("--corpus-mib", type=positive_float, default=8.0, help="bytes of corpus read, in MiB")
    for dim in ("dp-shard", "tp", "pp", "ep"):
        p.add_argument(f"--{dim}", type=positive_int, default=1)
    p.add_argument("--micro-batches", type=positive_int, default=1, metavar="K",
                   help="gradient accumulation steps (pp > 1: the pipeline's micro-batches)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule (pp > 1; training/pipeline.py SCHEDULES)")
    p.add_argument("--batch", type=positive_int, default=8, help="global batch, in sequences")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--attn", choices=("dense", "dsa"), default="dsa")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="FSDP2 MixedPrecisionPolicy param dtype (gradients reduced in fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA (NCCL) when a GPU is visible, else CPU (gloo)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per process (default: torch's; torchrun sets OMP_NUM_THREADS=1)")
    p.add_argument("--eval-batches", type=nonnegative_int, default=4, help="held-out batches (0: none)")
    p.add_argument("--no-overlap", action="store_true",
                   help="gather each layer's weights when it is reached and wait, instead of one layer ahead "
                        "asynchronously (training/parallelize.py set_prefetch)")
    p.add_argument("--memory-policy", choices=("none", "recompute", "compress8", "full"), default="none",
                   help="per decoder layer: recompute in backward, keep 8-bit saved tensors, or both "
                        "(training/activation_policy.py)")
    p.add_argument("--no-checkpoint", action="store_true", help="do not write DIR/checkpoint at the end")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="a DCP checkpoint every N steps under DIR/ckpt (docs/CHECKPOINTS.md)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints while training continues")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue from the newest complete checkpoint under DIR/ckpt (any mesh), appending to "
                        "--out's metrics.jsonl")
    p.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank on the attention projections only (training/lora.py)")
    p.add_argument("--lora-router", action="store_true", help="with --lora: adapters on the MoE routers too")
    p.add_argument("--stages", metavar="FILE", default=None,
                   help="a TOML stage spec (docs/TRAINING.md, training/stages.py): its stages' data, steps, seq, "
                        "batch, lr, attn and trainable parts replace those flags; one process")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=run, parser=p)


def _read_corpus(spec: str, max_bytes: int) -> torch.Tensor:
    if spec == "stdlib":
        from training.train import load_corpus
        return load_corpus(max_bytes)
    if not os.path.exists(spec):
        raise UsageError(f"--data: {spec!r} is neither 'stdlib' nor an existing file or directory")
    paths = [spec] if os.path.isfile(spec) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs)
    data = bytearray()
    for path in paths:
        with open(path, "rb") as f:
            data += f.read(max_bytes - len(data))
        if len(data) >= max_bytes:
            break
    if len(data) < 4096:
        raise UsageError(f"--data: {spec!r} holds {len(data)} bytes; at least 4096 are needed")
    return torch.frombuffer(data, dtype=torch.uint8).clone()


def _validate(args, config, dims, world: int) -> None:
    try:
        dims.validate(config, world)
    except ValueError as e:
        raise UsageError(f"{e} (torchrun --nproc_per_node sets the world size)") from None
    if config.vocab_size < 256:
        raise UsageError(f"--preset {args.preset}: vocab_size {config.vocab_size} cannot hold the 256 byte tokens")
    if args.batch % (dims.data_parallel * args.micro_batches):
        raise UsageError(f"--batch {args.batch} must divide into dp_shard x ep = {dims.data_parallel} processes x "
                         f"--micro-batches {args.micro_batches}")
    if dims.pp > 1 and args.micro_batches < dims.pp:
        raise UsageError(f"--micro-batches {args.micro_batches} must be at least --pp {dims.pp} (the pipeline "
                         "schedules need a micro-batch per stage)")
    if args.dtype != "fp32" and dims.data_parallel == 1:
        raise UsageError(f"--dtype {args.dtype} is FSDP2's MixedPrecisionPolicy: it needs dp_shard x ep > 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda" and local_rank >= torch.cuda.device_count():
        raise UsageError(f"--device cuda: process {local_rank} of this node has no GPU of its own "
                         f"({torch.cuda.device_count()} visible)")
    if args.lora_router and args.lora is None:
        raise UsageError("--lora-router needs --lora RANK")
    if args.async_save and args.checkpoint_every is None:
        raise UsageError("--async-save needs --checkpoint-every N")
    if args.resume is not None and not os.path.isdir(os.path.join(args.resume, "ckpt")):
        raise UsageError(f"--resume: {args.resume!r} holds no ckpt/ directory of checkpoints")
    if args.seq >= config.max_position_embeddings:
        raise UsageError(f"--seq {args.seq} must be below max_position_embeddings={config.max_position_embeddings}")


def _lora_config(args, dims):
    if args.lora is None:
        return None
    from training.lora import LoraConfig
    # the tensor-parallel projections carry no adapters under tp > 1 (training/lora.py)
    targets = ["q_a_proj", "kv_a_proj_with_mqa"] + (["q_b_proj", "kv_b_proj", "o_proj"] if dims.tp == 1 else [])
    return LoraConfig(r=args.lora, lora_alpha=2.0 * args.lora, target_modules=targets,
                      target_parameters=["mlp.gate.weight"] if args.lora_router else [])


def _checkpointer(args, trainer, gen, rank: int):
    """The Checkpointer (None without --checkpoint-every / --resume) and the step to start from."""
    if args.checkpoint_every is None and args.resume is None:
        return None, 0
    from training.checkpoint import Checkpointer
    root = os.path.join(args.out, "ckpt")
    ckpt = Checkpointer(root, trainer, async_save=args.async_save, incremental=True)
    if args.resume is None:
        return ckpt, 0
    extra = Checkpointer(os.path.join(args.resume, "ckpt"), trainer).load()
    if extra is None:
        raise UsageError(f"--resume: no complete checkpoint under {os.path.join(args.resume, 'ckpt')!r}")
    gen.set_state(extra["data_rng"])
    if rank == 0:
        print(f"[train] resumed at step {extra['step']} from {os.path.join(args.resume, 'ckpt')}", flush=True)
    return ckpt, extra["step"]


def _peak_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args) -> int:
    from models.glm5.config import preset
    from training.parallelize import ParallelDims
    config = preset(args.preset)
    if args.stages is not None:
        return _run_stages(args, config)
    dims = ParallelDims(dp_shard=args.dp_shard, tp=args.tp, pp=args.pp, ep=args.ep)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _validate(args, config, dims, world)
    data = _read_corpus(args.data, int(args.corpus_mib * 2**20))
    if data.numel() <= 20 * (args.seq + 1):
        raise UsageError(f"--data holds {data.numel()} bytes: too few for --seq {args.seq}")
    return _train(args, config, dims, world, data)


def _train(args, config, dims, world: int, data: torch.Tensor) -> int:
    import torch.distributed as dist
    from training.comm_meter import CommMeter
    from training.distributed_train import Trainer
    from training.train import batch as sample
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    mesh = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(device)
        mesh = dims.build_mesh(device.type)
    rank = dist.get_rank() if world > 1 else 0
    try:
        split = int(data.numel() * 0.95)
        train, held_out = data[:split], data[split:]
        trainer = Trainer(config, dims, mesh, attn=args.attn, lr=args.lr, micro_batches=args.micro_batches,
                          schedule=args.schedule, seed=args.seed, param_dtype=DTYPES[args.dtype],
                          overlap=not args.no_overlap, device=device, lora=_lora_config(args, dims),
                          memory_policy=args.memory_policy)
        os.makedirs(args.out, exist_ok=True)
        gen = torch.Generator().manual_seed(args.seed)
        ckpt, start = _checkpointer(args, trainer, gen, rank)
        metrics = open(os.path.join(args.out, "metrics.jsonl"), "a" if start else "w") if rank == 0 else None
        if rank == 0 and start:
            metrics.write(json.dumps(dict(resumed_from=start)) + "\n")
        if rank == 0:
            print(f"[train] {args.preset} on {world} process(es): dp_shard {dims.dp_shard} x tp {dims.tp} x pp "
                  f"{dims.pp} x ep {dims.ep} ({device.type}); batch {args.batch}x{args.seq}, K={args.micro_batches}, "
                  f"attn {args.attn}, overlap {'off' if args.no_overlap else 'on'}", flush=True)
        tokens = args.batch * args.seq
        for step in range(start, args.steps):
            x, y = sample(train, args.batch, args.seq, gen)   # the same global batch on every process
            t0 = time.perf_counter()
            with CommMeter() as comm:
                loss = trainer.step(x, y)
            dt = time.perf_counter() - t0
            row = dict(step=step, loss=loss, tokens_per_s=tokens / dt, step_s=dt, comm_s=comm.seconds,
                       collectives=dict(comm.counts), peak_mib=_peak_mib(device),
                       state_mib=trainer.state_bytes() / 2**20)
            if rank == 0:
                print(f"[train] step {step:4d}  loss {loss:.4f}  {row['tokens_per_s']:.0f} tok/s  "
                      f"{dt * 1e3:.0f} ms ({comm.seconds * 1e3:.0f} ms in collectives)  "
                      f"peak {row['peak_mib']:.0f} MiB (weights+grads+Adam {row['state_mib']:.0f} MiB)", flush=True)
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            if ckpt is not None:
                ckpt.poll()
                if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                    path = ckpt.save(step + 1, {"data_rng": gen.get_state()})
                    if rank == 0:
                        print(f"[train] checkpoint {path} ({'async' if args.async_save else 'sync'}): training "
                              f"blocked {ckpt.last_blocking_s * 1e3:.0f} ms", flush=True)
        if ckpt is not None:
            ckpt.close()
        if args.eval_batches and dims.pp == 1:
            egen = torch.Generator().manual_seed(1234)
            held = [trainer.eval_loss(*sample(held_out, args.batch, args.seq, egen)) for _ in range(args.eval_batches)]
            if rank == 0:
                print(f"[train] held-out loss {sum(held) / len(held):.4f} ({args.eval_batches} batches)", flush=True)
                metrics.write(json.dumps(dict(held_out_loss=sum(held) / len(held))) + "\n")
        if metrics is not None:
            metrics.close()
        if not args.no_checkpoint:
            trainer.save_pretrained(os.path.join(args.out, "checkpoint"))
            if rank == 0:
                from training.byte_tokenizer import write_byte_tokenizer
                write_byte_tokenizer(os.path.join(args.out, "checkpoint"))   # token = byte
                print(f"[train] checkpoint: {os.path.join(args.out, 'checkpoint')} (GLM5ForCausalLM.from_pretrained)",
                      flush=True)
        if world > 1:
            # gloo: a process tearing its group down while a peer still uses
            # the connections can abort that peer (std::terminate)
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


def _run_stages(args, config) -> int:
    from training.stage_runner import run_stages
    from training.stages import StageSpecError, load_stages
    if int(os.environ.get("WORLD_SIZE", "1")) != 1 or (args.dp_shard, args.tp, args.pp, args.ep) != (1, 1, 1, 1):
        raise UsageError("--stages runs in one process (no torchrun, dp_shard = tp = pp = ep = 1)")
    if args.lora is not None or args.async_save:
        raise UsageError("--stages: LoRA is set in the spec's [lora] table; --async-save is not supported with it")
    if config.vocab_size < 256:
        raise UsageError(f"--preset {args.preset}: vocab_size {config.vocab_size} cannot hold the 256 byte tokens")
    if args.resume is not None and not os.path.isdir(os.path.join(args.resume, "ckpt")):
        raise UsageError(f"--resume: {args.resume!r} holds no ckpt/ directory of checkpoints")
    try:
        spec = load_stages(args.stages)
        longest = max(s["seq"] + (s["prompt"] + s["completion"] if s["kind"] == "parse" else 0)
                      for s in spec["stages"])
        if longest >= config.max_position_embeddings:
            raise StageSpecError(f"--stages: a stage needs {longest} positions; the preset has "
                                 f"{config.max_position_embeddings}")
        if args.threads:
            torch.set_num_threads(args.threads)
        trainer, _ = run_stages(spec, config, args.out, seed=args.seed, checkpoint_every=args.checkpoint_every,
                                resume=args.resume, eval_batches=max(args.eval_batches, 1))
    except StageSpecError as e:
        raise UsageError(str(e)) from None
    if not args.no_checkpoint:
        trainer.save_pretrained(os.path.join(args.out, "checkpoint"))
    return 0
