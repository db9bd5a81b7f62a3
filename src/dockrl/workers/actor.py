"""ActorWorker: one rank of the colocated actor (policy training + rollout + reference model).

Lifecycle of one RL step, every stage pulling its rows from the dock and pushing results back:

    setup(resume_from?) ──▶ [generate ──▶ compute_ref ──▶ compute_old? ──▶ update ──▶ save?] x steps
               │  sync weights (collective), then free-running: the rollout engine pulls whole groups as
               │  its slots free up and puts response_ids / rollout_logprobs of each row as it finishes;
               │  ends when the dock has no unserved rows
               compute_ref / compute_old / update: each rank pulls exactly rows/dp rows, so every rank
               runs the same number of FSDP forward/backward passes (FSDP collectives need lockstep)

With tensor parallel degree 1 every rank is the head of its own data-parallel group and talks to the dock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dockrl.algos.advantages import kl_shaped_returns
from dockrl.algos.losses import kl_penalty
from dockrl.backends import Rollout, RolloutHost, WeightPairs, backend
from dockrl.checkpoint.directory import ACTOR, ADAPTER, HF
from dockrl.checkpoint.sharded import export_adapter, export_hf, load_engine, save_engine
from dockrl.config.specs import ActorSpec
from dockrl.config.step_plan import StepPlan
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import (
    ADVANTAGES,
    IMAGE_GRID_THW,
    IMAGE_PATCHES,
    LOSS_MASK,
    OLD_LOGPROBS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
    ROUTED_EXPERTS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    UPDATE_WEIGHT,
)
from dockrl.dock.stages import Stage
from dockrl.engines.reshard.switch import RolloutSwitch, offload_flags
from dockrl.engines.rollout.dock_feed import serve_step
from dockrl.engines.rollout.sampler import SamplingParams
from dockrl.engines.train.policy_update import all_reduce_sum, policy_update, whiten_rows
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.lora import LoraSpec, read_peft_adapters
from dockrl.models.precision import dtype_of
from dockrl.models.tokenizer import Tokenizer, first_token_id, stop_token_ids
from dockrl.parallel.dist import free_port, host_ip, inference_mesh, side_group, training_mesh
from dockrl.parallel.expert_parallel import ALL_TO_ALL_BYTES
from dockrl.parallel.replica import ReplicaClient
from dockrl.workers.env import tier_envs
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import GenerateResult, LogprobResult, SetupResult, UpdateResult

# Measured on the first mini-batch of an update (see ActorWorker.update).
MISMATCH_METRICS = ("rollout/logprob_abs_diff", "rollout/kl", "moe/routing_agreement", "moe/expert_load")


class ActorWorker(Worker):
    """Policy + reference + rollout model on one rank; stages are driven by the GRPO recipe."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        spec: ActorSpec,
        plan: StepPlan,
        client: DockChoice,
        env_workers: list[Any] | None = None,
        num_threads: int | None = None,
    ):
        """`spec` and `plan`: the actor's spec and the run's step plan (config.specs), read, never changed;
        `env_workers`: a multi-turn run's environment tier (workers/env.py)."""
        super().__init__(name, rank, world_size, num_threads)
        self.spec, self.plan, self.client = spec, plan, client
        self.env_workers = env_workers
        # tensor- and context-parallel peers train on the same rows
        self.dp = world_size // (spec.optim.tp * spec.optim.cp)
        self.rows_per_rank = spec.rows_per_step // self.dp
        temperature = spec.rollout.temperature
        self.temperature = temperature if temperature > 0 else 1.0
        self.backend = backend(spec.rollout.backend)

    def setup(self, resume_from: str | None = None) -> SetupResult:
        """Build the sharded policy (+ optimizer), the reference model and the rollout model; with
        `resume_from` (a checkpoint root) the policy, its optimizer and LR schedule come from there."""
        spec = self.spec
        mesh = training_mesh(self.device.type, self.dp, spec.optim.tp, spec.optim.cp)
        common: dict[str, Any] = dict(
            device=self.device,
            precision=spec.rollout.precision,
            mesh=mesh,
            ep=spec.optim.ep,
            packing=spec.optim.packing,
            fsdp_unit_params=spec.optim.fsdp_unit_params,
        )
        self.policy = TrainEngine(
            spec.model_path,
            optim=spec.optim,
            freeze_vision=spec.optim.vision.freeze,
            total_optimizer_steps=spec.total_optimizer_steps,
            load_weights=resume_from is None or self.plan.lora is not None,  # LoRA resumes adapters only
            **common,
            **self._lora_args(),
        )
        if resume_from is not None:
            load_engine(self.policy, Path(resume_from) / ACTOR)
        self.ref = (
            None  # LoRA: the reference is the policy's base, adapters off or at their start (compute_ref)
        )
        if self.plan.reference and not self.plan.reference_in_policy:
            self.ref = TrainEngine(spec.ref_path or spec.model_path, trainable=False, **common)
        self.tokenizer = Tokenizer.from_dir(spec.model_path)
        self.pad_token_id = first_token_id(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.stop_token_ids = stop_token_ids(self.tokenizer.eos_token_id, self.policy.args.eos_token_id)
        self._setup_switch(mesh)
        host = RolloutHost(
            self.rollout_model,
            self.tokenizer.decode,
            self.pad_token_id,
            self.device.type,
            self.world_size,
            self.name,
            self.policy.vision,
        )
        self.rollout: Rollout = self.backend.colocated(spec.rollout, host)
        self.weight_sync: dict[str, float] = {}  # what the last sync loaded (backends that load: vLLM)
        # MoE: the rollout records each token's experts (a backend that can, single-turn) into routed_experts
        self.routes_column = (
            self.policy.args.is_moe and self.backend.records_routes and spec.rollout.env is None
        )
        self.replay_routes = self.routes_column and spec.algo.routing_replay == "r3"
        self.all_to_all_mark = ALL_TO_ALL_BYTES[0]  # actor.ep > 1: bytes sent before this step's passes
        return SetupResult(self.policy.args.num_params(), str(self.device), self.where())

    def _lora_args(self) -> dict:
        """TrainEngine's LoRA arguments: the plan's adapters, started from model.lora_path's when set."""
        lora = self.plan.lora
        if lora is None:
            return {}
        spec = LoraSpec(lora.rank, lora.alpha, lora.dropout, lora.target_modules)
        path = self.spec.lora_path
        return {
            "lora": spec,
            "lora_init": None if path is None else read_peft_adapters(path),
            "keep_starting_adapters": self.plan.reference and self.plan.reference_adapters,
            "seed": self.spec.rollout.seed,
        }

    def _setup_switch(self, train_mesh) -> None:
        """The rollout model (tp_infer-parallel, weights only while in rollout) and the dock views per layout."""
        spec, tp_infer = self.spec, self.spec.rollout.tp
        infer_group = inference_mesh(self.device.type, self.world_size, tp_infer).get_group("tp")
        # A backend that cuts its own tensor-parallel slices gets full tensors (tp_infer 1 for the gathers).
        switch_tp = 1 if self.backend.full_tensors else tp_infer
        self.switch = RolloutSwitch(
            self.policy,
            rank=self.rank,
            world=self.world_size,
            tp_infer=switch_tp,
            infer_group=infer_group if switch_tp > 1 else None,
            bucket_bytes=spec.rollout.bucket_bytes,
            dtype=dtype_of(spec.rollout.precision),
            offload=offload_flags(spec.reshard, self.device.type),
            extra_offload=() if self.ref is None else (self.ref.model,),
        )
        self.rollout_model = self.switch.model
        self.rollout_stale = True
        peers = spec.optim.tp * spec.optim.cp  # the ranks of one dp rank: the same rows
        self.train_client = ReplicaClient(self.client, self.policy.replica_group, self.rank, peers)
        self.rollout_client = ReplicaClient(self.client, infer_group, self.rank, tp_infer)

    # ---- rollout -------------------------------------------------------------------------------

    def sync_rollout_weights(self) -> None:
        """Enter the rollout layout (collective: all ranks call it together): the switch gathers this rank's
        inference weights bucket by bucket and offloads training state, and the backend takes them (dockrl's
        engine reads them in place; vLLM loads them and checks them against the trainer's own log-probs of a
        probe sequence, WeightSyncError)."""
        self.weight_sync = self.rollout.sync(_SwitchSource(self))
        self.rollout_stale = False

    def weight_sync_address(self) -> tuple[str, int]:
        """(address, port) where this rank (rank 0) hosts the weight-sync group of separate placement."""
        return host_ip(), free_port()

    def join_weight_sync(self, addr: str, port: int, world: int) -> None:
        """Rank 0 joins the weight-sync group with the rollout replicas as its member 0; the other ranks only
        take part in the gathers of broadcast_weights."""
        if self.rank == 0:
            self.sync_group = side_group(addr, port, 0, world, timeout_s=self.spec.rollout.worker_timeout_s)

    def send_weights(self) -> int:
        """Separate placement: gather the policy bucket by bucket and broadcast it to the rollout replicas
        (collective over the actor's ranks), or under LoRA the adapters only; returns the bytes rank 0 sent."""
        group = getattr(self, "sync_group", None)
        if self.policy.lora is not None:
            return self.switch.broadcast_adapters(group)
        return self.switch.broadcast_weights(group)

    def leave_rollout(self) -> None:
        """Back to the training layout: free the rollout buffers, bring training state back."""
        if self.switch.active:
            self.switch.exit()
        self.rollout_stale = True
        self.rollout.release(self.spec.rollout.free_kv_cache)

    def generate(self, step: int) -> GenerateResult:
        """Serve rollout rows from the dock through the continuous-batching engine until every row has a
        response (see `rollout.dock_feed`)."""
        reshard_start = time.perf_counter()
        if self.rollout_stale:
            self.sync_rollout_weights()
        reshard_s = time.perf_counter() - reshard_start
        engine = self.rollout.engine()
        version = step - 1  # colocated rollout is on-policy: the weights after step - 1 updates
        stats = serve_step(
            engine,
            self.rollout_client,
            self.spec.rollout,
            step,
            self.stop_token_ids,
            version,
            tokenizer=self.tokenizer,
            family=self.policy.args.family,
            envs=tier_envs(self.env_workers, self.name),
        )
        self.leave_rollout()
        if not self.rollout_client.is_head:  # tp peers served the same rows as their head
            return GenerateResult([], 0, reshard_s, version)
        return GenerateResult(
            stats["response_lengths"],
            stats["truncated"],
            reshard_s,
            version,
            interrupted=stats["interrupted"],
            continued=stats["continued"],
            env=stats.get("env", {}),
            weight_sync=self.weight_sync,
        )

    # ---- log-prob stages -----------------------------------------------------------------------

    def compute_ref(self) -> LogprobResult:
        """Reference-model log-probs of this rank's share of rows -> `ref_logprobs` (LoRA: the policy's base,
        adapters off, or with model.lora_path's starting adapter: algo.kl_reference)."""
        if self.ref is None:
            context = (
                self.policy.starting_adapters()
                if self.plan.reference_adapters
                else self.policy.adapters_off()
            )
            with context:
                return self._logprob_stage(Stage.REFERENCE, self.policy, REF_LOGPROBS)
        return self._logprob_stage(Stage.REFERENCE, self.ref, REF_LOGPROBS)

    def compute_old(self) -> LogprobResult:
        """Current-policy log-probs before the update (needed when the update is off-policy) -> `old_logprobs`."""
        return self._logprob_stage(Stage.OLD_LOGPROBS, self.policy, OLD_LOGPROBS)

    def _logprob_stage(self, stage: Stage, engine: TrainEngine, column: str) -> LogprobResult:
        # The dp ranks of a stage get near-equal token counts (length balance, dock.policies.balanced_partition).
        start = time.perf_counter()
        columns = [PROMPT_IDS, RESPONSE_IDS] + ([ROUTED_EXPERTS] if self.replay_routes else [])
        columns += [IMAGE_PATCHES, IMAGE_GRID_THW] if engine.vision is not None else []
        got = self.train_client.get(
            stage, columns, self.rows_per_rank, balance_over=self.dp, peer=self.policy.dp_rank
        )
        rows, batch = got if got is not None else _no_rows(columns)  # rollout.partial: fewer rows than ranks
        logps, _ = engine.logprobs(
            batch[PROMPT_IDS],
            batch[RESPONSE_IDS],
            temperature=self.temperature,
            micro_batch_size=self.spec.optim.micro_batch_size,
            max_tokens_per_micro_batch=self.spec.optim.max_tokens_per_micro_batch,
            pad_token_id=self.pad_token_id,
            routes=batch.get(ROUTED_EXPERTS),  # algo.routing_replay=r3: the rollout's experts
            replay=self.replay_routes,
            images=_row_images(batch),
        )
        if rows:
            self.train_client.put(stage, rows, {column: logps})
        tokens = sum(len(r) for r in batch[RESPONSE_IDS])
        return LogprobResult(len(rows), tokens, time.perf_counter() - start)

    # ---- update --------------------------------------------------------------------------------

    def update(self) -> UpdateResult:
        """Train on this rank's share of the step's rows: epochs x mini-batches optimizer steps."""
        actor, use_ref = self.spec.optim, self.plan.reference
        columns = [PROMPT_IDS, RESPONSE_IDS, UPDATE_WEIGHT, ADVANTAGES, ROLLOUT_LOGPROBS]
        columns += [REF_LOGPROBS] if use_ref else []
        columns += [] if self.plan.single_update or self.plan.old_from_rollout else [OLD_LOGPROBS]
        columns += [LOSS_MASK] if self.plan.multi_turn else []
        columns += [ROUTED_EXPERTS] if self.routes_column else []
        columns += [TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS] if self.plan.distill_top_k else []
        columns += [IMAGE_PATCHES, IMAGE_GRID_THW] if self.policy.vision is not None else []
        # REINFORCE++'s KL in the reward reads the sampling policy's log-probs even when the update is
        # on-policy (the loss then keeps ratio 1 exactly: it does not read them).
        extra = [OLD_LOGPROBS] if self.plan.actor_shapes_kl and OLD_LOGPROBS not in columns else []
        got = self.train_client.get(
            Stage.UPDATE, columns + extra, self.rows_per_rank, balance_over=self.dp, peer=self.policy.dp_rank
        )
        rows, batch = got if got is not None else _no_rows(columns + extra)  # rollout.partial: see _no_rows
        reward_kl: dict[str, float] = {}
        if self.plan.actor_shapes_kl:
            batch[ADVANTAGES], reward_kl = self._kl_shaped_advantages(batch)
        if self.plan.whiten:
            batch[ADVANTAGES] = whiten_rows(batch[ADVANTAGES], self.policy.dp_group, batch[UPDATE_WEIGHT])
        per_token_names = [
            c
            for c in columns
            if c
            not in (
                PROMPT_IDS,
                RESPONSE_IDS,
                UPDATE_WEIGHT,
                LOSS_MASK,
                ROUTED_EXPERTS,
                TEACHER_TOPK_IDS,
                TEACHER_TOPK_LOGPROBS,
                IMAGE_PATCHES,
                IMAGE_GRID_THW,
            )
        ]
        if self.plan.old_from_rollout:  # algo.old_logprobs=rollout: the sampling engine's are the old ones
            batch[OLD_LOGPROBS] = batch[ROLLOUT_LOGPROBS]
            per_token_names.append(OLD_LOGPROBS)
        # actor.mini_batches near-equal shares of this rank's rows (all rows_per_rank of them, unless partial
        # rollout trains fewer): every rank takes the same number of optimizer steps.
        minis = [m.tolist() for m in torch.arange(len(rows)).tensor_split(actor.mini_batches)]
        history: list[dict[str, float] | None] = []
        for _ in range(actor.epochs):
            for idx in minis:
                history.append(
                    policy_update(
                        self.policy,
                        batch,
                        idx,
                        per_token_names,
                        self.plan.loss,
                        temperature=self.temperature,
                        micro_batch_size=actor.micro_batch_size,
                        max_tokens_per_micro_batch=actor.max_tokens_per_micro_batch,
                        pad_token_id=self.pad_token_id,
                        world_size=self.dp,
                        replay=self.replay_routes,
                        aux_loss_coef=actor.moe_aux_loss_coef,
                    )
                )
        self.rollout_stale = True
        taken = [h for h in history if h is not None]  # None: no rank had a row for that optimizer step
        metrics = {k: sum(h[k] for h in taken) / len(taken) for k in taken[0]} if taken else {}
        # The trainer-vs-rollout mismatch is the sampling policy's only before the first optimizer step.
        first = history[0] or {}
        metrics.update({k: first[k] for k in MISMATCH_METRICS if k in first})
        if len(taken) < len(history):
            metrics["skipped_steps"] = float(len(history) - len(taken))
        if self.policy.ep_size > 1:
            metrics.update(self._all_to_all_metrics())
        return UpdateResult({**metrics, **reward_kl})

    def _all_to_all_metrics(self) -> dict[str, float]:
        """moe/all_to_all_mb: MiB of tokens and gradients one rank sent to its experts' ranks in this step's
        passes (reference, old log-probs, update; forward and backward), the mean over the dp ranks."""
        sent = (ALL_TO_ALL_BYTES[0] - self.all_to_all_mark) / 2**20
        self.all_to_all_mark = ALL_TO_ALL_BYTES[0]
        total = all_reduce_sum(torch.tensor([sent], dtype=torch.float64), self.policy.dp_group)
        return {"moe/all_to_all_mb": float(total[0]) / self.dp}

    def _kl_shaped_advantages(self, batch: dict[str, list]) -> tuple[list[torch.Tensor], dict[str, float]]:
        """REINFORCE++ with algo.kl_in_reward: each row's advantage minus kl_coef x the KL to go (sampling
        policy vs reference, algo.kl_estimator); returns the new advantages and the step's mean per-token KL
        in the reward (summed over the dp ranks) as reward/kl_penalty, with reward/kl_coef."""
        algo = self.spec.algo
        shaped, kl_sum, tokens = [], 0.0, 0
        for adv, old, ref in zip(batch[ADVANTAGES], batch[OLD_LOGPROBS], batch[REF_LOGPROBS]):
            kl = kl_penalty(old.float(), ref.float(), algo.kl_estimator)  # [R]
            shaped.append(kl_shaped_returns(adv.float(), kl, self.plan.kl_coef))
            kl_sum, tokens = kl_sum + float(kl.sum()), tokens + len(kl)
        totals = all_reduce_sum(
            torch.tensor([kl_sum, float(tokens)], dtype=torch.float64), self.policy.dp_group
        )
        return shaped, {
            "reward/kl_penalty": totals[0].item() / max(totals[1].item(), 1.0),
            "reward/kl_coef": self.plan.kl_coef,
        }

    # ---- checkpoints and evaluation ------------------------------------------------------------

    def _evaluate_trajectories(
        self, prompts: list[list[int]], env_rows: list[dict], params: SamplingParams
    ) -> list[list[int]]:
        """Multi-turn held-out answers: one greedy trajectory per prompt, its final turn's tokens."""
        from dockrl.engines.rollout.dock_feed import env_settings, local_envs
        from dockrl.engines.rollout.multi_turn import final_turn, run_trajectories

        rollout = self.spec.rollout
        if not prompts or rollout.env is None:
            return []
        engine = self.rollout.engine()
        family = self.policy.args.family
        settings = env_settings(rollout.env, rollout.response_budget, self.tokenizer, family)
        envs = tier_envs(self.env_workers, self.name) or local_envs(rollout.env, family)
        try:
            outs, _ = run_trajectories(
                engine,
                prompts,
                env_rows,
                params=params,
                groups_per_pull=64,
                row_seed=lambda row: 0,
                envs=envs,
                peers=self.rollout_client,
                **settings,
            )
        finally:
            envs.close()
        return [final_turn(o[RESPONSE_IDS], o[LOSS_MASK]) for o in outs]

    def save(self, path: str) -> str:
        """Write the policy's training state (model, AdamW, LR schedule; each rank its shards) to
        `path`/actor and its Hugging Face export (gathered on rank 0) to `path`/hf, or under LoRA the adapters
        only and their PEFT directory to `path`/adapter (collective)."""
        save_engine(self.policy, Path(path) / ACTOR)
        if self.policy.lora is not None:  # adapters only: the base stays where model.path points
            export_adapter(self.policy, Path(path) / ADAPTER)
        else:
            export_hf(self.policy, Path(path) / HF, tokenizer_dir=self.spec.model_path)
        return path

    def evaluate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        env_rows: list[dict] | None = None,
        images: list | None = None,
    ) -> list[list[int]]:
        """Greedy responses for held-out prompts with the current policy (this rank's share; under
        rollout tensor parallelism the replica head's share, answered by the head only). Multi-turn runs
        (`env_rows`: each prompt's environment row) play whole trajectories and answer with the final turn. A
        vision model's prompts come with `images` (per prompt (uint8 patches, grid) or None)."""
        if self.rollout_stale:
            self.sync_rollout_weights()
        prompts = self.rollout_client.broadcast(prompts)
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=self.stop_token_ids
        )
        if env_rows is not None:
            answers = self._evaluate_trajectories(prompts, self.rollout_client.broadcast(env_rows), params)
            self.leave_rollout()
            return answers if self.rollout_client.is_head else []
        if images is not None:
            outs = self.rollout.generate(
                prompts, params, [0] * len(prompts), self.rollout_client.broadcast(images)
            )
        else:
            outs = self.rollout.generate(prompts, params, [0] * len(prompts))
        self.leave_rollout()
        return [o.token_ids.tolist() for o in outs] if self.rollout_client.is_head else []


