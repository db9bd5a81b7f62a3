"""Cluster: everything one attempt of a run starts on Ray, started together and stopped together.

Cluster.start(resolved, resume_from) ──▶ dock (controller + warehouses) ──▶ actor, reward[, reward_model,
                                    critic, teacher, rollout] worker groups ──▶ every actor and critic node sees run.output_dir
                                    (checkpoint/shared_dir.py) ──▶ setup (from the checkpoint when resuming)
every actor is watched by one Supervisor (heartbeats; a death or hang becomes a named WorkerFailure)
close(): the normal end (reward process pools are stopped politely, then every actor is killed)
kill():  after a failure (every actor is killed at once; nothing waits on a worker that may be stuck)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from dockrl.checkpoint.shared_dir import remove_probe, write_probe
from dockrl.config.resolve import Resolved
from dockrl.config.schema import RunConfig, TrainConfig
from dockrl.config.specs import Specs, specs
from dockrl.config.step_plan import StepPlan
from dockrl.dock.choice import DockChoice
from dockrl.dock.launch import CentralDockHandle, Dock, launch_dock
from dockrl.dock.stages import Stage
from dockrl.observe import startup
from dockrl.workers.actor import ActorGroup
from dockrl.workers.critic import CriticGroup
from dockrl.workers.env import start_env_workers
from dockrl.workers.fault_injection import FaultInjector, process_identity
from dockrl.workers.group import WorkerError, WorkerGroup
from dockrl.workers.reward import RewardGroup
from dockrl.workers.reward_model import RewardModelGroup
from dockrl.workers.rollout import RolloutGroup
from dockrl.workers.supervisor import Supervisor
from dockrl.workers.teacher import TeacherGroup

log = logging.getLogger(__name__)
G = TypeVar("G", bound=WorkerGroup)


@dataclass
class Docks:
    """The run's docks (rollout.max_staleness + 1 of them: step t trains in dock t mod (k+1) while the next k
    steps generate in the others); `client()` gives a worker its client of them."""

    docks: list[Dock | CentralDockHandle]

    def client(self) -> DockChoice:
        """A DockChoice over the docks' clients (dock/choice.py; dock 0 selected; one dock in a synchronous
        run)."""
        return DockChoice([d.client() for d in self.docks])

    def shutdown(self) -> None:
        for dock in self.docks:
            dock.shutdown()


@dataclass
class Cluster:
    """The dock, the worker groups and their supervisor of one run attempt."""

    dock: Docks
    client: DockChoice
    plan: StepPlan  # the run's step plan, which every worker was built with
    actors: ActorGroup
    rewards: RewardGroup
    reward_models: RewardModelGroup | None
    critic: CriticGroup | None
    supervisor: Supervisor
    reference_path: str  # the KL reference the actors load (recipes/resume.reference_path)
    rollouts: RolloutGroup | None = None  # rollout.placement=separate
    teacher: TeacherGroup | None = None  # distill.teacher_path
    env_workers: list[Any] | None = None  # env.name: the environment tier (workers/env.py)
    rollout_version: int = -1  # actor updates behind the rollouts' weights; -1: none sent yet
    # The checkpoint the next save descends from: the one this attempt resumed from, then each one it saved.
    parent_checkpoint: str | None = None

    @classmethod
    def start(
        cls,
        resolved: Resolved,
        *,
        resume_from: str | None = None,
        kl_coef: float | None = None,
        faults: FaultInjector | None = None,
        reference_path: str | None = None,
    ) -> Cluster:
        """Launch and set up everything (from checkpoint `resume_from` when given; the actors' KL reference
        is `reference_path`, default model.ref_path or model.path); on any failure on the way, kill what was
        started and re-raise."""
        cfg, plan = resolved.cfg, resolved.plan
        reference_path = reference_path or cfg.model.ref_path or cfg.model.path
        if reference_path != (cfg.model.ref_path or cfg.model.path):
            cfg = replace(cfg, model=replace(cfg.model, ref_path=reference_path))  # the workers' copy only
        supervisor = Supervisor(cfg.run.heartbeat_timeout_s, faults=faults)
        started: dict[str, Any] = {}
        try:
            # Asynchronous runs keep k+1 docks: step t trains in one while steps t+1..t+k generate in the others.
            dock = Docks([])
            started["dock"] = dock
            for index in range(1 + plan.rollout_lead):
                prefix = "dockrl" if index == 0 else f"dockrl-ahead{index}"
                dock.docks.append(
                    launch_dock(
                        mode=cfg.dock.mode,
                        num_warehouses=cfg.dock.num_warehouses,
                        get_timeout_s=cfg.dock.get_timeout_s,
                        policy=cfg.dock.policy,
                        max_rows=cfg.dock.max_rows,
                        transport=cfg.dock.transport,
                        name_prefix=prefix,
                    )
                )
                _watch_dock(supervisor, dock.docks[-1])
            startup.mark("dock")
            # Each group gets its spec (config/specs.py), the plan and its dock client: the config stops here.
            # Every group's processes start side by side (imports dominate), then each is waited for.
            parts = specs(cfg, plan)
            started["env_workers"] = envs = _start_env_workers(cfg, parts)
            started["actors"], started["rewards"] = _start_workers(cfg, parts, plan, dock, supervisor, envs)
            started["reward_models"] = _start_reward_models(cfg, parts, dock, supervisor)
            started["critic"] = _start_critic(cfg, parts, plan, dock, supervisor)
            started["rollouts"] = _start_rollouts(cfg, parts, plan, dock, supervisor, envs)
            started["teacher"] = _start_teacher(cfg, parts, dock, supervisor)
            for name, group in started.items():
                if isinstance(group, WorkerGroup):
                    group.wait_started()
                    startup.mark(f"started/{name}")
            _check_output_dir(cfg, started["actors"], started["critic"])
            supervisor.step, supervisor.stage = None, Stage.SETUP
            setup = started["actors"].setup(resume_from)
            if started["critic"] is not None:
                started["critic"].setup(resume_from, kl_coef).wait()
            if started["rollouts"] is not None:
                started["rollouts"].setup().wait()
            if started["teacher"] is not None:
                started["teacher"].setup().wait()
            setup.wait()
            if started["rollouts"] is not None:
                _connect_weight_sync(started["actors"], started["rollouts"])
            startup.mark("setup")
            supervisor.stage = None
            return cls(
                client=dock.client(),
                plan=plan,
                supervisor=supervisor,
                reference_path=reference_path,
                parent_checkpoint=resume_from,
                **started,
            )
        except BaseException:
            supervisor.kill_all()
            for name, part in started.items():
                if name == "env_workers":
                    _kill_env_workers(part)
                elif part is not None:
                    part.shutdown()  # the dock, and groups not yet named to the supervisor
            raise

    def worker_nodes(self) -> dict[str, str]:
        """The node address each worker runs on (`actor-0` -> `10.0.0.5`), for the run's summary."""
        groups = [self.actors, self.rewards, self.reward_models, self.critic, self.rollouts, self.teacher]
        return {
            name: ident["node_ip"]
            for group in groups
            if group is not None
            for name, ident in zip(group.names, group.identities)
        }

    def close(self) -> None:
        """The normal end: stop the reward process pools, then every actor and the dock."""
        try:
            self.rewards.close().wait()
        except WorkerError as exc:  # a reward worker that fails to close must not fail a finished run
            log.warning("closing reward workers failed: %s", exc)
        self.kill()

    def kill(self) -> None:
        """Kill every actor of this attempt at once (after a failure: nothing is asked politely)."""
        self.supervisor.kill_all()
        _kill_env_workers(self.env_workers)
        self.dock.shutdown()


