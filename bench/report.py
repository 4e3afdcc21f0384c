"""Turns pytest-benchmark results into the lab's table: each group holds one
op at one shape, "ours" against its "baseline" measured in the same run.

Every benchmark sets extra_info: role ("ours" | "baseline"), and where
counted flops, bytes and ceiling ("matmul" | "bandwidth"); ceilings are
measured by bench/ceilings.py in the same run.

    python bench/report.py RUN.json [--compare OLD.json] [--threshold 0.1]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def rows_from_json(data: dict) -> list[dict]:
    rows = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        rows.append(dict(group=b["group"], name=b["name"], fullname=b.get("fullname", ""),
                         median=b["stats"]["median"], **info))
    return rows


def family_of(row: dict) -> str:
    """The op family: the suite file a benchmark comes from (bench/test_bench_moe.py -> "moe")."""
    path = row.get("fullname", "").split("::")[0]
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    return stem.removeprefix("test_bench_") if stem.startswith("test_bench_") else row["group"].split()[0]


def split_group(group: str) -> tuple[str, str]:
    """'sparse_attention fwd S=T=4096 ...' -> ('sparse_attention fwd', 'S=T=4096 ...'): the op is
    the leading words up to the first one holding a digit or '='."""
    words = group.split()
    for i, w in enumerate(words):
        if i and any(c.isdigit() or c == "=" for c in w):
            return " ".join(words[:i]), " ".join(words[i:])
    return group, ""


def _rates(m: dict, machine: dict | None):
    t = m["median"]
    gflops = m["flops"] / t / 1e9 if m.get("flops") else None
    gbs = m["bytes"] / t / 1e9 if m.get("bytes") else None
    frac = ""
    if machine and m.get("ceiling") == "matmul" and gflops:
        frac = f"{gflops / machine['matmul_gflops']:.0%} of sgemm"
    elif machine and m.get("ceiling") == "bandwidth" and gbs:
        frac = f"{gbs / machine['bandwidth_gbs']:.0%} of copy BW"
    return ("" if gflops is None else f"{gflops:.1f}"), ("" if gbs is None else f"{gbs:.2f}"), frac


def _impl(m) -> str:
    return "" if m is None else m.get("impl", m["name"])


def _ms(m) -> str:
    return "" if m is None else f"{m['median'] * 1e3:.3f}"


def family_table(rows: list[dict], machine: dict | None = None) -> str:
    """One op family: a row per group (ours against its baseline, ratio = baseline / ours, ours'
    throughput and fraction of the ceiling), then the other implementations measured."""
    groups = defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    lines = ["| op | shape | ours ms | baseline ms | ratio | GFLOP/s | GB/s | of ceiling |", "|" + "---|" * 8]
    variants, legend = [], {}
    for group, members in groups.items():
        op, shape = split_group(group)
        ours = next((m for m in members if m.get("role") == "ours"), None)
        base = next((m for m in members if m.get("role") == "baseline"), None)
        ratio = f"{base['median'] / ours['median']:.2f}x" if ours and base else ""
        lines.append(f"| {op} | {shape} | {_ms(ours)} | {_ms(base)} | {ratio} | " + " | ".join(
            _rates(ours, machine) if ours else ("", "", "")) + " |")
        legend.setdefault(op, (_impl(ours), _impl(base)))
        for m in members:
            if m is not ours and m is not base:
                vs = f"{base['median'] / m['median']:.2f}x" if base else ""
                variants.append(f"| {op} | {shape} | {_impl(m)} | {_ms(m)} | {vs} | "
                                + " | ".join(_rates(m, machine)) + " |")
    lines.append("")
    lines += [f"- {op}: ours = {o or '?'}; baseline = {b or '?'}" for op, (o, b) in legend.items()]
    if variants:
        lines += ["", "Other implementations in the same groups (ratio = baseline / this):", "",
                  "| op | shape | impl | ms | ratio | GFLOP/s | GB/s | of ceiling |", "|" + "---|" * 8]
        lines += variants
    return "\n".join(lines)


def family_tables(rows: list[dict], machine: dict | None = None) -> str:
    """Every family's table under a heading, in the order the families first appear."""
    families = defaultdict(list)
    for r in rows:
        families[family_of(r)].append(r)
    out = []
    for family, members in families.items():
        out += [f"### {family}", "", family_table(members, machine), ""]
    return "\n".join(out)


def regressions(new: list[dict], old: list[dict], threshold: float = 0.10) -> tuple[list[str], int]:
    """(one line per benchmark (group, impl) whose median is more than `threshold` slower
    than in `old`, how many benchmarks the two runs share)."""
    before = {(r["group"], r.get("impl", r["name"])): r["median"] for r in old}
    out, shared = [], 0
    for r in new:
        key = (r["group"], r.get("impl", r["name"]))
        if key not in before:
            continue
        shared += 1
        if r["median"] > before[key] * (1 + threshold):
            out.append(f"REGRESSION {key[0]} / {key[1]}: {before[key] * 1e3:.3f} ms -> {r['median'] * 1e3:.3f} ms "
                       f"({r['median'] / before[key] - 1:+.0%})")
    return out, shared


def compare_report(new: list[dict], old: list[dict], threshold: float, old_name: str) -> tuple[str, bool]:
    """The comparison's printout and whether anything regressed."""
    found, shared = regressions(new, old, threshold)
    if not shared:
        return f"no benchmark in common with {old_name}: nothing compared", False
    if found:
        return "\n".join(found + [f"{len(found)} of {shared} benchmarks regressed by more than "
                                  f"{threshold:.0%} against {old_name}"]), True
    return f"no regression over {threshold:.0%} in {shared} benchmarks against {old_name}", False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="pytest-benchmark JSON of this run")
    p.add_argument("--compare", help="an earlier run's JSON: flag regressions against it")
    p.add_argument("--threshold", type=float, default=0.10, help="slowdown that counts as a regression (0.10 = 10%%)")
    a = p.parse_args(argv)
    data = json.load(open(a.run))
    print(family_tables(rows_from_json(data), data.get("machine_info", {}).get("glm5_ceilings")))
    if a.compare:
        text, regressed = compare_report(rows_from_json(data), rows_from_json(json.load(open(a.compare))),
                                         a.threshold, a.compare)
        print(text)
        return 1 if regressed else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
