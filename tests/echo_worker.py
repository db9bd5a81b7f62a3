"""A small Worker for the worker-group and supervisor tests (tests/ is on the Ray workers' PYTHONPATH)."""

import os
import time

from dockrl.workers.group import Worker


class EchoWorker(Worker):
    """A worker whose methods answer, sleep, die, raise or all-reduce on command (rank 1 misbehaves)."""

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def rank_times(self, x: int) -> int:
        return self.rank * x

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def die(self) -> None:
        if self.rank == 1:
            os._exit(1)
        time.sleep(30)

    def boom(self) -> None:
        if self.rank == 1:
            raise RuntimeError("verifier exploded")

    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()
