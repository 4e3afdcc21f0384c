"""report.md for `glm5-lab profile`: the component table, memory, expert
load, attention recall, the sweep. Numbers come in; this file only formats."""
from __future__ import annotations

from .components import NAMES, OTHER

# In fused mode one kernel does several components' work inside one range
# (the model puts indexer_topk in attn/topk, fused_moe in moe/experts): its
# time, FLOPs and bytes are reported in the row of the component it starts
# from, and the absorbed rows say where they went.
FUSED_INTO = {"top-k": "indexer", "dispatch": "experts", "combine": "experts"}
FUSED_NOTES = {"top-k": "fused into indexer (indexer_topk): counted in the indexer row",
               "dispatch": "fused into experts (fused_moe): counted in the experts row",
               "combine": "fused into experts (fused_moe): counted in the experts row"}
ATTN_NOTES = {"dense": {"indexer": "none in dense attention", "top-k": "none in dense attention"},
              "block_sparse": {"indexer": "none: block_topk_mask runs inside core attention",
                               "top-k": "none: block selection runs inside core attention"}}


def _f(x, digits=3):
    return f"{x:.{digits}f}"


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def component_rows(bd, flops: dict, bytes_: dict, *, fused: bool, attn: str) -> list[dict]:
    """One row per component (profiling.components.NAMES order), fused work folded as above."""
    def per(d):
        return {name: d.get(name, 0) for name in NAMES}
    fwd, bwd, fl, by = per(bd.forward_us), per(bd.backward_us), per(flops), per(bytes_)
    counts = per(bd.range_counts)
    if fused:
        for src, dst in FUSED_INTO.items():
            for d in (fwd, bwd, fl, by):
                d[dst] += d[src]
                d[src] = 0
    rows = []
    for name in NAMES:
        t_us = fwd[name] + bwd[name]
        if name in ATTN_NOTES.get(attn, {}):
            note = ATTN_NOTES[attn][name]
        elif fused and name in FUSED_NOTES:
            note = FUSED_NOTES[name]
        elif name == OTHER:
            note = "step time outside every component range"
        elif not counts[name]:
            note = "no range in this configuration" + (" (model(ids) does not run MTP)" if name == "MTP" else "")
        else:
            note = ""
        f, b = fl[name], by[name]
        rows.append(dict(component=name, ranges=counts[name], ms=t_us / 1e3, backward_ms=bwd[name] / 1e3,
                         share=t_us / bd.step_us if bd.step_us > 0 else 0.0, flop=f, bytes=b,
                         gflops=f / 1e9 / (t_us / 1e6) if t_us > 0 and f else None,
                         gbs=b / 1e9 / (t_us / 1e6) if t_us > 0 and b else None, note=note))
    return rows


