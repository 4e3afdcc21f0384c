"""llama.cpp's logits for every position of a prompt, through its C API.

Runs in a child process (a crash or abort inside llama.cpp cannot take the
benchmark down) that drives libllama with the ctypes bindings shipped in the
same sdist: only their low-level module is imported (a stub parent package
stands in for llama_cpp/__init__.py, whose high-level wrapper wants packages
the lab does not need), and LLAMA_CPP_LIB_PATH points them at our build.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

from .build import LlamaCpp, LlamaCppUnavailable

GGML_TYPE_F32 = 0


def llamacpp_logits(lc: LlamaCpp, gguf: str, ids, threads: int = 2, ubatch: int = 512,
                    flash_attn: int = 0) -> np.ndarray:
    """[len(ids), vocab] float32 logits of one sequence, all positions, one llama_decode.
    flash_attn: llama.cpp's flash_attn_type (-1 auto, 0 off, 1 on)."""
    if flash_attn not in (-1, 0, 1):
        raise ValueError(f"flash_attn must be -1, 0 or 1, got {flash_attn!r}")
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    if ids.size == 0:
        raise ValueError("ids must hold at least one token")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = os.path.join(tmp, "ids.npy"), os.path.join(tmp, "logits.npy")
        np.save(ids_path, ids)
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": lc.lib_dir}
        cmd = [sys.executable, "-m", "llamacpp.logits", lc.package_dir, gguf, ids_path, out_path,
               "--threads", str(threads), "--ubatch", str(ubatch), "--flash-attn", str(flash_attn)]
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise LlamaCppUnavailable(f"llama.cpp logits run failed (exit {proc.returncode}):\n"
                                      f"{(proc.stderr or proc.stdout)[-3000:]}")
        return np.load(out_path)


def _bindings(package_dir: str):
    import importlib
    import types
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [os.path.join(package_dir, "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


def _child(package_dir: str, gguf: str, ids_path: str, out_path: str, threads: int, ubatch: int,
           flash_attn: int) -> None:
    import ctypes
    ll = _bindings(package_dir)
    ids = np.load(ids_path)
    n = int(ids.size)
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    model = ll.llama_model_load_from_file(gguf.encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n
    cparams.n_batch = n
    cparams.n_ubatch = min(n, ubatch)
    cparams.n_seq_max = 1
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    # F32 caches (llama.cpp defaults to F16): an agreement check at F32 throughout.
    cparams.type_k = GGML_TYPE_F32
    cparams.type_v = GGML_TYPE_F32
    # Flash attention off: ggml's CPU flash attention rounds Q (and its V sums) to F16
    # even over an F32 cache, which costs ~1e-3 of the largest logit (measured); off, 2e-5.
    cparams.flash_attn_type = flash_attn
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(n, 0, 1)
    for i in range(n):
        batch.token[i] = int(ids[i])
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1
    batch.n_tokens = n
    rc = ll.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")
    ptr = ll.llama_get_logits(ctx)
    logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n, vocab)).copy()
    np.save(out_path, logits)
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="child: llama.cpp logits of one prompt")
    ap.add_argument("package_dir")
    ap.add_argument("gguf")
    ap.add_argument("ids")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--flash-attn", type=int, default=0)
    a = ap.parse_args(argv)
    _child(a.package_dir, a.gguf, a.ids, a.out, a.threads, a.ubatch, a.flash_attn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
