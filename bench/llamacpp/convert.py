"""HF checkpoint folder -> GGUF with llama.cpp's own converter.

The converter names a BPE tokenizer's pre-tokenizer by a hash of its output on
a fixed text and refuses hashes it does not know. The lab's byte-level
tokenizer (tokenizer.py) is not GLM's 151k-token one, so its hash is unknown:
the converter runs in a child process whose copy of
`TextModel.get_vocab_base_pre` falls back to GLM's "glm4" pre-tokenizer on an
unknown hash and says so (the source files stay untouched). Ids are fed
directly in every comparison, so the pre-tokenizer never runs.
"""
from __future__ import annotations

import os
import subprocess
import sys

from .build import LlamaCpp, LlamaCppUnavailable, _log

OUTTYPES = ("f32", "f16", "bf16", "q8_0")

_BOOTSTRAP = r"""
import os, sys
source = sys.argv[1]
sys.path.insert(0, source)
sys.path.insert(1, os.path.join(source, "gguf-py"))
import conversion.base as base
_original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _original(self, tokenizer)
    except NotImplementedError:
        print("[llama.cpp] converter: the lab's tokenizer hash is not in llama.cpp's list; "
              "this run's converter uses GLM's pre-tokenizer 'glm4' for it", flush=True)
        return "glm4"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [os.path.join(source, "convert_hf_to_gguf.py")] + sys.argv[2:]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_to_gguf(lc: LlamaCpp, checkpoint: str, out_path: str, outtype: str = "f32") -> str:
    """Writes `out_path` (a .gguf) from the HF folder `checkpoint`; returns out_path."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ValueError(f"checkpoint must be a folder with config.json, got {checkpoint!r}")
    if not os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        raise ValueError(f"{checkpoint} has no tokenizer.json: write one with tokenizer.write_glm_tokenizer first")
    cmd = [sys.executable, "-c", _BOOTSTRAP, lc.source_dir, checkpoint, "--outfile", out_path,
           "--outtype", outtype]
    _log(f"converting {checkpoint} to {outtype.upper()} GGUF: {out_path}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("[llama.cpp]"):
            print(line, flush=True)
    if proc.returncode != 0 or not os.path.exists(out_path):
        raise LlamaCppUnavailable(f"llama.cpp's converter failed (exit {proc.returncode}):\n"
                                  f"{(proc.stderr or proc.stdout)[-3000:]}")
    return out_path