def _start_env_workers(cfg: TrainConfig, parts: Specs) -> list[Any] | None:
    """The environment tier of a multi-turn run (env.num_workers processes, placement.env), else None."""
    env = parts.rollout.env
    if env is None:
        return None
    from dockrl.models.config import read_config

    return start_env_workers(env, read_config(cfg.model.path).family, cfg.placement.env, cfg.model.path)


def _kill_env_workers(workers: list[Any] | None) -> None:
    import ray

    for worker in workers or []:
        ray.kill(worker, no_restart=True)


def check_placement(cfg: TrainConfig) -> None:
    """Every resource placement.* names is offered by some node of the Ray cluster (else no rank could ever
    start there: a ConfigError naming the setting, before any worker starts)."""
    import ray

    from dockrl.config.fields import config_error

    offered = ray.cluster_resources()
    for group in ("actor", "rollout", "reward", "reward_model", "critic", "teacher", "env"):
        for resource in getattr(cfg.placement, group):
            if offered.get(resource, 0) <= 0:
                custom = sorted(
                    k for k in offered if k not in _BUILTIN_RESOURCES and not k.startswith("node:")
                )
                raise config_error(
                    f"placement.{group}",
                    getattr(cfg.placement, group),
                    f"no node of the Ray cluster offers the resource {resource!r} (custom resources: {custom})",
                    "start the nodes with `ray start --resources=...`, or name one of those",
                )


