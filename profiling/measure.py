"""Running the network for a profile: one step of prefill, decode or training,
warm-up, timing and peak memory. Observes only: the model is called through
its public interface (the model contract in profile_cmd.py)."""
from __future__ import annotations

import contextlib
import ctypes
import time

import torch
import torch.nn.functional as F

from glm5_ops.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss

MODES = ("prefill", "decode", "train")


class Runner:
    """step() runs one measured unit of work: a prefill of `seq` tokens, one
    decoded token after a `seq`-token context, or a forward + backward of
    `seq` tokens. Extra steps (warm-up, counting) must be declared up front
    so the decode cache has room for them."""

    def __init__(self, model, mode: str, *, batch: int, seq: int, vocab: int, device, total_steps: int, seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode, self.batch, self.seq, self.device = model, mode, batch, seq, device
        g = torch.Generator().manual_seed(seed)
        extra = total_steps if mode == "decode" else 0
        self.ids = torch.randint(0, vocab, (batch, seq + extra), generator=g).to(device)
        self.position = seq
        self.cache = None
        if mode == "train":
            model.train()
        else:
            model.eval()
        if mode == "decode":
            with self.context():  # the context is set up once, outside every measured step
                self.cache = model.new_cache(batch, seq + extra)
                model(self.ids[:, :seq], cache=self.cache, logits_to_keep=1)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * (1 if self.mode == "decode" else self.seq)

    def context(self):
        return contextlib.nullcontext() if self.mode == "train" else torch.inference_mode()

    def step(self):
        with self.context():
            if self.mode == "prefill":
                cache = self.model.new_cache(self.batch, self.seq)
                out = self.model(self.ids[:, :self.seq], cache=cache, logits_to_keep=1)
            elif self.mode == "decode":
                if self.position >= self.ids.shape[1]:
                    raise RuntimeError("decode ran more steps than the Runner was sized for")
                out = self.model(self.ids[:, self.position:self.position + 1], cache=self.cache, logits_to_keep=1)
                self.position += 1
            else:
                ids = self.ids[:, :self.seq]
                logits = self.model(ids)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
                out = loss
        sync(self.device)
        return out

    def zero_grad(self):
        if self.mode == "train":
            self.model.zero_grad(set_to_none=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _trim_heap() -> None:
    """Hands the heap's free memory back to the OS (glibc malloc_trim): else what
    the warm-up freed stays resident and hides the measured steps' own peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak then includes retained memory
        pass


def reset_peak_memory(device) -> int:
    """Starts a new peak; returns the memory held now (the peak's baseline)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    _trim_heap()
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs not writable): "
                           "per-step peaks would be the whole process's")
    return current_rss_bytes()


def peak_memory(device) -> tuple[int, str]:
    """(bytes, what was measured)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    return peak_rss_bytes(), "peak RSS of the process (VmHWM)"


def read_bandwidth_gbs(device, mib: int = 256, repeat: int = 5) -> float:
    """Memory read bandwidth, GB/s: the best of `repeat` sums of a `mib` MiB fp32 tensor
    (a sum reads each byte once and writes nothing; with torch's thread count, as the
    profiled step runs). The read rate a weight-streaming decode step can hope for."""
    if mib < 1 or repeat < 1:
        raise ValueError(f"mib and repeat must be >= 1, got {mib}, {repeat}")
    x = torch.ones(mib * 2**20 // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def timed_steps(runner: Runner, steps: int, on_step=None) -> list[float]:
    """Seconds per step (wall, synchronised)."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.step()
        times.append(time.perf_counter() - t0)
        runner.zero_grad()
        if on_step:
            on_step(i, times[-1])
    return times


def sweep(build_model, attn_modes, lengths, *, mode, batch, vocab, device, warmup, steps, log, seed=0) -> dict:
    """Mean step time and peak memory (above what was held before the timed
    steps: weights, the decode context) per (attention mode, sequence length),
    ranges off (the plain network). One model per attention mode, reused
    across lengths. -> {attn: [{"seq", "ms", "peak_bytes"}, ...]}"""
    results = {}
    for attn in attn_modes:
        model = build_model(attn)
        results[attn] = []
        for seq in lengths:
            runner = Runner(model, mode, batch=batch, seq=seq, vocab=vocab, device=device,
                            total_steps=warmup + steps, seed=seed)
            timed_steps(runner, warmup)
            base = reset_peak_memory(device)
            times = timed_steps(runner, steps)
            peak = peak_memory(device)[0] - base
            ms = 1e3 * sum(times) / len(times)
            results[attn].append(dict(seq=seq, ms=ms, peak_bytes=peak))
            log(f"sweep {attn:>12} seq {seq:>6}: {ms:9.2f} ms/step, "
                f"peak {peak / 2**20:8.1f} MiB above the resting process")
            del runner
        del model
    return results


def crossover(lengths, slow, fast) -> tuple[str, float | None]:
    """Where `fast` (e.g. dsa) starts beating `slow` (dense): a sentence and the
    length, linearly interpolated between the bracketing measured lengths
    (None when the order never flips within the sweep)."""
    diff = [s - f for s, f in zip(slow, fast)]  # > 0: fast wins
    if all(d > 0 for d in diff):
        return f"ahead at every measured length (from {lengths[0]} tokens)", None
    if all(d <= 0 for d in diff):
        return f"behind at every measured length (up to {lengths[-1]} tokens)", None
    i = max(j for j, d in enumerate(diff) if d <= 0)  # the last length where it is not ahead
    if i == len(diff) - 1:
        ahead = [n for n, d in zip(lengths, diff) if d > 0]
        return f"ahead only at {ahead} and behind at the longest ({lengths[-1]} tokens): no stable crossover", None
    a, b = lengths[i], lengths[i + 1]
    x = a + (b - a) * (-diff[i]) / (diff[i + 1] - diff[i])
    return f"crosses over between {a} and {b} tokens (linear interpolation: ~{x:.0f})", x
