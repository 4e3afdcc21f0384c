#!/usr/bin/env bash
# The README's main job. Until the end-to-end profiler lands, that is the
# predictor + selection benchmark: ours vs the dense baselines, one table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs
out=runs/bench-$(date +%Y%m%d-%H%M%S).json
echo "[main] benchmarking (a few minutes); JSON -> $out"
python3 -m pytest bench -q -p no:cacheprovider --benchmark-json="$out" --benchmark-columns=median,iqr,rounds "$@"
echo "[main] table:"
python3 bench/report.py "$out"
