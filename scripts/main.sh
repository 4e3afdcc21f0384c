#!/usr/bin/env bash
# The README's main job: install and compile (scripts/setup.sh), then profile a
# tiny GLM-5 end to end on this machine with glm5-lab: per-component table,
# torch.profiler trace (Perfetto), plots, and dsa vs dense over 5 lengths.
# Extra arguments go to `glm5-lab profile` (e.g. --preset small --seq 2048).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=runs/main
echo "[main] profiling the tiny GLM-5 (prefill, DSA) -> $out"
python3 -m profiling profile --preset tiny --seq 256 --mode prefill --attn dsa --steps 3 --warmup 1 \
    --sweep 1024,2048,4096,8192,16384 --out "$out" "$@"
echo "[main] report: $out/report.md  trace: $out/trace.json (open in https://ui.perfetto.dev)  plots: $out/*.png"