_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"}


def _watch_dock(supervisor: Supervisor, dock: Dock | CentralDockHandle) -> None:
    """Heartbeats of the dock's actors (controller and warehouses, or single mode's buffer)."""
    import ray

    if isinstance(dock, Dock):
        assert dock.names is not None  # a launched dock names its actors (Dock.launch)
        actors = list(zip(dock.names, [dock.controller, *dock.warehouses]))
        method = "get_incarnation"
    else:
        actors = [("dockrl-buffer", dock.actor)] if dock.actor is not None else []
        method = "stats"
    identities = ray.get([a.__ray_call__.remote(process_identity) for _, a in actors], timeout=60)
    for (name, actor), ident in zip(actors, identities):
        where = f"dock, node {ident['node_ip']} {ident['node_id'][:8]}, pid {ident['pid']}"
        supervisor.watch(name, actor, where, method=method, pid=ident["pid"], node_ip=ident["node_ip"])


def _start_workers(
    cfg: TrainConfig, parts: Specs, plan: StepPlan, dock, supervisor: Supervisor, envs: list[Any] | None
) -> tuple[ActorGroup, RewardGroup]:
    num_actor_ranks = cfg.actor.dp * cfg.actor.cp * cfg.actor.tp
    actors = _group(
        cfg.run,
        supervisor,
        ActorGroup,
        num_actor_ranks,
        "actor",
        place=cfg.placement.actor,
        gpu=True,
        distributed=True,
        spec=parts.actor,
        plan=plan,
        client=dock.client(),
        env_workers=envs,
        num_threads=threads_per_rank(cfg, num_actor_ranks),
    )
    rewards = _group(
        cfg.run,
        supervisor,
        RewardGroup,
        cfg.reward.num_workers,
        "reward",
        place=cfg.placement.reward,
        gpu=False,
        spec=parts.reward,
        client=dock.client(),
    )
    return actors, rewards


def _start_reward_models(
    cfg: TrainConfig, parts: Specs, dock, supervisor: Supervisor
) -> RewardModelGroup | None:
    """RewardModelWorkers when reward.model.path is set (one GPU each on cuda), else None."""
    if parts.reward_model is None:
        return None
    return _group(
        cfg.run,
        supervisor,
        RewardModelGroup,
        cfg.reward.model.num_workers,
        "reward_model",
        place=cfg.placement.reward_model,
        gpu=True,
        spec=parts.reward_model,
        client=dock.client(),
    )


def _start_critic(
    cfg: TrainConfig, parts: Specs, plan: StepPlan, dock, supervisor: Supervisor
) -> CriticGroup | None:
    """PPO's CriticWorkers (critic.dp x critic.cp ranks in their own process group; one GPU each on cuda), else
    None."""
    if parts.critic is None:
        return None
    critic = cfg.critic
    ranks = critic.dp * critic.cp
    return _group(
        cfg.run,
        supervisor,
        CriticGroup,
        ranks,
        "critic",
        place=cfg.placement.critic,
        gpu=True,
        distributed=True,
        spec=parts.critic,
        plan=plan,
        client=dock.client(),
        num_threads=threads_per_rank(cfg, ranks),
    )


