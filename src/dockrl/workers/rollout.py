"""RolloutWorker: one rollout replica of `rollout.placement=separate`, a Ray actor of its own.

    trainer ranks ── broadcast_weights (or, under LoRA, broadcast_adapters): bucket by bucket ──┐
                                                                                                ▼
    RolloutWorker r: receive_weights(v) on its "weights" thread (engines.rollout.replica_weights)
                     generate(step, v): takes the weights of version v, pulls whole groups from the dock,
                                        puts responses (and each token's policy_version) back (dock_feed)

`engines.rollout.replica_weights.ReplicaWeights` holds the model and the weight versions: every weight in
bucket buffers (full fine-tuning), or the frozen base read once from model.path and only the adapters in the
buffers (LoRA: a sync sends bytes proportional to the rank, and up to k + 1 adapter versions stay alive). The
trainer's rank 0 and the replicas share a gloo group of their own (`parallel.dist.side_group`). A row's tokens
depend only on its seed and the weights (`dock_feed.row_seed`), so which replica serves a row changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist

from dockrl.algos.logprobs import token_logprobs
from dockrl.backends import Rollout, RolloutHost, WeightPairs, backend
from dockrl.config.specs import RolloutSpec
from dockrl.config.step_plan import StepPlan
from dockrl.dock.choice import DockChoice
from dockrl.engines.rollout.dock_feed import serve_step
from dockrl.engines.rollout.replica_weights import ReplicaWeights
from dockrl.models.config import read_config
from dockrl.models.lora import LoraSpec
from dockrl.models.precision import dtype_of
from dockrl.models.tokenizer import Tokenizer, first_token_id, stop_token_ids
from dockrl.models.vision import VisionInputs
from dockrl.parallel.dist import side_group
from dockrl.parallel.replica import ReplicaClient
from dockrl.workers.env import tier_envs
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import GenerateResult, SetupResult

WEIGHTS_THREAD = "weights"


class RolloutWorker(Worker):
    """One single-rank rollout replica: weights received from the trainer, rows served from the dock."""

    threads = {WEIGHTS_THREAD: 1}  # weights arrive while a step generates (rollout.max_staleness >= 2)

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        spec: RolloutSpec,
        plan: StepPlan,
        client: DockChoice,
        env_workers: list[Any] | None = None,
    ):
        """`spec` and `plan`: the run's rollout spec and step plan (config.specs), read, never changed;
        `env_workers`: a multi-turn run's environment tier (workers/env.py)."""
        super().__init__(name, rank, world_size)
        self.spec, self.plan, self.client = spec, plan, client
        self.env_workers = env_workers
        self.sync_group: dist.ProcessGroup | None = None  # set by join_weight_sync

    def setup(self) -> SetupResult:
        """The model and its weight buffers (filled by the first receive_weights), the tokenizer and stop
        tokens."""
        spec = self.spec
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        args = read_config(spec.model_path)
        lora = self.plan.lora
        self.weights = ReplicaWeights(
            args,
            spec.model_path,
            dtype=dtype_of(spec.precision),
            device=self.device,
            bucket_bytes=spec.bucket_bytes,
            lora=None if lora is None else LoraSpec(lora.rank, lora.alpha, lora.dropout, lora.target_modules),
            lead=self.plan.rollout_lead,
            name=self.name,
        )
        self.model = self.weights.model
        self.tokenizer = Tokenizer.from_dir(spec.model_path)
        self.pad_token_id = first_token_id(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.stop_token_ids = stop_token_ids(self.tokenizer.eos_token_id, args.eos_token_id)
        self.replica_client = ReplicaClient(self.client, None, 0, 1)
        vision = None if args.vision is None else VisionInputs.for_model(spec.model_path, args)
        host = RolloutHost(
            self.model, self.tokenizer.decode, self.pad_token_id, self.device.type, 1, self.name, vision
        )
        self.rollout: Rollout = backend(spec.backend).replica(spec, host)
        self.rollout_version = -1  # the weight version the rollout took last
        self.weight_sync: dict[str, float] = {}
        return SetupResult(args.num_params(), str(self.device), self.where())

    def join_weight_sync(self, addr: str, port: int, world: int) -> None:
        """Join the trainer's weight-sync group as member rank + 1 (the trainer's rank 0 is member 0)."""
        self.sync_group = side_group(addr, port, self.rank + 1, world, timeout_s=self.spec.worker_timeout_s)

    @ray.method(concurrency_group=WEIGHTS_THREAD)
    def receive_weights(self, version: int) -> float:
        """Receive the trainer's weights (or adapters) after `version` updates; returns the seconds."""
        start = time.perf_counter()
        assert self.sync_group is not None, "receive_weights before join_weight_sync"
        self.weights.receive(version, self.sync_group)
        return time.perf_counter() - start

    def generate(self, step: int, version: int, dock: int | None = None) -> GenerateResult:
        """Serve step `step`'s rollout rows from the dock (`dock` of an asynchronous run, selected when this call
        starts, after the replica's earlier generations) with the weights after `version` updates, until every
        row has a response (as the colocated actor does)."""
        if dock is not None:
            self.client.select(dock)
        self.weights.take(version, self.spec.worker_timeout_s)
        try:
            start = time.perf_counter()
            self.weight_sync = {}  # reported only by the step that loaded new weights
            if self.rollout_version != version:
                self.weight_sync = self.rollout.sync(_ReceivedSource(self))
                self.rollout_version = version
            stats = serve_step(
                self.rollout.engine(),
                self.replica_client,
                self.spec,
                step,
                self.stop_token_ids,
                version,
                tokenizer=self.tokenizer,
                family=self.model.args.family,
                envs=tier_envs(self.env_workers, self.name),
            )
            busy_s = time.perf_counter() - start
        finally:
            self.weights.finish()
        return GenerateResult(
            stats["response_lengths"],
            stats["truncated"],
            0.0,
            version,
            busy_s,
            stats["interrupted"],
            stats["continued"],
            env=stats.get("env", {}),
            weight_sync=self.weight_sync,
        )


class _ReceivedSource:
    """A replica's weight source (backends.WeightSource): the buffers it received (the model
    reads them in place), and the model's own forward for a backend's probe check."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    def in_place(self) -> int:
        return 0  # received into the model's own buffers already

    def stream(self, load: Callable[[WeightPairs], dict[str, float]]) -> dict[str, float]:
        return load(self.worker.weights.named_weights())

    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        device = self.worker.device
        with torch.no_grad():
            logits = self.worker.model(ids[None].to(device))[0, :-1].float()
        return token_logprobs(logits, ids[1:].to(device))


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
