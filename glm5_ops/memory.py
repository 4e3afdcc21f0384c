"""Host memory: peak resident memory of this process, resettable (Linux), and
transparent huge pages for the tensors a decode step streams.

ru_maxrss is no use for a child process: its high-water mark starts at the
parent's, inherited through fork. Writing "5" to /proc/self/clear_refs resets
the kernel's peak (VmHWM) to the current RSS, so a measurement covers only
what runs after reset_peak_rss().

Huge pages. A batch-1 decode step reads every weight it uses once, from DRAM.
On 4 KiB pages each 4 KiB of a weight costs a TLB miss and a page walk on top
of its cache lines; on 2 MiB pages one walk covers 512 times as much. The same
fp32 GEMV over a 125 MiB LM head ran 1.05x faster from huge pages (10 of 12
alternating calls), and the whole compiled `small` decode step 1.13-1.22x (12 of
12 alternating blocks in each of two runs; bench/RESULTS.md, "Huge pages").
llama.cpp gets them from its mmap of the GGUF file (the page cache's large
folios). torch's allocator asks for them only under THP_MEM_ALLOC_ENABLE=1, read
once before the first allocation, for every tensor; here the weights (and the
paged cache) ask for them where they are made: construction, loading,
quantization, the cache.
"""
from __future__ import annotations

import functools
import mmap
import os
import resource

import torch

HUGE_PAGE = 2 << 20        # x86-64's transparent huge page; smaller tensors stay where they are
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def reset_peak_rss() -> bool:
    """Resets the peak to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident memory since start or since the last reset_peak_rss()."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


@functools.cache
def _kernel_allows_huge_pages() -> bool:
    """transparent_hugepage is "always" or "madvise" (the selected mode is the bracketed one)."""
    try:
        with open(_THP_MODE) as f:
            mode = f.read()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


def huge_pages_enabled() -> bool:
    """Whether CPU tensors of HUGE_PAGE bytes or more are placed on transparent huge
    pages: the kernel allows it, and the environment does not say GLM5_HUGE_PAGES=0
    (for A/B runs, and for hosts where huge pages are unwelcome)."""
    return os.environ.get("GLM5_HUGE_PAGES", "1") != "0" and _kernel_allows_huge_pages()


def _wants_huge_pages(nbytes: int, device) -> bool:
    return torch.device(device).type == "cpu" and nbytes >= HUGE_PAGE and huge_pages_enabled()


def huge_page_empty(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device), backed by transparent huge pages
    where huge_pages_enabled() and it is a CPU tensor of at least HUGE_PAGE bytes.

    The memory is a private anonymous mapping of its own, advised MADV_HUGEPAGE before
    anything touches it, so the first touch of each 2 MiB faults in one huge page (a
    heap block may already be backed by small pages). The tensor starts on a 2 MiB
    boundary and keeps the mapping alive; it cannot be resized (a parameter never is)."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if not _wants_huge_pages(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as e:    # torch.empty's error, which callers already handle
        raise RuntimeError(f"can't allocate memory: {nbytes} bytes on huge pages ({e})") from e
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)    # holds a reference to region
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def placed_on_huge_pages(t: torch.Tensor) -> bool:
    """Whether t is huge_page_empty()'s memory: 2 MiB-aligned and not resizable (its own mapping)."""
    return t.data_ptr() % HUGE_PAGE == 0 and not t.untyped_storage().resizable()


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t's values in a huge_page_empty() tensor, or t itself where huge_page_empty() would
    not use huge pages or t is not a plain contiguous CPU tensor."""
    nbytes = t.numel() * t.element_size()
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_contiguous() \
            or not _wants_huge_pages(nbytes, t.device):
        return t
    out = huge_page_empty(t.shape, t.dtype)
    with torch.no_grad():
        out.copy_(t)
    return out


def weights_on_huge_pages(module: torch.nn.Module) -> int:
    """Moves `module`'s CPU parameters and buffers of at least HUGE_PAGE bytes onto huge
    pages (on_huge_pages), in place: a parameter keeps its identity (its .data moves), so
    tied weights stay tied and optimizers keep their references. Tensors already on
    huge pages (placed_on_huge_pages) are left. Returns the
    bytes moved."""
    moved = 0
    placed: dict[int, torch.Tensor] = {}      # id of a buffer -> where it went (a buffer may be shared)
    for sub in module.modules():
        for kind in (sub._parameters, sub._buffers):
            for name, t in kind.items():
                if t is None or t.is_meta or type(t) not in (torch.Tensor, torch.nn.Parameter):
                    continue   # a tensor subclass (DTensor, torchao's) has its own storage story
                if id(t) in placed:
                    kind[name] = placed[id(t)]
                    continue
                placed[id(t)] = t
                if placed_on_huge_pages(t):
                    continue
                param = isinstance(t, torch.nn.Parameter)
                src = t.data if param else t
                new = on_huge_pages(src)
                if new is src:
                    continue
                if param:
                    t.data = new
                else:
                    kind[name] = placed[id(t)] = new
                moved += new.numel() * new.element_size()
    return moved
