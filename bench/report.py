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
        rows.append(dict(group=b["group"], name=b["name"], median=b["stats"]["median"], **info))
    return rows


def table(rows: list[dict], machine: dict | None = None) -> str:
    groups = defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    head = "| op @ shape | impl | median ms | vs baseline | GFLOP/s | GB/s | of ceiling |\n|---|---|---|---|---|---|---|"
    lines = [head]
    for group, members in groups.items():
        base = [m for m in members if m.get("role") == "baseline"]
        base_t = base[0]["median"] if base else None
        for m in sorted(members, key=lambda m: m.get("role") != "ours"):
            t = m["median"]
            ratio = f"{base_t / t:.2f}x" if base_t and m.get("role") == "ours" else ("1.00x" if m.get("role") == "baseline" else "")
            gflops = m["flops"] / t / 1e9 if m.get("flops") else None
            gbs = m["bytes"] / t / 1e9 if m.get("bytes") else None
            frac = ""
            if machine and m.get("ceiling") == "matmul" and gflops:
                frac = f"{gflops / machine['matmul_gflops']:.0%} of sgemm"
            elif machine and m.get("ceiling") == "bandwidth" and gbs:
                frac = f"{gbs / machine['bandwidth_gbs']:.0%} of copy BW"
            impl = m.get("impl", m["name"])
            lines.append(f"| {group} | {impl} | {t * 1e3:.3f} | {ratio} | "
                         f"{'' if gflops is None else f'{gflops:.1f}'} | {'' if gbs is None else f'{gbs:.2f}'} | {frac} |")
    return "\n".join(lines)


def regressions(new: list[dict], old: list[dict], threshold: float = 0.10) -> list[str]:
    """Benchmarks (group/impl) at least `threshold` slower than in `old`."""
    before = {(r["group"], r.get("impl", r["name"])): r["median"] for r in old}
    out = []
    for r in new:
        key = (r["group"], r.get("impl", r["name"]))
        if key in before and r["median"] > before[key] * (1 + threshold):
            out.append(f"REGRESSION {key[0]} / {key[1]}: {before[key] * 1e3:.3f} ms -> {r['median'] * 1e3:.3f} ms "
                       f"({r['median'] / before[key] - 1:+.0%})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="pytest-benchmark JSON of this run")
    p.add_argument("--compare", help="an earlier run's JSON: flag regressions against it")
    p.add_argument("--threshold", type=float, default=0.10, help="slowdown that counts as a regression (0.10 = 10%%)")
    a = p.parse_args(argv)
    data = json.load(open(a.run))
    print(table(rows_from_json(data), data.get("machine_info", {}).get("glm5_ceilings")))
    if a.compare:
        found = regressions(rows_from_json(data), rows_from_json(json.load(open(a.compare))), a.threshold)
        print("\n".join(found) if found else f"no regression over {a.threshold:.0%} against {a.compare}")
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
