"""RolloutWorker: one rollout replica of `rollout.placement=separate`, a Ray actor of its own.

    trainer ranks ── broadcast_weights: bucket by bucket, gathered over the actor's ranks ──┐
                                                                                           ▼
    RolloutWorker r: receive_weights(v) on its "weights" thread (into its bucket buffers)
                     generate(step, v): takes the weights of version v, pulls whole groups from the dock,
                                        puts responses (and each token's policy_version) back (dock_feed)

The weights live in flat buffers laid out like the trainer's buckets (`switch.full_model_buckets`, planned from
the same model config and `reshard.bucket_mb`), so a sync is one gloo broadcast per bucket straight into
them: no state dict. With rollout.max_staleness <= 1 a replica is idle whenever weights arrive, so they go
straight into the model's buffers; with k >= 2 the next version arrives while an earlier step still generates,
so it lands in a staged copy (up to k more copies of the weights) and generate(step, v) copies version v in
when it starts: which weights generate a step is fixed by its step number, never by arrival time. The trainer's rank 0 and the replicas share a gloo group of their own
(`parallel.dist.side_group`). A row's tokens depend only on its seed and the weights (`dock_feed.row_seed`), so
which replica serves a row changes nothing.
"""

from __future__ import annotations

import threading
import time

import ray
import torch
import torch.distributed as dist

from dockrl.config.schema import TrainConfig
from dockrl.config.step_plan import StepPlan
from dockrl.dock.choice import DockChoice
from dockrl.engines.reshard.switch import broadcast_bucket, full_model_buckets, set_param
from dockrl.engines.rollout.dock_feed import serve_step, step_engine
from dockrl.engines.rollout.rollout_engine import RolloutEngine
from dockrl.models.decoder import Transformer
from dockrl.models.hf import read_config
from dockrl.models.tokenizer import Tokenizer, first_token_id, stop_token_ids
from dockrl.parallel.dist import side_group
from dockrl.parallel.replica import ReplicaClient
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import GenerateResult, SetupResult

WEIGHTS_THREAD = "weights"


class RolloutWorker(Worker):
    """One single-rank rollout replica: weights received from the trainer, rows served from the dock."""

    threads = {WEIGHTS_THREAD: 1}  # weights arrive while a step generates (rollout.max_staleness >= 2)

    def __init__(
        self, name: str, rank: int, world_size: int, *, cfg: TrainConfig, plan: StepPlan, client: DockChoice
    ):
        """`cfg` and `plan`: the run's resolved config and its step plan (config.Resolved), read, never changed."""
        super().__init__(name, rank, world_size)
        self.cfg, self.plan, self.client = cfg, plan, client
        self.sync_group: dist.ProcessGroup | None = None  # set by join_weight_sync
        self.version = -1  # updates behind the weights in the model's buffers; -1: none received yet
        self.staged: dict[int, list[torch.Tensor]] = {}  # version -> received copy not yet taken
        self.spare: list[list[torch.Tensor]] = []  # staged copies already taken, reused
        self.arrived = threading.Condition()
        self.generating = False

    def setup(self) -> SetupResult:
        """The model, its parameters views of the bucket buffers (filled by the first receive_weights; the
        decoder has no other tensors: rotary tables are computed per call), the tokenizer and stop tokens."""
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
                set_param(model, spec.name, buffer[spec.offset : spec.offset + spec.numel].view(spec.shape))
        self.model = model.requires_grad_(False).eval()
        self.tokenizer = Tokenizer.from_dir(cfg.model.path)
        self.pad_token_id = first_token_id(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.stop_token_ids = stop_token_ids(self.tokenizer.eos_token_id, args.eos_token_id)
        self.replica_client = ReplicaClient(self.client, None, 0, 1)
        self.engine: RolloutEngine | None = None
        return SetupResult(args.num_params(), str(self.device), self.where())

    def join_weight_sync(self, addr: str, port: int, world: int) -> None:
        """Join the trainer's weight-sync group as member rank + 1 (the trainer's rank 0 is member 0)."""
        self.sync_group = side_group(
            addr, port, self.rank + 1, world, timeout_s=self.cfg.run.worker_timeout_s
        )

    @ray.method(concurrency_group=WEIGHTS_THREAD)
    def receive_weights(self, version: int) -> float:
        """Receive the trainer's weights after `version` updates, bucket by bucket; returns the seconds."""
        start = time.perf_counter()
        staging = self.plan.rollout_lead >= 2
        with self.arrived:
            if not staging and self.generating:
                raise RuntimeError(
                    f"{self.name}: weights of version {version} arrived while a step generates, with the rollout "
                    f"{self.plan.rollout_lead} steps ahead (the recipe syncs between steps then)"
                )
            target = self.buffers
            if staging:
                target = self.spare.pop() if self.spare else [torch.empty_like(b) for b in self.buffers]
        assert self.sync_group is not None, "receive_weights before join_weight_sync"
        for buffer in target:
            broadcast_bucket(self.sync_group, buffer)
        with self.arrived:
            if staging:
                self.staged[version] = target
            else:
                self.version = version
            self.arrived.notify_all()
        return time.perf_counter() - start

    def _take_version(self, version: int) -> None:
        """Make the weights of `version` the model's (waiting for them to arrive; bounded by
        run.worker_timeout_s) and recycle staged copies of older versions."""
        timeout_s = self.cfg.run.worker_timeout_s
        with self.arrived:
            if not self.arrived.wait_for(
                lambda: self.version == version or version in self.staged, timeout=timeout_s
            ):
                raise RuntimeError(
                    f"{self.name}: the weights of version {version} did not arrive within {timeout_s:.0f} s "
                    f"(run.worker_timeout_s); it holds version {self.version}, staged {sorted(self.staged)}"
                )
            if self.version != version:
                received = self.staged.pop(version)
                for live, new in zip(self.buffers, received):
                    live.copy_(new)
                self.spare.append(received)
                self.version = version
            for old in [v for v in self.staged if v < version]:
                self.spare.append(self.staged.pop(old))
            self.generating = True

    def generate(self, step: int, version: int, dock: int | None = None) -> GenerateResult:
        """Serve step `step`'s rollout rows from the dock (`dock` of an asynchronous run, selected when this call
        starts, after the replica's earlier generations) with the weights after `version` updates, until every
        row has a response (as the colocated actor does)."""
        if dock is not None:
            self.client.select(dock)
        self._take_version(version)
        try:
            start = time.perf_counter()
            if self.engine is None:
                self.engine = step_engine(self.model, self.cfg, self.pad_token_id, self.tokenizer.decode)
            stats = serve_step(self.engine, self.replica_client, self.cfg, step, self.stop_token_ids, version)
            busy_s = time.perf_counter() - start
        finally:
            with self.arrived:
                self.generating = False
        return GenerateResult(
            stats["response_lengths"],
            stats["truncated"],
            0.0,
            version,
            busy_s,
            stats["interrupted"],
            stats["continued"],
        )


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
        # ray.method's stubs type the decorated method as a remote handle; it is still the function.
        return self.start(RolloutWorker.receive_weights, version)  # type: ignore[arg-type]

    def generate(self, step: int, version: int, dock: int | None = None) -> Pending[GenerateResult]:
        """Roll out every row of the dock's table (dock `dock` of an asynchronous run) with the weights after
        `version` updates. Queued behind the replicas' running generations: the caller does not wait."""
        return self.start(RolloutWorker.generate, step, version, dock)
