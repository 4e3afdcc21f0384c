"""`glm5-lab profile`: run GLM-5 with warm-up, record a torch.profiler trace
of the measured steps, and write report.md (time, FLOPs and bytes per
component, peak memory, expert load, attention recall) with PNG plots; with
--sweep, dsa against dense over sequence lengths.

Model contract (models/glm5): GLM5ForCausalLM(config, attn=, fused=) or
.from_pretrained(dir, attn=, fused=); model(ids) -> logits [B,S,V];
model(ids, cache=model.new_cache(B, max_tokens), logits_to_keep=1);
model.last_routing (per MoE layer: int ids [T, top_k]) and
model.last_selection (per attention layer) after a forward; components named
by glm5_ops.nvtx ranges (profiling/components.py).

On a GPU the measured steps run between torch.cuda.profiler.start()/stop()
(cudaProfilerStart/Stop), so `nsys profile --capture-range=cudaProfilerApi`
captures exactly them; the command is printed and written to the report.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time

import torch

from glm5_ops import nvtx

from . import measure, plots, profile_report
from .args import (UsageError, add_quantization_arg, check_quantization, lengths, nonnegative_int, positive_int,
                   quantize_for)
from .components import STEP_RANGE, breakdown
from .flops import OpCounter

UNDER_NSYS = "GLM5_LAB_UNDER_NSYS"  # set by the printed nsys command
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(subparsers):
    from models.glm5 import PRESETS
    from models.glm5.attention_modes import ATTENTION_MODES, DEFAULT_ATTENTION

    p = subparsers.add_parser("profile", help="profile the network: trace, per-component report, plots",
                              description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="configuration preset (default tiny)")
    src.add_argument("--checkpoint", metavar="DIR", help="an HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence (decode: the context length)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--mode", choices=measure.MODES, default="prefill")
    p.add_argument("--attn", choices=sorted(ATTENTION_MODES), default=DEFAULT_ATTENTION,
                   help="attention mode (models/glm5/attention_modes.py)")
    p.add_argument("--steps", type=positive_int, default=3, help="measured steps")
    p.add_argument("--warmup", type=nonnegative_int, default=1, help="warm-up steps before measuring")
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/profile-<preset>-<mode>-<attn>-<time>)")
    p.add_argument("--sweep", type=lengths, metavar="L1,L2,...",
                   help="also time dsa and dense at these sequence lengths (plots and the crossover)")
    p.add_argument("--unfused", action="store_true",
                   help="run the unfused ops so top-k, dispatch and combine get their own rows")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="decode: the step through model.compile_decode() (one torch.compile graph); warm-up >= 3 "
                        "compiles it, and the FLOP count runs eager (the same ops)")
    add_quantization_arg(p)
    p.set_defaults(parser=p)
    return p


def _device(args) -> torch.device:
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _config(args):
    from models.glm5 import GLM5Config, preset

    if not args.checkpoint:
        return preset(args.preset or "tiny")
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        raise UsageError(f"--checkpoint {args.checkpoint}: no config.json there (expected an HF checkpoint folder)")
    try:
        return GLM5Config.from_json(args.checkpoint)
    except ValueError as e:
        raise UsageError(f"--checkpoint {args.checkpoint}: {e}") from None


def _check_fits(cfg, device, dtype, name) -> None:
    """Refuses a model whose weights alone exceed the memory there is (counted on the meta device)."""
    from models.glm5 import GLM5ForCausalLM, count_parameters

    with torch.device("meta"):
        need = count_parameters(GLM5ForCausalLM(cfg)) * torch.finfo(dtype).bits // 8
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.9 * have:
        raise UsageError(f"--preset/--checkpoint {name}: the weights alone take {need / 2**30:.1f} GiB in {dtype}, "
                         f"more than the {have / 2**30:.1f} GiB free on {device.type}; profile a smaller preset "
                         "(glm5-lab inspect counts the full model without building it)")


def _model_factory(args, device, dtype):
    from models.glm5 import GLM5ForCausalLM

    def build(attn):
        kwargs = dict(attn=attn, fused=not args.unfused)
        torch.manual_seed(args.seed)
        if args.checkpoint:
            model = GLM5ForCausalLM.from_pretrained(args.checkpoint, **kwargs)
        else:
            model = GLM5ForCausalLM(_config(args), **kwargs)
        model = model.to(device=device, dtype=dtype)
        quantize_for(args, model, device)
        return model
    return build


def _is_weight(buffer_name: str) -> bool:
    """An int8 module's weight or scale (models/glm5/quantization.py's buffer names)."""
    return buffer_name.rsplit(".", 1)[-1] in ("qweight", "scale", "gate_up_q", "gate_up_scale", "down_q", "down_scale")


def _recall_text(counter: OpCounter) -> str:
    """The recall sentence for the report, from the captured attention call."""
    import glm5_ops

    if counter.attention_args is None:
        return ("Not measured: layer 0's `attn/core` range ran no glm5 sparse or block-sparse attention op. "
                "With dsa that means the sequence fits in index_topk: every visible key is selected (recall 1 "
                "by construction) and the model runs dense attention.")
    name, a = counter.attention_args
    if name == "glm5::sparse_attention_fwd":
        sel, what = a["indices"], f"token selection {list(a['indices'].shape)}"
    else:
        sel = (a["kv_num_blocks"], a["kv_indices"], a["block_size"])
        what = f"block mask (block {a['block_size']}, kv_indices {list(a['kv_indices'].shape)})"
    # Causal always: in a causal LM no query may see a later key, whatever flag the kernel was given.
    r = glm5_ops.attention_recall(a["q"], a["k"], a["v"], sel, scale=a["scale"], causal=True, q_start=a["q_start"])
    rec = r.recall.flatten()
    return (f"Layer 0, from the inputs of its `{name}` call (q {list(a['q'].shape)}, k {list(a['k'].shape)}, "
            f"{what}), against dense causal attention over the same keys (glm5_ops.attention_recall): "
            f"mean recall (softmax mass kept) **{r.mean_recall:.4f}**, minimum {float(rec.min()):.4f}, "
            f"10th percentile {float(rec.quantile(0.1)):.4f}; output relative error {r.output_rel_err:.4f}.")


def _expert_load(model):
    """(layer name, MaxVio) and the load per expert for each MoE layer of the last recorded forward."""
    from glm5_ops.balance import expert_load, max_violation

    cfg = model.config
    routing = sorted((layer, ids) for layer, ids in (model.last_routing or {}).items() if ids is not None)
    loads = [expert_load(ids.long().cpu(), cfg.n_routed_experts) for _, ids in routing]
    return ([(f"layer{layer}", float(max_violation(load))) for (layer, _), load in zip(routing, loads)],
            [load.tolist() for load in loads])


def _capture_attention(runner) -> OpCounter:
    """One cache-free forward of the step's tokens, keeping layer 0's core
    attention inputs: keys in logical order, so the recall is over positions
    (the cached path reads a paged pool through physical slots)."""
    counter = OpCounter(capture_layer=0)
    with torch.inference_mode(), counter:
        runner.model(runner.ids[:, :runner.seq])
    return counter


def _sweep(args, build_model, vocab, device, out, model_name, log) -> dict:
    """The profiled mode (dsa when that is the baseline) against the baseline
    (dense) over args.sweep: times, peaks, crossovers, two plots."""
    from models.glm5.attention_modes import ATTENTION_MODES, BASELINE_ATTENTION, DEFAULT_ATTENTION

    baseline = BASELINE_ATTENTION
    modes = [args.attn if ATTENTION_MODES[args.attn].selects_keys else DEFAULT_ATTENTION, baseline]
    log(f"sweep {modes[0]} vs {baseline} over {args.sweep}")
    results = measure.sweep(build_model, modes, args.sweep, mode=args.mode, batch=args.batch, vocab=vocab,
                            device=device, warmup=args.warmup, steps=args.steps, log=log, seed=args.seed)
    a, d = results[modes[0]], results[baseline]
    t_sentence, t_cross = measure.crossover(args.sweep, [p["ms"] for p in d], [p["ms"] for p in a])
    m_sentence, m_cross = measure.crossover(args.sweep, [p["peak_bytes"] for p in d], [p["peak_bytes"] for p in a])
    sweep = dict(lengths=args.sweep, results=results, warmup=args.warmup, steps=args.steps,
                 time_sentence=f"{modes[0]} against {baseline}: {t_sentence}", time_crossover=t_cross,
                 memory_sentence=f"{modes[0]} against {baseline}: {m_sentence}", memory_crossover=m_cross)
    plots.sweep_lines(results, "ms", "ms per step", os.path.join(out, "sweep_time.png"),
                      f"{model_name} {args.mode}: step time", t_cross)
    plots.sweep_lines(results, "peak_bytes", "peak MiB", os.path.join(out, "sweep_memory.png"),
                      f"{model_name} {args.mode}: peak memory", m_cross, scale=1 / 2**20)
    print(f"crossover (time): {sweep['time_sentence']}\n"
          f"crossover (peak memory): {sweep['memory_sentence']}", flush=True)
    return sweep


def run(args) -> int:
    t0 = time.time()

    def log(msg):
        print(f"[glm5-lab profile {time.time() - t0:7.1f}s] {msg}", flush=True)

    device = _device(args)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    build_model = _model_factory(args, device, dtype)
    model_name = args.checkpoint or args.preset or "tiny"
    cfg = _config(args)
    need = args.seq + (args.warmup + args.steps + 1 if args.mode == "decode" else 0)
    for n in [need] + (args.sweep or []):
        if n > cfg.max_position_embeddings:
            raise UsageError(f"--seq/--sweep: {n} tokens exceed the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
    check_quantization(args, device)
    if args.compile and args.mode != "decode":
        raise UsageError(f"--compile: --mode decode only (compile_decode() compiles the one-token step), "
                         f"got --mode {args.mode}")
    _check_fits(cfg, device, dtype, model_name)
    stem = os.path.basename(model_name.rstrip("/"))
    out = args.out or os.path.join("runs", f"profile-{stem}-{args.mode}-{args.attn}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    command = getattr(args, "command", "glm5-lab profile")

    log(f"building {model_name} (attn={args.attn}, {'unfused' if args.unfused else 'fused'}) on {device}, {dtype}"
        + (f", quantised {args.quantization}" if args.quantization else ""))
    model = build_model(args.attn)
    quantization = getattr(model, "quantization", None)
    if quantization and args.mode == "train":
        raise UsageError(f"--quantization/--checkpoint: the model is int8 ({quantization['mode']}) and the int8 "
                         "ops are inference only (no backward); profile --mode prefill or decode")
    # int8 weights are buffers (Int8Linear.qweight), so count them too when quantised
    weights = list(model.parameters()) + ([b for n, b in model.named_buffers() if _is_weight(n)] if quantization
                                          else [])
    params = sum(p.numel() for p in weights)
    param_bytes = sum(p.numel() * p.element_size() for p in weights)
    runner = measure.Runner(model, args.mode, batch=args.batch, seq=args.seq, vocab=cfg.vocab_size, device=device,
                            total_steps=args.warmup + args.steps + 1, seed=args.seed)
    tokens_per_step = runner.tokens_per_step
    if args.compile:
        log("compile_decode(): the warm-up steps compile the decode step (about a minute on 2 cores)")
        model.compile_decode()

    nvtx.enable(True)
    try:
        measure.timed_steps(runner, args.warmup, lambda i, t: log(f"warm-up {i + 1}/{args.warmup}: {t * 1e3:.1f} ms"))
        nsys = None
        if device.type == "cuda":
            argv = command.split(" ", 1)[1] if " " in command else "profile"
            nsys = (f"{UNDER_NSYS}=1 nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi "
                    f"--capture-range-end=stop -o {shlex.quote(os.path.join(out, 'glm5'))} "
                    f"{shlex.quote(sys.executable)} -m profiling {argv}")
            log(f"Nsight Systems capture of exactly the measured steps:\n    {nsys}")
        # Under nsys, CUPTI belongs to Nsight: torch.profiler then records CPU only.
        cuda_trace = device.type == "cuda" and os.environ.get(UNDER_NSYS) != "1"
        resting = measure.reset_peak_memory(device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda_trace:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        wall = []
        with torch.profiler.profile(activities=activities) as prof:
            if device.type == "cuda":
                torch.cuda.profiler.start()
            for i in range(args.steps):
                t = time.perf_counter()
                with torch.profiler.record_function(f"{STEP_RANGE}{i}"):
                    runner.step()
                wall.append(time.perf_counter() - t)
                runner.zero_grad()
                log(f"step {i + 1}/{args.steps}: {wall[-1] * 1e3:.1f} ms")
            if device.type == "cuda":
                torch.cuda.profiler.stop()
        peak, peak_what = measure.peak_memory(device)
        trace = os.path.join(out, "trace.json")
        prof.export_chrome_trace(trace)
        log(f"trace -> {trace}")
        bd = breakdown(prof.events(), device_time=cuda_trace)
        del prof

        log("counting FLOPs and bytes per component (one more step, routing recorded)")
        counter = OpCounter(capture_layer=None)
        model.record = True  # the model keeps last_routing / last_selection
        compiled, model._decode_layers = model._decode_layers, None   # a dispatch mode sees eager ops only
        try:
            with counter:
                runner.step()
        finally:
            model.record, model._decode_layers = False, compiled
        runner.zero_grad()
        maxvio, loads = _expert_load(model)
        log("measuring the memory read bandwidth (for the step's bound)")
        read_gbs = measure.read_bandwidth_gbs(device)
        recall = (f"{args.attn} attention attends to every visible key: nothing is selected, no recall to "
                  "measure.")
        if model.attention_mode.selects_keys:
            log("attention recall of layer 0's selection (one cache-free forward)")
            recall = _recall_text(_capture_attention(runner))
    finally:
        nvtx.enable(False)

    sweep = None
    if args.sweep:
        del runner, model  # the sweep builds its own models
        sweep = _sweep(args, build_model, cfg.vocab_size, device, out, model_name, log)

    title = f"{model_name} {args.mode} attn={args.attn} seq={args.seq} batch={args.batch}" + (
        f" {quantization['mode']}" if quantization else "")
    if loads:
        plots.expert_load(loads, maxvio, os.path.join(out, "expert_load.png"), f"expert load: {title}")
    device_info = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    result = dict(model_name=model_name, mode=args.mode, attn=args.attn, fused=not args.unfused, command=command,
                  quantization=quantization and {"mode": quantization["mode"], "skip": quantization["skip"]},
                  device=str(device), device_info=device_info, dtype=str(dtype).replace("torch.", ""),
                  torch=torch.__version__, batch=args.batch, seq=args.seq, warmup=args.warmup,
                  nvtx_backend=nvtx.backend_name(), params=params, param_bytes=param_bytes,
                  tokens_per_step=tokens_per_step,
                  step_wall_s=wall, breakdown=bd, read_gbs=read_gbs, flops=dict(counter.flops), bytes=dict(counter.bytes),
                  peak_bytes=peak, peak_what=peak_what, resting_bytes=resting, maxvio=maxvio, expert_load=loads,
                  num_experts=cfg.n_routed_experts,
                  top_k=getattr(cfg, "num_experts_per_tok", None), recall_text=recall, sweep=sweep, nsys_command=nsys)
    rows = profile_report.write(os.path.join(out, "report.md"), result)
    plots.component_bars(rows, bd.clock, os.path.join(out, "components.png"), title)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({**{k: v for k, v in result.items() if k != "breakdown"}, "components": rows,
                   "step_ms": bd.step_us / 1e3, "clock": bd.clock,
                   "outside_ops_ms": None if bd.outside_ops_us is None else bd.outside_ops_us / 1e3}, f, indent=1)
    print(profile_report.component_table(rows, train=args.mode == "train"))
    print(profile_report.bound_sentence(rows, bd.step_us, read_gbs, bd.outside_ops_us))
    log(f"report -> {os.path.join(out, 'report.md')} (plots and trace.json beside it)")
    return 0