class _SwitchSource:
    """The colocated weight source (backends.WeightSource): the actor rank's allgather-swap
    switch, and the trainer's own forward for a backend's probe check."""

    def __init__(self, worker: ActorWorker) -> None:
        self.worker = worker

    def in_place(self) -> int:
        self.worker.switch.enter()
        return self.worker.switch.inference_shard_bytes

    def stream(self, load: Callable[[WeightPairs], dict[str, float]]) -> dict[str, float]:
        return self.worker.switch.enter_into(load)

    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        worker = self.worker
        (logps,), _ = worker.policy.logprobs(  # a collective forward: every rank runs it
            [ids[:1]], [ids[1:]], temperature=1.0, micro_batch_size=1, pad_token_id=worker.pad_token_id
        )
        return logps


def _no_rows(columns: list[str]) -> tuple[list[int], dict[str, list]]:
    """The share of a rank the dock had no rows left for: partial rollout trains only finished groups, so a
    step may have fewer rows than ranks. The rank still takes part in every collective (idle micro-batches)."""
    return [], {column: [] for column in columns}


class ActorGroup(WorkerGroup):
    """The actor's ranks (ActorWorkers in one process group), with one typed method per stage; each starts
    the stage on every rank and returns a Pending whose `wait()` gives one result per rank."""

    worker = ActorWorker

    def setup(self, resume_from: str | None = None) -> Pending[SetupResult]:
        """Build the models on every rank (from checkpoint `resume_from` when given)."""
        return self.start(ActorWorker.setup, resume_from)

    def generate(self, step: int) -> Pending[GenerateResult]:
        """Roll out every row of the dock's table."""
        return self.start(ActorWorker.generate, step)

    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight-sync group (separate rollout placement)."""
        return self.start(ActorWorker.weight_sync_address).wait()[0]

    def join_weight_sync(self, addr: str, port: int, world: int) -> Pending[None]:
        """Rank 0 joins the weight-sync group (the others return at once)."""
        return self.start(ActorWorker.join_weight_sync, addr, port, world)

    def send_weights(self) -> Pending[int]:
        """Broadcast the policy to the rollout replicas (with RolloutGroup.receive_weights)."""
        return self.start(ActorWorker.send_weights)

    def compute_ref(self) -> Pending[LogprobResult]:
        """Reference log-probs of every row."""
        return self.start(ActorWorker.compute_ref)

    def compute_old(self) -> Pending[LogprobResult]:
        """The policy's log-probs of every row before the update."""
        return self.start(ActorWorker.compute_old)

    def update(self) -> Pending[UpdateResult]:
        """The step's optimizer steps."""
        return self.start(ActorWorker.update)

    def save(self, path: str) -> Pending[str]:
        """Write the actor's part of the checkpoint at `path`."""
        return self.start(ActorWorker.save, path)

    def evaluate(
        self,
        shards: list[list[list[int]]],
        max_new_tokens: int,
        env_shards: list[list[dict]] | None = None,
        image_shards: list[list] | None = None,
    ) -> Pending[list[list[int]]]:
        """Greedy answers, rank r answering the prompts of `shards[r]` (multi-turn: with the environment rows
        of `env_shards[r]`; a vision model: with each prompt's images, `image_shards[r]`)."""
        args: list[tuple]
        if image_shards is not None:
            args = [(shard, max_new_tokens, None, images) for shard, images in zip(shards, image_shards)]
        elif env_shards is not None:
            args = [(shard, max_new_tokens, rows) for shard, rows in zip(shards, env_shards)]
        else:
            args = [(shard, max_new_tokens) for shard in shards]
        return self.start_ranks(ActorWorker.evaluate, args)


def _row_images(batch: dict[str, list]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """A vision model's rows' (uint8 patches, grid) from their image columns; None when not pulled."""
    if IMAGE_PATCHES not in batch:
        return None
    return list(zip(batch[IMAGE_PATCHES], batch[IMAGE_GRID_THW]))
