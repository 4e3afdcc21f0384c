"""report.md for `glm5-lab profile`: the component table, memory, expert
load, attention recall, the sweep. Numbers come in; this file only formats."""
from __future__ import annotations

from .components import NAMES, OTHER

# In fused mode the fused kernel runs inside one range; the rows it absorbs say so.
FUSED_NOTES = {"top-k": "fused into indexer (indexer_topk)",
               "dispatch": "fused into experts (fused_moe)",
               "combine": "fused into experts (fused_moe)"}
DENSE_NOTES = {"indexer": "none in dense attention", "top-k": "none in dense attention"}


def _f(x, digits=3):
    return f"{x:.{digits}f}"


def component_rows(bd, flops: dict, bytes_: dict, *, fused: bool, attn: str) -> list[dict]:
    rows = []
    for name in NAMES:
        t_us = bd.total_us(name)
        note = ""
        if fused and name in FUSED_NOTES:
            note = FUSED_NOTES[name]
        elif attn == "dense" and name in DENSE_NOTES:
            note = DENSE_NOTES[name]
        elif name == "top-k" and attn == "block_sparse":
            note = "block selection runs in the indexer range" if not bd.range_counts.get(name) else ""
        elif name == OTHER:
            note = "step time outside every component range"
        elif not bd.range_counts.get(name):
            note = "no range in this configuration"
        f, b = flops.get(name, 0), bytes_.get(name, 0)
        rows.append(dict(component=name, ranges=bd.range_counts.get(name, 0), ms=t_us / 1e3,
                         backward_ms=bd.backward_us.get(name, 0.0) / 1e3, share=bd.share(name),
                         gflop=f / 1e9, gflops=(f / 1e9) / (t_us / 1e6) if t_us > 0 and f else None,
                         mb=b / 1e6, gbs=(b / 1e9) / (t_us / 1e6) if t_us > 0 and b else None, note=note))
    return rows


def component_table(rows, *, train: bool) -> str:
    head = ["component", "ranges/step", "ms/step", "share"] + (["of which backward ms"] if train else []) + \
           ["GFLOP/step", "GFLOP/s", "MB/step", "GB/s", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["component"], f"{r['ranges']:g}", _f(r["ms"]), f"{r['share']:.1%}"]
        if train:
            cells.append(_f(r["backward_ms"]))
        cells += [_f(r["gflop"], 4), "" if r["gflops"] is None else f"{r['gflops']:.2f}", _f(r["mb"], 2),
                  "" if r["gbs"] is None else f"{r['gbs']:.2f}", r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    total_ms = sum(r["ms"] for r in rows)
    total_share = sum(r["share"] for r in rows)
    lines.append(f"| **total** | | {_f(total_ms)} | {total_share:.1%} |" + (" |" if train else "") +
                 f" {_f(sum(r['gflop'] for r in rows), 4)} | | {_f(sum(r['mb'] for r in rows), 2)} | | |")
    return "\n".join(lines)


def write(path: str, r: dict) -> None:
    """r: everything profile_cmd measured (see profile_cmd.run for the keys)."""
    bd = r["breakdown"]
    train = r["mode"] == "train"
    rows = component_rows(bd, r["flops"], r["bytes"], fused=r["fused"], attn=r["attn"])
    out = [f"# glm5-lab profile: {r['model_name']}, {r['mode']}, attn={r['attn']}, "
           f"{'fused' if r['fused'] else 'unfused'} kernels", "",
           f"Command: `{r['command']}`", "",
           f"- device: {r['device']} ({r['device_info']}), dtype {r['dtype']}, torch {r['torch']}",
           f"- kernels: {'fused (indexer_topk, fused_moe)' if r['fused'] else 'unfused (indexer_scores then topk_indices; moe_dispatch, expert GEMMs, moe_combine)'}",
           f"- batch {r['batch']}, seq {r['seq']}, {r['warmup']} warm-up + {bd.steps} measured steps; "
           f"NVTX backend: {r['nvtx_backend']}",
           f"- parameters: {r['params'] / 1e6:.2f} M",
           f"- mean step: {bd.step_us / 1e3:.3f} ms ({bd.clock}), {r['tokens_per_step'] / (bd.step_us / 1e6):.1f} tokens/s "
           f"({r['tokens_per_step']} tokens per step); wall per step under the profiler: "
           + ", ".join(f"{t * 1e3:.2f}" for t in r["step_wall_s"]) + " ms",
           "", "## Time per component", "",
           f"Self time inside each component's ranges ({bd.clock}), per step, averaged over the measured steps; "
           "a component's time excludes component ranges nested in it, and 'other' is the step's time outside "
           "every component range, so the shares sum to 100%. "
           + ("Backward time goes to the component of the forward op that created the autograd node. " if train else "")
           + "FLOPs count useful work (visible attention pairs, selected keys, routed tokens); bytes are the "
           "distinct tensors each op reads and writes (a lower bound on traffic), counted in one extra step.", "",
           component_table(rows, train=train), "",
           "![component breakdown](components.png)", "",
           "## Memory", "",
           f"- peak during the measured steps: {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_what']})",
           f"- parameters: {r['param_bytes'] / 2**20:.1f} MiB", ""]
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
                "ranges off (the plain network), one model per attention mode.", "",
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
        out += ["## Nsight Systems", "", "The measured steps sit between cudaProfilerStart/Stop; this captures exactly them:",
                "", "```", r["nsys_command"], "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))
    return rows
