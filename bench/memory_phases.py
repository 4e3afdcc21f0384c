"""Where a training step's resident memory goes, phase by phase (the
`--trace` of `bench/train_distributed.py memory`).

A mark at each decoder layer's forward start/end, when its output's gradient
arrives and when its input's gradient leaves (backward), and around the loss,
backward and optimizer step records: RSS now, the peak RSS since the previous
mark (VmHWM, reset after each read through /proc/self/clear_refs), and
glibc's view (mallinfo2): bytes in use in the heap arenas, free bytes the
arenas keep, and bytes in mmapped chunks. Freed memory still counted in RSS
shows as a large `heap free`.
"""
from __future__ import annotations

import ctypes

import torch

MiB = 2 ** 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PhaseTrace:
    """Marks phases of the steps of `model` (a GLM5ForCausalLM, FSDP2 or not)."""

    def __init__(self, model):
        self.rows: list[dict] = []
        self._handles = []
        layers = model.model.layers
        for name, layer in (layers.items() if isinstance(layers, torch.nn.ModuleDict) else enumerate(layers)):
            self._hook_layer(f"L{name}", layer)
        self._hook_layer("lm_head", model.lm_head)
        _reset_peak()

    def _hook_layer(self, name, layer):
        def pre(_m, args):
            self.mark(f"fwd {name} start")
            x = args[0]
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda g: self.mark(f"bwd {name} done (input grad)"))

        def post(_m, _args, out):
            self.mark(f"fwd {name} end")
            y = out[0] if isinstance(out, tuple) else out
            if torch.is_grad_enabled() and y.requires_grad:
                y.register_hook(lambda g: self.mark(f"bwd {name} start (output grad)"))
        self._handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

    def mark(self, label: str) -> None:
        info = _libc.mallinfo2()
        self.rows.append(dict(phase=label, rss=_status("VmRSS"), peak_since_last=_status("VmHWM"),
                              heap_used=info.uordblks / MiB, heap_free=info.fordblks / MiB,
                              mmapped=info.hblkhd / MiB))
        _reset_peak()

    def remove(self):
        for h in self._handles:
            h.remove()


def format_rows(rows: list[dict]) -> str:
    out = ["| phase | RSS MiB | peak since last mark | heap in use | heap free (kept) | mmapped |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['phase']} | {r['rss']:.0f} | {r['peak_since_last']:.0f} | {r['heap_used']:.0f} | "
                   f"{r['heap_free']:.0f} | {r['mmapped']:.0f} |")
    return "\n".join(out)
