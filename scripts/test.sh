#!/usr/bin/env bash
# The README's test command: set up (install + compile), then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] running tests/ (Triton kernels under TRITON_INTERPRET=1 when no GPU is present)"
exec python3 -m pytest tests -q -p no:cacheprovider "$@"