def _start_teacher(cfg: TrainConfig, parts: Specs, dock, supervisor: Supervisor) -> TeacherGroup | None:
    """distill.teacher_path: distill.num_workers TeacherWorkers in their own process group (one GPU each on
    cuda), else None."""
    if parts.teacher is None:
        return None
    ranks = cfg.distill.num_workers
    return _group(
        cfg.run,
        supervisor,
        TeacherGroup,
        ranks,
        "teacher",
        place=cfg.placement.teacher,
        gpu=True,
        distributed=True,
        spec=parts.teacher,
        client=dock.client(),
        num_threads=threads_per_rank(cfg, ranks),
    )


def _start_rollouts(
    cfg: TrainConfig, parts: Specs, plan: StepPlan, dock, supervisor: Supervisor, envs: list[Any] | None
) -> RolloutGroup | None:
    """rollout.placement=separate: rollout.replicas RolloutWorkers (one GPU each on cuda), else None."""
    if cfg.rollout.placement != "separate":
        return None
    return _group(
        cfg.run,
        supervisor,
        RolloutGroup,
        cfg.rollout.replicas,
        "rollout",
        place=cfg.placement.rollout,
        gpu=True,
        spec=parts.rollout,
        plan=plan,
        client=dock.client(),
        env_workers=envs,
    )


def _check_output_dir(cfg: TrainConfig, *groups: WorkerGroup | None) -> None:
    """Every node with training ranks (they write checkpoint shards) must see the driver's run.output_dir."""
    probe = write_probe(cfg.run.output_dir)
    try:
        for pending in [group.check_output_dir(probe) for group in groups if group is not None]:
            pending.wait()
    finally:
        remove_probe(probe)


def _connect_weight_sync(actors: ActorGroup, rollouts: RolloutGroup) -> None:
    """The gloo group of the actor's rank 0 and every rollout replica (weights go through it each update)."""
    addr, port = actors.weight_sync_address()
    world = 1 + len(rollouts)
    joining = actors.join_weight_sync(addr, port, world)
    rollouts.join_weight_sync(addr, port, world).wait()
    joining.wait()


def sync_rollout_weights(cluster: Cluster, version: int) -> float:
    """Send the policy after `version` updates to the separate rollout replicas, unless they hold it; returns
    the seconds it took (0 when nothing was sent)."""
    import time

    if cluster.rollouts is None or cluster.rollout_version == version:
        return 0.0
    start = time.perf_counter()
    sending = cluster.actors.send_weights()
    cluster.rollouts.receive_weights(version).wait()
    sending.wait()
    cluster.rollout_version = version
    return time.perf_counter() - start


def _group(
    run: RunConfig,
    supervisor: Supervisor,
    group: type[G],
    size: int,
    name: str,
    *,
    place: list[str],
    gpu: bool,
    distributed: bool = False,
    **init,
) -> G:
    """`size` Ray actors of `group.worker` (constructed with `init`) that reserve no CPU, and one GPU each when
    `gpu` and run.device=cuda, on the nodes offering the resources `place` names (placement.<group>);
    `distributed` joins them in one process group on run.device. They start in the background:
    `wait_started()` before use."""
    assert group.worker is not None, f"{group.__name__} names its worker class"
    return group(
        group.worker,
        size,
        name=name,
        distributed=distributed,
        device=run.device,
        num_gpus=1 if gpu and run.device == "cuda" else 0,
        num_cpus=0,
        timeout_s=run.worker_timeout_s,
        init_kwargs=init,
        node_resources=place,
        supervisor=supervisor,
        wait=False,
    )


def threads_per_rank(cfg: TrainConfig, ranks: int) -> int | None:
    """Torch threads of each of a trainer group's `ranks` ranks (None: torch's default): run.threads_per_rank
    when set (on cuda too, the CPU side's), else on cpu the machine's cores split over the ranks, on cuda
    torch's default."""
    if cfg.run.threads_per_rank > 0:
        return cfg.run.threads_per_rank
    return None if cfg.run.device == "cuda" else max(1, (os.cpu_count() or 1) // ranks)
