"""Renders the llama.cpp speed runs (runs/llamacpp-speed/*.json, written by
`bench/llamacpp_compare.py speed`) into bench/RESULTS.md's "llama.cpp side by side"
table, a plot and the merged rows:

    python bench/llamacpp_report.py                   # newest row per measurement wins
    (the rows published last, figures/llamacpp_speed.json, count as runs too: a fresh
    clone has no runs/ folder)
    python bench/llamacpp_report.py --runs DIR --no-results   # print only

Each ratio pairs the two engines' rows of one run (the speed command measures
them back to back); a measurement rerun later (decode after a kernel change)
replaces both sides of its pair. A run with --repeat measured each point several
times, the engines alternating: its cells give each engine's median and range.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEGIN, END = "<!-- llamacpp-speed:begin (bench/llamacpp_report.py) -->", "<!-- llamacpp-speed:end -->"
PAIRS = (("fp32", "F32"), ("int8", "Q8_0"), ("int8_head", "Q8_0"))
# int8: the lab's default skip list (fp32 LM head); int8_head: the LM head int8 as in Q8_0
OURS_LABEL = {"fp32": "fp32", "int8": "int8", "int8_head": "int8, LM head int8"}


def load_runs(folder: str) -> list[dict]:
    """Every row of every run in `folder`, oldest run first, each with its run's start and command."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            run = json.load(f)
        if not isinstance(run, dict) or "rows" not in run:
            raise ValueError(f"{path} is not a speed run (no 'rows'); written by an older script?")
        rows += [{**r, "started": run["started"], "run_command": run["command"], "cpu": run.get("cpu", "")}
                 for r in run["rows"]]
    return rows


def load_published(path: str, runs: list[dict]) -> list[dict]:
    """The rows the last report published (figures/llamacpp_speed.json: each measurement's
    newest row, repeats already reduced to their median), less those of runs still in the
    runs folder. A fresh clone has no runs/, so without these a report from one new run
    would drop every other measurement from the table and the plot."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        published = json.load(f)
    have = {r["started"] for r in runs}
    return [r for r in published if r.get("started") not in have]


def latest(rows: list[dict]) -> dict:
    """(engine, precision, task, n) -> the newest run's row; where that run repeated the
    measurement (--repeat), one row whose tok_s is the median of its repeats, with all of
    them in tok_s_all."""
    newest = {}
    for r in rows:      # a run's own rows carry no start yet
        key = (r["engine"], r["precision"], r["task"], r["n"])
        if key not in newest or r.get("started", "") > newest[key][0].get("started", ""):
            newest[key] = [r]
        elif r.get("started", "") == newest[key][0].get("started", ""):
            newest[key].append(r)
    return {key: _median_row(group) for key, group in newest.items()}


def _median_row(group: list[dict]) -> dict:
    if len(group) == 1:
        return group[0]
    values = sorted(r["tok_s"] for r in group)
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return {**group[0], "tok_s": median, "tok_s_all": [r["tok_s"] for r in group], "reps": len(group)}


def speed_table(rows: list[dict]) -> str:
    best = latest(rows)
    keys = sorted({(task, n) for (_, _, task, n) in best}, key=lambda k: (k[0] != "prefill", k[1]))
    head = "| tokens/s, 2 threads |" + "".join(f" ours {OURS_LABEL[p]} | llama.cpp {t} | ours / llama.cpp |" for p, t in PAIRS) + \
        " measured (UTC) |"
    lines = [head, "|---|" + "---|---|---|" * len(PAIRS) + "---|"]
    for task, n in keys:
        label = f"prefill {n:,} tokens" if task == "prefill" else f"decode at depth {n:,}"
        cells, dates = [], set()
        for p, _ in PAIRS:
            o, l = best.get(("ours", p, task, n)), best.get(("llama.cpp", p, task, n))
            mark = " (compiled)" if o and o.get("compiled") else ""   # model.compile_decode(): --compile
            cells += [f"{o['tok_s']:.1f}{mark}{_spread(o)}" if o else "-", f"{l['tok_s']:.1f}{_spread(l)}" if l else "-",
                      f"**{o['tok_s'] / l['tok_s']:.2f}x**" if o and l else "-"]
            dates |= {r["started"][:16] for r in (o, l) if r and "started" in r}
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {', '.join(sorted(dates))} |")
    return "\n".join(lines)


def _spread(row: dict) -> str:
    """' (median of 5: 126-187)' for a repeated measurement, '' for a single one."""
    if "tok_s_all" not in row:
        return ""
    return f" (median of {row['reps']}: {min(row['tok_s_all']):.0f}-{max(row['tok_s_all']):.0f})"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    best = latest(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {("ours", "fp32"): ("tab:blue", "-", "ours fp32"), ("llama.cpp", "fp32"): ("tab:orange", "-", "llama.cpp F32"),
              ("ours", "int8"): ("tab:blue", "--", "ours int8"), ("llama.cpp", "int8"): ("tab:orange", "--", "llama.cpp Q8_0"),
              ("ours", "int8_head"): ("tab:green", ":", "ours int8, LM head int8")}
    for ax, task in zip(axes, ("prefill", "decode")):
        sizes = sorted({n for (_, _, t, n) in best if t == task})
        for (engine, precision), (color, ls, label) in styles.items():
            pts = [(i, best[(engine, precision, task, n)]["tok_s"]) for i, n in enumerate(sizes)
                   if (engine, precision, task, n) in best]
            if pts:
                ax.plot(*zip(*pts), color=color, ls=ls, marker="o", label=label)
        ax.set_xticks(range(len(sizes)), [f"{n:,}" for n in sizes])
        ax.set_xlabel("prompt tokens" if task == "prefill" else "context depth (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{task}, small preset, 2 threads")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_block(text: str, block: str) -> str:
    """text with the part between BEGIN and END replaced by block; both markers must be there."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"RESULTS.md must hold the markers {BEGIN!r} and {END!r} once each, in that order")
    return text[:text.index(BEGIN) + len(BEGIN)] + "\n" + block + "\n" + text[text.index(END):]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=os.path.join(ROOT, "runs", "llamacpp-speed"))
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--figures", default=os.path.join(HERE, "figures"))
    ap.add_argument("--no-results", action="store_true", help="print the table; write nothing")
    args = ap.parse_args(argv)
    runs = load_runs(args.runs)
    rows = load_published(os.path.join(args.figures, "llamacpp_speed.json"), runs) + runs
    if not rows:
        print(f"no speed runs in {args.runs}: run `bench/llamacpp_compare.py speed` first", file=sys.stderr)
        return 1
    table = speed_table(rows)
    print(table)
    if args.no_results:
        return 0
    os.makedirs(args.figures, exist_ok=True)
    png = os.path.join(args.figures, "llamacpp_speed.png")
    plot(rows, png)
    with open(os.path.join(args.figures, "llamacpp_speed.json"), "w") as f:
        json.dump(sorted(latest(rows).values(), key=lambda r: (r["task"], r["n"], r["precision"], r["engine"])),
                  f, indent=1)
    with open(args.results) as f:
        text = f.read()
    with open(args.results, "w") as f:
        f.write(replace_block(text, table + "\n\n![llama.cpp side by side](figures/llamacpp_speed.png)"))
    print(f"-> {args.results}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
