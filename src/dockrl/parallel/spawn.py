"""Run a function on N spawned local processes that form one process group (benchmarks and tests).

    spawn_ranks(worker, world, *args)  ->  worker(rank, world, *args, leave) on `world` processes
                                           (spawned; each joins the group itself, e.g. init_distributed)
    ... every rank ends with leave(rank): a barrier, then the peers destroy their groups, then rank 0

Why the order: rank 0 hosts the rendezvous store, and a peer still tearing its group down when rank 0's
process has exited aborts ("terminate called without an active exception"; about 1 run in 10 of a 2-rank
FSDP update here). Even in that order a peer aborted once more at its interpreter's exit (2026-12-04, a
2-rank update, once in about 30 runs): gloo's C++ objects are destroyed at exit while its threads may still
run. So every rank, its group left, leaves its process at once (os._exit after flushing), as a killed Ray
worker does: `leave` is the worker's last call. Ray worker groups never leave their groups: they are killed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

LEAVE_TIMEOUT_S = 120.0


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any) -> None:
    """Run `worker(rank, world, *args, leave)` on `world` spawned processes; wait for all of them."""
    import torch.multiprocessing as mp

    left = mp.get_context("spawn").Semaphore(0)
    leave = functools.partial(leave_group, left=left, world=world)
    mp.start_processes(worker, args=(world, *args, leave), nprocs=world, start_method="spawn")


def leave_group(rank: int, *, left: Any, world: int) -> None:
    """Destroy this rank's process group in order: every peer first, rank 0 (the store's host) last."""
    import torch.distributed as dist

    dist.barrier()
    if rank != 0:
        dist.destroy_process_group()
        left.release()
        _exit_now()
    for _ in range(world - 1):
        if not left.acquire(timeout=LEAVE_TIMEOUT_S):
            raise RuntimeError(f"a peer did not leave its process group within {LEAVE_TIMEOUT_S:.0f} s")
    dist.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """Exit 0 without the interpreter's teardown (the rank's work is done and written)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
