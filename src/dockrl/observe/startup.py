"""Where a run's wall time outside its steps goes: marks on one clock from the process's start.

```
 process start ─ cli ─ config ─ data ─ ray ─ dock ─ workers ─ setup ─ step 1 ... step N ─ close ─ (exit)
```

`mark(phase)` records the seconds since this process started (the kernel's start time, so the interpreter's
own start and the CLI's imports count too); a run writes `phases()` into summary.json as "startup", and
`dockrl bench startup` prints them beside the command's wall time. No dependency beyond the stdlib.
"""

from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []


def _process_start() -> float:
    """This process's start on the time.time() clock (Linux /proc; elsewhere: the first import of this
    module, which misses the interpreter's start)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(
                f.read().rpartition(")")[2].split()[19]
            )  # field 22: starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


_START = _process_start()


def mark(phase: str) -> None:
    """Record that `phase` ended now (seconds since the process started)."""
    _marks.append((phase, time.time() - _START))


def phases() -> dict[str, float]:
    """{phase: seconds since the process started at its end}, in the order marked (a phase marked twice,
    e.g. after a restart, keeps its last time)."""
    return {phase: round(seconds, 3) for phase, seconds in _marks}


def reset() -> None:
    """Forget the marks (a process that runs several commands, as the tests do)."""
    _marks.clear()
