"""Reaper: when a driver that started its own local Ray dies (even by SIGKILL), no process of its run survives.

    driver ── os.environ[RUN_ID_ENV] = id ──▶ ray.init(local): daemons and workers inherit the id ──▶ the id
       │                                           leaves os.environ (`reaped_ray_start`): later children of the
       │                                           interpreter (a notebook's subprocesses) are not the run's
       │
       └── pipe ──▶ reaper process: while the pipe is open, notes the driver's descendants every WATCH_S
                      driver gone (EOF) ─▶ SIGKILL every process whose environment carries the id, and every
                                           noted descendant still alive (same pid and start time), sweeping
                                           until none is seen for QUIET_S (at most SWEEP_S), then exit

Ray's fate-sharing takes most of a local cluster down with its driver, but not all of it: the dashboard and
runtime-env agents were seen to outlive a killed driver, and sometimes without the run id in their
environment (the raylet starts them), hence the descendants noted while the driver lives: by the time it is
gone they are orphans. The reaper only ever signals processes that inherited this run's id (it reads
/proc/<pid>/environ, Linux) or that descended from the driver, never anything else on the machine. Runs that
join an existing cluster (run.ray_address) start no reaper: that cluster's processes are not the run's.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_ID_ENV = "DOCKRL_RUN_ID"
SWEEP_S = 10.0  # the longest the reaper keeps sweeping
QUIET_S = 1.0  # it stops once no process of the run has been seen for this long
WATCH_S = 1.0  # how often it notes the driver's descendants while the driver lives


@contextmanager
def reaped_ray_start() -> Iterator[str]:
    """Start the reaper; the processes started inside the block (Ray's daemons, and the workers they start
    later) carry its run id, and the id leaves os.environ when the block ends. Yields the id."""
    run_id = start_reaper()
    try:
        yield run_id
    finally:
        os.environ.pop(RUN_ID_ENV, None)


def start_reaper() -> str:
    """Mark this process's future children with a fresh run id and start the reaper; returns the id."""
    run_id = uuid.uuid4().hex
    os.environ[RUN_ID_ENV] = run_id
    read_end, write_end = os.pipe()
    subprocess.Popen(
        [sys.executable, "-m", "dockrl.workers.reaper", run_id, str(os.getpid())],
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


def _stat(pid: int | str) -> tuple[int, str] | None:
    """(parent pid, start time in clock ticks) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[1]), fields[19]) if fields[0] != "Z" else None


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live process below `root` in the process tree."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            parents.setdefault(stat[0], []).append(int(entry.name))
            starts[int(entry.name)] = stat[1]
    found, todo = {}, list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in found:
            found[pid] = starts[pid]
            todo += parents.get(pid, [])
    return found


def reap(
    run_id: str, sweep_s: float = SWEEP_S, quiet_s: float = QUIET_S, noted: dict[int, str] | None = None
) -> int:
    """SIGKILL the run's processes until none has been seen for `quiet_s` (at most `sweep_s`): a daemon that a
    dying raylet was still starting shows up after the first sweep. `noted`: pid -> start time of the driver's
    descendants, killed too while the same process (same start time) lives. Returns how many were signalled."""
    signalled: set[int] = set()
    deadline = last_seen = time.monotonic()
    deadline += sweep_s
    while time.monotonic() < deadline:
        same = [
            p for p, start in (noted or {}).items() if (stat := _stat(p)) is not None and stat[1] == start
        ]
        found = set(processes_with(run_id)) | set(same)
        pids = [p for p in found if p != os.getpid() and (p not in signalled or _alive(p))]
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
    """Entry point of the reaper process: note the driver's descendants until its pipe closes, then reap."""
    run_id, driver = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    noted: dict[int, str] = {}
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], WATCH_S)
        if ready and not os.read(stdin, 4096):  # EOF: the driver is gone
            break
        # Another run's reaper (the driver restarted its Ray) keeps its own pipe; it is not a target.
        for pid, start in descendants(driver).items():
            if noted.get(pid) != start and not _is_reaper(pid):  # cmdline read once per new process
                noted[pid] = start
    reap(run_id, noted=noted)


def _is_reaper(pid: int) -> bool:
    try:
        return b"dockrl.workers.reaper" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


if __name__ == "__main__":
    main()
