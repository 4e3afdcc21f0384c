#!/usr/bin/env bash
# The sanitizer job: builds the CPU extension with AddressSanitizer and
# UndefinedBehaviorSanitizer (setup.py's GLM5_SANITIZE=1) into build/sanitize/
# (never over glm5_ops/_C*.so), then runs the fuzz suite's fixed corpus on it
# with the ASan runtime preloaded (python and torch are not instrumented).
# Fails on any sanitizer report, crash or hang. docs/FUZZING.md explains it.
#
#   bash scripts/sanitize.sh                      # build + corpus
#   GLM5_PLANT_OOB=1 bash scripts/sanitize.sh     # must FAIL: a planted out-of-bounds read
# Environment: GLM5_SANITIZE_CASES (default 5000), MAX_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$ROOT/build/sanitize${GLM5_PLANT_OOB:+-planted}
CASES=${GLM5_SANITIZE_CASES:-5000}
start=$(date +%s)

# A copy of the glm5_ops package with the sanitized _C in it, first on PYTHONPATH.
rm -rf "$OUT/pkg" && mkdir -p "$OUT/pkg"
(cd "$ROOT" && tar --exclude='__pycache__' --exclude='_C*.so' -cf - glm5_ops) | tar -xf - -C "$OUT/pkg"
GLM5_SANITIZE=1 GLM5_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} \
    python setup.py -q build_ext --build-temp "$OUT/temp" --build-lib "$OUT/lib"
cp "$OUT"/lib/glm5_ops/_C*.so "$OUT/pkg/glm5_ops/"
built=$(date +%s)
echo "[sanitize] built in $((built - start)) s: $(ls "$OUT"/pkg/glm5_ops/_C*.so)"

LIBASAN=$(gcc -print-file-name=libasan.so)
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so.6)
[ -f "$LIBASAN" ] || { echo "[sanitize] libasan not found ($LIBASAN)" >&2; exit 1; }
# Run from the package copy so that it, not the checkout's glm5_ops, is imported first.
cd "$OUT/pkg"
export PYTHONPATH="$OUT/pkg:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# libstdc++ too: ASan intercepts __cxa_throw, and must find the real one when it
# starts, before python loads libstdc++ (else every C++ exception, each
# TORCH_CHECK, aborts with "CHECK failed: ... real___cxa_throw").
export LD_PRELOAD="$LIBASAN:$LIBSTDCXX"
# detect_leaks=0: python and torch are not instrumented and "leak" by design;
# allocator_may_return_null + max_allocation_size_mb: a huge request is a clean
# allocation error (the workers' address-space cap cannot apply under ASan);
# 2 GiB, far above any fuzz tensor: a bigger cap lets a huge block_size or
# max_tokens allocate and poison gigabytes, which under ASan takes minutes.
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=2048:halt_on_error=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export GLM5_FUZZ_TIME_SCALE=${GLM5_FUZZ_TIME_SCALE:-4}
python - <<'PY'
import glm5_ops._C as c, os, sys
if not c.__file__.startswith(os.environ["PYTHONPATH"].split(":")[0]):
    sys.exit(f"[sanitize] imported the wrong glm5_ops._C: {c.__file__}")
PY
status=0
python -m tests.fuzz --cases "$CASES" || status=$?
echo "[sanitize] build $((built - start)) s + corpus $(( $(date +%s) - built )) s = $(( $(date +%s) - start )) s; exit $status"
exit $status
