#!/usr/bin/env bash
# The README's test command: set up (install + compile), then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] running tests/ (Triton kernels under TRITON_INTERPRET=1 when no GPU is present)"
# Two pytest-xdist workers, each given whole test files (--dist loadfile: a file's tests
# run in one process, in order, so module-level caches such as the serving tests' tokens
# alone are built once). Most tests are single-threaded Python (Triton's interpreter, the
# serving engine's steps), so on 2 cores two files at once take 0.56x the time of one
# after another (739 s against 1,322 s on a Zen 4, 2026-12-07). GLM5_TEST_WORKERS=0 runs
# every test in this process; benchmarks live in bench/, so pytest-benchmark stays off.
exec python3 -m pytest tests -q -p no:cacheprovider -p no:benchmark -n "${GLM5_TEST_WORKERS:-2}" --dist loadfile "$@"
