#!/usr/bin/env bash
# The README's main job. Until the end-to-end profiler lands, that is the
# benchmark suite: every kernel family against its dense baseline, one table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs
out=runs/bench-$(date +%Y%m%d-%H%M%S).json
echo "[main] benchmarking (about 12 minutes on 2 cores); JSON -> $out"
python3 -m pytest bench -q -p no:cacheprovider --benchmark-json="$out" --benchmark-columns=median,iqr,rounds "$@"
echo "[main] table:"
python3 bench/report.py "$out"
