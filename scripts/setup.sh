#!/usr/bin/env bash
# Installs what pyproject.toml lists (build requirements, runtime dependencies,
# the test extra) and compiles glm5_ops._C against the installed torch (CPU
# kernels always; CUDA kernels when torch is a CUDA build and nvcc exists).
# A rerun with nothing changed takes seconds: it installs only what is missing
# and skips the build when the stamp beside the extension matches
# (scripts/setup_state.py); a changed source recompiles only what it touches.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PIP=("$PY" -m pip --disable-pip-version-check)
echo "[setup] python: $($PY --version 2>&1) at $(command -v "$PY")"
# Python 3.10 has no tomllib for reading pyproject.toml
$PY -c "import tomllib" 2>/dev/null || "${PIP[@]}" install --quiet tomli

# a plain assignment, so set -e stops here when the check itself fails
missing=$($PY scripts/setup_state.py missing test)
if [ -n "$missing" ]; then
  mapfile -t reqs <<< "$missing"
  echo "[setup] installing ${reqs[*]} (torch 2.14.1 takes ~2 min the first time)"
  "${PIP[@]}" install --quiet "${reqs[@]}"
else
  echo "[setup] requirements already installed"
fi

# nvcc lives in /usr/local/cuda on the lab's machines; torch looks for it via CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
if $PY scripts/setup_state.py fresh; then exit 0; fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "[setup] compiling glm5_ops._C (MAX_JOBS=$MAX_JOBS, CUDA_HOME=${CUDA_HOME:-none}); the compile lines follow"
start=$(date +%s)
# --no-build-isolation: compile against the torch installed above, not a fresh
# one; --no-deps: the dependencies were installed above.
"${PIP[@]}" install --no-build-isolation --no-deps -v -e . 2>&1 \
  | grep -E '^\s*\[[0-9]+/[0-9]+\]|\[glm5\]|error|Error|Successfully installed' \
  | sed -E 's/(\[[0-9]+\/[0-9]+\] [^ ]+).* -c ([^ ]+) -o ([^ ]+).*/\1 ... -c \2 -o \3/'
$PY -c "import glm5_ops, glm5_ops._backend as b; print('[setup] glm5_ops._C loaded, CUDA kernels compiled in:', bool(b._C.WITH_CUDA))"
$PY scripts/setup_state.py stamp
echo "[setup] done in $(( $(date +%s) - start )) s"
