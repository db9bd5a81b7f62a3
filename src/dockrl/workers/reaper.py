"""Reaper: when a driver that started its own local Ray dies (even by SIGKILL), no process of its run survives.

    driver ── os.environ[RUN_ID_ENV] = id ──▶ ray.init(local): daemons and workers inherit the id
       │
       └── pipe ──▶ reaper process (blocks reading the pipe)
                      driver gone (EOF) ─▶ SIGKILL every process whose environment carries the id, sweeping
                                           until none is seen for QUIET_S (at most SWEEP_S), then exit

Ray's fate-sharing takes most of a local cluster down with its driver, but not all of it: with another Ray
instance on the machine, the dashboard and runtime-env agents were seen to outlive a killed driver
indefinitely. The reaper only ever signals processes that inherited this run's id (it reads
/proc/<pid>/environ, Linux), never anything else on the machine. Runs that join an existing cluster
(run.ray_address) start no reaper: that cluster's processes are not the run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

RUN_ID_ENV = "DOCKRL_RUN_ID"
SWEEP_S = 10.0  # the longest the reaper keeps sweeping
QUIET_S = 1.0  # it stops once no process of the run has been seen for this long


def start_reaper() -> str:
    """Mark this process's future children with a fresh run id and start the reaper; returns the id."""
    run_id = uuid.uuid4().hex
    os.environ[RUN_ID_ENV] = run_id
    read_end, write_end = os.pipe()
    subprocess.Popen(
        [sys.executable, "-m", "dockrl.workers.reaper", run_id],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C meant for the driver does not reach it first
        env={k: v for k, v in os.environ.items() if k != RUN_ID_ENV},  # never a target itself
    )
    os.close(read_end)
    # The write end is not inheritable (PEP 446): only the driver holds it, so its death closes the pipe.
    _keep_open.append(write_end)
    return run_id


_keep_open: list[int] = []


def processes_with(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries `run_id` (this process excluded)."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def reap(run_id: str, sweep_s: float = SWEEP_S, quiet_s: float = QUIET_S) -> int:
    """SIGKILL the run's processes until none has been seen for `quiet_s` (at most `sweep_s`): a daemon that a
    dying raylet was still starting shows up after the first sweep. Returns how many were signalled."""
    signalled: set[int] = set()
    deadline = last_seen = time.monotonic()
    deadline += sweep_s
    while time.monotonic() < deadline:
        pids = [p for p in processes_with(run_id) if p not in signalled or _alive(p)]
        if not pids:
            if time.monotonic() - last_seen >= quiet_s:
                break
            time.sleep(0.1)
            continue
        last_seen = time.monotonic()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                signalled.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return len(signalled)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main() -> None:
    """Entry point of the reaper process: wait for the driver's pipe to close, then reap."""
    run_id = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    reap(run_id)


if __name__ == "__main__":
    main()
