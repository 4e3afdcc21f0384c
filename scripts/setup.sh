#!/usr/bin/env bash
# Installs what the lab needs and compiles glm5_ops._C against the installed
# torch (CPU kernels always; CUDA kernels when torch is a CUDA build and nvcc
# exists). Safe to rerun: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
echo "[setup] python: $($PY --version 2>&1) at $(command -v $PY)"
echo "[setup] installing requirements (torch 2.14.1 takes ~2 min the first time)"
$PY -m pip install --quiet --disable-pip-version-check -r requirements.txt

# nvcc lives in /usr/local/cuda on the lab's machines; torch looks for it via CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "[setup] compiling glm5_ops._C (MAX_JOBS=$MAX_JOBS, CUDA_HOME=${CUDA_HOME:-none}); the compile lines follow"
start=$(date +%s)
# --no-build-isolation: compile against the torch installed above, not a fresh one.
$PY -m pip install --disable-pip-version-check --no-build-isolation --no-deps -v -e . 2>&1 \
  | grep -E '^\s*\[[0-9]+/[0-9]+\]|\[glm5\]|error|Error|Successfully installed' \
  | sed -E 's/(\[[0-9]+\/[0-9]+\] [^ ]+).* -c ([^ ]+) -o ([^ ]+).*/\1 ... -c \2 -o \3/'
$PY -c "import glm5_ops, glm5_ops._backend as b; print('[setup] glm5_ops._C loaded, CUDA kernels compiled in:', bool(b._C.WITH_CUDA))"
echo "[setup] done in $(( $(date +%s) - start )) s"
