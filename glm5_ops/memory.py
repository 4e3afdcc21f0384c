"""Peak resident memory of this process, resettable (Linux).

ru_maxrss is no use for a child process: its high-water mark starts at the
parent's, inherited through fork. Writing "5" to /proc/self/clear_refs resets
the kernel's peak (VmHWM) to the current RSS, so a measurement covers only
what runs after reset_peak_rss()."""
from __future__ import annotations

import resource


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