def component_table(rows, *, train: bool) -> str:
    head = ["component", "ranges/step", "ms/step", "share"] + (["of which backward ms"] if train else []) + \
           ["FLOP/step", "GFLOP/s", "bytes/step", "GB/s", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["component"], f"{r['ranges']:g}", _f(r["ms"]), f"{r['share']:.1%}"]
        if train:
            cells.append(_f(r["backward_ms"]))
        cells += [_si(r["flop"]), "" if r["gflops"] is None else f"{r['gflops']:.2f}", _si(r["bytes"], "B"),
                  "" if r["gbs"] is None else f"{r['gbs']:.2f}", r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    total_ms = sum(r["ms"] for r in rows)
    total_share = sum(r["share"] for r in rows)
    lines.append(f"| **total** | | {_f(total_ms)} | {total_share:.1%} |" + (" |" if train else "") +
                 f" {_si(sum(r['flop'] for r in rows))} | | {_si(sum(r['bytes'] for r in rows), 'B')} | | |")
    return "\n".join(lines)


def bound_sentence(rows, step_us: float, read_gbs: float, outside_ops_us: float | None = None) -> str:
    """The step against its memory bound (the bytes column at the measured read
    bandwidth) and the framework overhead: time outside every component range and,
    on the CPU, time between operator calls."""
    total = sum(r["bytes"] for r in rows)
    bound_ms = total / (read_gbs * 1e9) * 1e3
    step_ms = step_us / 1e3
    other = next((r for r in rows if r["component"] == OTHER), None)
    text = (f"Bound: {_si(total, 'B')} per step at the measured read bandwidth {read_gbs:.1f} GB/s "
            f"= {bound_ms:.2f} ms; the step takes {step_ms:.2f} ms, "
            f"{step_ms / bound_ms:.1f}x the bound." if bound_ms > 0 else "Bound: no bytes counted.")
    if other is not None:
        text += (f" Framework overhead (step time outside every component range): {other['ms']:.2f} ms, "
                 f"{other['share']:.1%}.")
    if outside_ops_us is not None and step_us > 0:
        text += (f" Time outside every operator call (Python, module calls, dispatch around the ops): "
                 f"{outside_ops_us / 1e3:.2f} ms, {outside_ops_us / step_us:.1%}.")
    return text


def write(path: str, r: dict) -> None:
    """r: everything profile_cmd measured (see profile_cmd.run for the keys)."""
    bd = r["breakdown"]
    train = r["mode"] == "train"
    rows = component_rows(bd, r["flops"], r["bytes"], fused=r["fused"], attn=r["attn"])
    out = [f"# glm5-lab profile: {r['model_name']}, {r['mode']}, attn={r['attn']}, "
           f"{'fused' if r['fused'] else 'unfused'} kernels", "",
           f"Command: `{r['command']}`", "",
           f"- device: {r['device']} ({r['device_info']}), dtype {r['dtype']}, torch {r['torch']}",
           "- kernels: " + ("fused (indexer_topk, fused_moe)" if r["fused"] else
                            "unfused (indexer_scores then topk_indices; moe_dispatch, expert GEMMs, moe_combine)"),
           f"- batch {r['batch']}, seq {r['seq']}, {r['warmup']} warm-up + {bd.steps} measured steps; "
           f"NVTX backend: {r['nvtx_backend']}",
           f"- parameters: {r['params'] / 1e6:.2f} M",
           *([f"- quantisation: {r['quantization']['mode']}, int8 weights outside the skip list "
              f"({', '.join(r['quantization']['skip']) or 'none'}); docs/INT8.md"] if r.get("quantization") else []),
           f"- mean step: {bd.step_us / 1e3:.3f} ms ({bd.clock}), "
           f"{r['tokens_per_step'] / (bd.step_us / 1e6):.1f} tokens/s "
           f"({r['tokens_per_step']} tokens per step); wall per step under the profiler: "
           + ", ".join(f"{t * 1e3:.2f}" for t in r["step_wall_s"]) + " ms",
           "", "## Time per component", "",
           f"Self time inside each component's ranges ({bd.clock}), per step, averaged over the measured steps; "
           "a component's time excludes component ranges nested in it, and 'other' is the step's time outside "
           "every component range, so the shares sum to 100%. "
           + ("Backward time goes to the component of the forward op that created the autograd node. " if train else "")
           + "FLOPs count useful work (visible attention pairs, selected keys, routed tokens); bytes are the "
           "distinct tensors each op reads and writes (a lower bound on traffic), counted in one extra step; "
           "an op that reads part of a tensor counts that part (a fused MoE the chosen experts' weights, "
           "sparse attention the selected cache rows, an embedding the gathered rows: profiling/flops.py).", "",
           component_table(rows, train=train), "",
           bound_sentence(rows, bd.step_us, r["read_gbs"], bd.outside_ops_us), "",
           "![component breakdown](components.png)", "",
           "## Memory", "",
           f"- peak during the measured steps: {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_what']}), "
           f"{(r['peak_bytes'] - r['resting_bytes']) / 2**20:.1f} MiB above the {r['resting_bytes'] / 2**20:.1f} MiB "
           "held before them (weights, the decode context, the runtime)",
           f"- parameters: {r['param_bytes'] / 2**20:.1f} MiB"
           + (" (int8 weights and their scales included)" if r.get("quantization") else ""), ""]
    out += ["## Expert load", ""]
    if r["expert_load"]:
        out += [f"Tokens routed per expert in the counting step ({r['num_experts']} experts, top-{r['top_k']}); "
                "MaxVio = (max load - mean) / mean.", "",
                "| MoE layer | MaxVio | min | max | load per expert |", "|---|---|---|---|---|"]
        for (name, vio), load in zip(r["maxvio"], r["expert_load"]):
            out.append(f"| {name} | {vio:.3f} | {min(load)} | {max(load)} | {' '.join(str(x) for x in load)} |")
        out += ["", "![expert load](expert_load.png)", ""]
    else:
        out += ["The model reported no routing (model.last_routing is empty): no MoE layer ran.", ""]
    out += ["## Attention recall of the selection", "", r["recall_text"], ""]
    if r.get("sweep"):
        s = r["sweep"]
        out += ["## Sweep: dsa vs dense", "",
                f"{r['mode']} with batch {r['batch']}, {s['warmup']} warm-up + {s['steps']} timed steps per point, "
                "ranges off (the plain network), one model per attention mode; peak = memory above what the process "
                "held before the timed steps.", "",
                "| seq | " + " | ".join(f"{a} ms/step | {a} peak MiB" for a in s["results"]) + " |",
                "|---|" + "---|---|" * len(s["results"])]
        for i, seq in enumerate(s["lengths"]):
            out.append(f"| {seq} | " + " | ".join(f"{pts[i]['ms']:.2f} | {pts[i]['peak_bytes'] / 2**20:.1f}"
                                                  for pts in s["results"].values()) + " |")
        out += ["", f"- time: {s['time_sentence']}", f"- peak memory: {s['memory_sentence']}", "",
                "![sweep time](sweep_time.png)", "", "![sweep memory](sweep_memory.png)", ""]
    out += ["## Files", "", "- `trace.json`: Chrome trace of the measured steps (open in https://ui.perfetto.dev "
            "or chrome://tracing); the component ranges appear as user annotations.",
            "- `report.json`: the numbers above, machine-readable.", ""]
    if r.get("nsys_command"):
        out += ["## Nsight Systems", "",
                "The measured steps sit between cudaProfilerStart/Stop; this captures exactly them:",
                "", "```", r["nsys_command"], "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))
    return rows
