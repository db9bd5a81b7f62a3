"""RolloutWorker: one rollout replica of `rollout.placement=separate`, a Ray actor of its own.

    trainer ranks ── broadcast_weights: bucket by bucket, gathered over the actor's ranks ──┐
                                                                                           ▼
    RolloutWorker r: receive_weights (into its bucket buffers, which are the model's weights)
                     generate(step): pulls whole groups from the dock, puts responses back (dock_feed)

The weights live in flat buffers laid out like the trainer's buckets (`switch.full_model_buckets`, planned from
the same model config and `reshard.bucket_mb`), so a sync is one gloo broadcast per bucket straight into
them: no state dict, no copy. The trainer's rank 0 and the replicas share a gloo group of their own
(`parallel.dist.side_group`). A row's tokens depend only on its seed and the weights (`dock_feed.row_seed`), so
which replica serves a row changes nothing.
"""

from __future__ import annotations

import time

import torch

from dockrl.config.schema import TrainConfig
from dockrl.dock.client import DockClient
from dockrl.models.decoder import Transformer
from dockrl.models.hf import read_config
from dockrl.models.tokenizer import Tokenizer
from dockrl.parallel.dist import side_group
from dockrl.parallel.replica import ReplicaClient
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.reshard.switch import _set_param, broadcast_bucket, full_model_buckets
from dockrl.workers.results import GenerateResult, SetupResult
from dockrl.workers.rollout.dock_feed import serve_step, step_engine
from dockrl.workers.rollout.rollout_engine import RolloutEngine


class RolloutWorker(Worker):
    """One single-rank rollout replica: weights received from the trainer, rows served from the dock."""

    def __init__(self, name: str, rank: int, world_size: int, *, cfg: TrainConfig, client: DockClient):
        super().__init__(name, rank, world_size)
        self.cfg, self.client = cfg, client
        self.sync_group = None
        self.version = -1  # updates behind the weights held; -1: none received yet

    def setup(self) -> SetupResult:
        """The model, its parameters views of the bucket buffers (filled by the first receive_weights; the
        decoder has no other tensors: rotary tables are computed per call), the tokenizer and stop tokens."""
        from dockrl.workers.actor import _first_id, _stop_ids

        cfg = self.cfg
        self.device = torch.device("cuda", 0) if cfg.run.device == "cuda" else torch.device("cpu")
        self.dtype = torch.bfloat16 if cfg.run.precision == "bf16" else torch.float32
        args = read_config(cfg.model.path)
        with torch.device("meta"):
            model = Transformer(args)
        bucket_mb = cfg.reshard.bucket_mb
        bucket_bytes = None if bucket_mb is None else int(bucket_mb * 2**20)
        self.buckets = full_model_buckets(model, bucket_bytes, self.dtype)
        self.buffers = [torch.empty(b.numel, dtype=self.dtype, device=self.device) for b in self.buckets]
        for bucket, buffer in zip(self.buckets, self.buffers):
            for spec in bucket.specs:
                _set_param(model, spec.name, buffer[spec.offset : spec.offset + spec.numel].view(spec.shape))
        self.model = model.requires_grad_(False).eval()
        self.tokenizer = Tokenizer.from_dir(cfg.model.path)
        self.pad_token_id = _first_id(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.stop_token_ids = _stop_ids(self.tokenizer.eos_token_id, args.eos_token_id)
        self.replica_client = ReplicaClient(self.client, None, 0, 1)
        self.engine: RolloutEngine | None = None
        return SetupResult(args.num_params(), str(self.device), self.where())

    def join_weight_sync(self, addr: str, port: int, world: int) -> None:
        """Join the trainer's weight-sync group as member rank + 1 (the trainer's rank 0 is member 0)."""
        self.sync_group = side_group(
            addr, port, self.rank + 1, world, timeout_s=self.cfg.run.worker_timeout_s
        )

    def receive_weights(self, version: int) -> float:
        """Receive the trainer's weights after `version` updates, bucket by bucket; returns the seconds."""
        start = time.perf_counter()
        for buffer in self.buffers:
            broadcast_bucket(self.sync_group, buffer)
        self.version = version
        return time.perf_counter() - start

    def generate(self, step: int) -> GenerateResult:
        """Serve rollout rows from the dock until every row has a response (as the colocated actor does)."""
        assert self.version >= 0, "generate before any weights were received"
        start = time.perf_counter()
        if self.engine is None:
            self.engine = step_engine(self.model, self.cfg, self.pad_token_id, self.tokenizer.decode)
        stats = serve_step(self.engine, self.replica_client, self.cfg, step, self.stop_token_ids)
        busy_s = time.perf_counter() - start
        return GenerateResult(stats["response_lengths"], stats["truncated"], 0.0, self.version, busy_s)


class RolloutGroup(WorkerGroup):
    """The separate rollout replicas."""

    worker = RolloutWorker

    def setup(self) -> Pending[SetupResult]:
        """Build every replica's model skeleton and buffers."""
        return self.start(RolloutWorker.setup)

    def join_weight_sync(self, addr: str, port: int, world: int) -> Pending[None]:
        """Join the weight-sync group the trainer's rank 0 hosts at addr:port."""
        return self.start(RolloutWorker.join_weight_sync, addr, port, world)

    def receive_weights(self, version: int) -> Pending[float]:
        """Receive the trainer's weights (with the trainer's broadcast_weights)."""
        return self.start(RolloutWorker.receive_weights, version)

    def generate(self, step: int) -> Pending[GenerateResult]:
        """Roll out every row of the dock's table."""
        return self.start(RolloutWorker.generate, step)
