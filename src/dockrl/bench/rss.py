"""Host memory figures of this process for the benchmarks (Linux /proc): the RSS high-water mark, resettable.

CPU peaks only mean something if freed tensors leave RSS: the benchmarks pin glibc's mmap threshold
(MALLOC_MMAP_THRESHOLD_=65536) before spawning their ranks.
"""

from __future__ import annotations


def rss_reset() -> int:
    """Reset this process's RSS high-water mark (VmHWM); returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def proc_status(key: str) -> int:
    """A byte figure of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")
