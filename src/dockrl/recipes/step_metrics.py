"""One RL step's figures, from what its schedule returns (a StepRecord): a pure function, no Ray, no dock.

    recipes/sync_step.py, async_step.py ─▶ StepRecord ─▶ step_metrics ─▶ {metric name: value} ─▶ metrics.jsonl

The names are declared in observe/metric_names.py. Each worker reports one record per rank
(workers/results.py); the figures combine them: per-row lists are concatenated, update metrics are taken from
the first rank (already all-reduced across the group).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from dockrl.algos.distill import DistillSums
from dockrl.dock.metrics import bytes_moved, driver_bytes
from dockrl.dock.stages import Stage
from dockrl.observe import metric_names as names
from dockrl.recipes.common import EncodedPrompt
from dockrl.workers.results import GenerateResult, ScoreResult, TeacherResult, UpdateResult


@dataclass
class SamplingCounts:
    """DAPO dynamic sampling's figures of one step (recipes/dynamic_sampling.py)."""

    rounds: int  # rollout rounds run
    generated_groups: int  # groups generated over the rounds
    informative_groups: int  # kept groups with reward spread
    filled_groups: int  # kept zero-spread groups (the rounds ran out)
    dropped_groups: int  # groups dropped from the dock


@dataclass
class StepRecord:
    """What one step of a schedule did: its prompts, each rank's stage results, timings and the dock's stats.

    `generated` and `scored` hold one entry per rollout rank and reward worker (per round with dynamic
    sampling); `updates` and `critic_updates` one per actor and critic rank (empty when that group did not
    update, e.g. the actor in PPO's warm-up).
    """

    step: int
    batch: list[EncodedPrompt]  # every prompt generated this step (all rounds of dynamic sampling)
    generated: list[GenerateResult]
    scored: list[ScoreResult]
    updates: list[UpdateResult]
    timings: dict[str, float]  # StageTimer seconds by stage name, in the order the stages ended
    dock_stats: dict[str, Any]  # the driver client's stats() before the step's reset
    critic_updates: list[UpdateResult] = field(default_factory=list)
    sampling: SamplingCounts | None = None  # DAPO dynamic sampling only
    teacher: list[TeacherResult] = field(
        default_factory=list
    )  # distillation: one per teacher rank (and round)

    @property
    def samples(self) -> list[dict[str, Any]]:
        """The rows the reward workers picked for samples.jsonl."""
        return [s for worker in self.scored for s in worker.samples]


def step_metrics(
    record: StepRecord, *, samples_per_prompt: int, staleness: bool, partial: bool
) -> dict[str, float]:
    """The step's figures (metric name -> value). `staleness`: rows may come from older weights (async and
    partial schedules); `partial`: partial rollout's cut and continued rows are counted."""
    lengths = [x for g in record.generated for x in g.response_lengths]
    prompt_tokens = sum(len(p.ids) for p in record.batch) * samples_per_prompt
    response_tokens = sum(lengths)
    m = _rewards_and_lengths(record, lengths)
    for key, value in record.updates[0].metrics.items() if record.updates else ():
        m[key if "/" in key else f"{names.ACTOR_PREFIX}{key}"] = value
    m.update(_timings(record))
    m.update(_throughput(record.timings, prompt_tokens + response_tokens, response_tokens))
    m.update(_dock(record.dock_stats))
    m[names.DOCK_ROWS] = float(sum(len(s.rewards) for s in record.scored))
    if staleness:
        m.update(_staleness(record))
    if partial:
        m[names.ROLLOUT_INTERRUPTED] = float(sum(len(g.interrupted) for g in record.generated))
        m[names.ROLLOUT_CONTINUED] = float(sum(g.continued for g in record.generated))
    m.update(_env(record, response_tokens))
    m.update(_weight_sync(record))
    m[names.TOKENS_PROMPT] = float(prompt_tokens)
    m[names.TOKENS_RESPONSE] = float(response_tokens)
    if record.sampling is not None:
        m.update(_sampling(record.sampling))
    m.update(record.critic_updates[0].metrics if record.critic_updates else {})
    m.update(_distill(record.teacher))
    return m


def _distill(results: list[TeacherResult]) -> dict[str, float]:
    """distill/reverse_kl and distill/teacher_logprob per sampled token, and the teacher's busy time (its
    slowest rank's; the ranks run in lockstep); {} without a teacher."""
    if not results:
        return {}
    sums = DistillSums()
    for result in results:
        sums = sums.merge(result.sums)
    return {**sums.means(), names.TIMING_TEACHER_BUSY: max(r.busy_s for r in results)}


def describe(values: list[float], prefix: str) -> dict[str, float]:
    """mean/std/min/max of a list as `prefix/<stat>` metrics (empty lists give nothing)."""
    if not values:
        return {}
    return {
        f"{prefix}/{names.MEAN}": statistics.fmean(values),
        f"{prefix}/{names.STD}": statistics.pstdev(values) if len(values) > 1 else 0.0,
        f"{prefix}/{names.MIN}": float(min(values)),
        f"{prefix}/{names.MAX}": float(max(values)),
    }


def _rewards_and_lengths(record: StepRecord, lengths: list[int]) -> dict[str, float]:
    scored = record.scored
    m = describe([float(r) for s in scored for r in s.rewards], names.REWARD)
    m.update(describe([float(x) for x in lengths], names.RESPONSE_LENGTH))
    m[names.RESPONSE_TRUNCATED_FRAC] = sum(g.truncated for g in record.generated) / max(1, len(lengths))
    correct = [x for s in scored for x in s.correct]
    if correct:
        m[names.TRAIN_ACCURACY] = statistics.fmean(correct)
    overlong = [x for s in scored for x in s.overlong]
    rm = [x for s in scored for x in s.rm]
    if rm:  # raw reward-model scores; reward/mean includes reward.model.weight x these
        m[names.REWARD_RM] = statistics.fmean(rm)
    if overlong:
        m[names.REWARD_OVERLONG_PENALTY] = statistics.fmean(overlong)
        m[names.REWARD_OVERLONG_FRAC] = sum(x < 0 for x in overlong) / len(overlong)
    m[names.REWARD_TIMEOUTS] = float(sum(s.timeouts for s in scored))
    m[names.REWARD_ERRORS] = float(sum(s.errors for s in scored))
    m[names.REWARD_DROPPED_GROUPS] = float(sum(s.dropped_groups for s in scored))
    return m


def _weight_sync(record: StepRecord) -> dict[str, float]:
    """A backend that loads its weights (vLLM): the slowest rank's weight load, its bytes, the worst probe
    difference and the fewest tensors the digest checked ({} with the dockrl engine)."""
    syncs = [g.weight_sync for g in record.generated if g.weight_sync]
    if not syncs:
        return {}
    return {
        names.TIMING_WEIGHT_LOAD: max(s["seconds"] for s in syncs),
        names.ROLLOUT_WEIGHT_LOAD_MB: max(s["bytes"] for s in syncs) / 2**20,
        names.ROLLOUT_PROBE_ABS_DIFF: max(s.get("probe_abs_diff", 0.0) for s in syncs),
        names.ROLLOUT_DIGEST_TENSORS: min(s.get("digest_tensors", 0.0) for s in syncs),
    }


def _env(record: StepRecord, response_tokens: int) -> dict[str, float]:
    """Multi-turn figures from the rollout ranks' env counters ({} for single-turn runs)."""
    counts: dict[str, float] = {}
    for g in record.generated:
        for key, value in g.env.items():
            counts[key] = counts.get(key, 0.0) + float(value)
    if not counts:
        return {}
    trajectories = max(1.0, counts["trajectories"])
    return {
        names.ENV_TURNS: counts["turns"] / trajectories,
        names.ENV_TOOL_CALLS: counts["tool_calls"] / trajectories,
        names.ENV_TOOL_CALL_RATE: counts["with_tool_calls"] / trajectories,
        names.ENV_TOOL_ERRORS: counts["tool_errors"],
        names.ENV_TIMEOUTS: counts["timeouts"],
        names.ENV_TRUNCATED: counts["truncated"] / trajectories,
        names.ENV_FAILED: counts["failed"],
        names.ENV_TEMPLATE_MISMATCH: counts["template_mismatch"],
        names.AGENT_PREFIX_BREAKS: counts.get("prefix_breaks", 0.0),
        names.TIMING_ENV: counts["env_s"],
        names.TIMING_ENV_WAIT: max(float(g.env.get("env_wait_s", 0.0)) for g in record.generated),
        names.ENV_POLICY_TOKEN_FRAC: counts["policy_tokens"] / max(1, response_tokens),
        names.THROUGHPUT_POLICY_TOKENS_PER_S: counts["policy_tokens"]
        / max(record.timings[Stage.ROLLOUT], 1e-9),
        names.ROLLOUT_PREFILL_TOKENS: counts.get("prefill_tokens", 0.0),
        names.ROLLOUT_KV_REUSED_TOKENS: counts.get("kv_reused_tokens", 0.0),
    }


def _timings(record: StepRecord) -> dict[str, float]:
    m = {names.timing(stage): seconds for stage, seconds in record.timings.items()}
    m[names.TIMING_RESHARD_TO_ROLLOUT] = max(g.reshard_s for g in record.generated)
    if any(g.busy_s for g in record.generated):  # separate replicas (the rest of the rollout they idle)
        m[names.TIMING_ROLLOUT_BUSY] = max(g.busy_s for g in record.generated)
    return m


def _throughput(seconds: dict[str, float], tokens: int, response_tokens: int) -> dict[str, float]:
    m = {
        names.THROUGHPUT_TOKENS_PER_S: tokens / seconds[Stage.STEP],
        names.THROUGHPUT_ROLLOUT_TOKENS_PER_S: response_tokens / max(seconds[Stage.ROLLOUT], 1e-9),
        names.THROUGHPUT_UPDATE_TOKENS_PER_S: tokens / max(seconds[Stage.UPDATE], 1e-9),
    }
    if Stage.REFERENCE in seconds:
        m[names.THROUGHPUT_REFERENCE_TOKENS_PER_S] = tokens / max(seconds[Stage.REFERENCE], 1e-9)
    return m


def _dock(stats: dict[str, Any]) -> dict[str, float]:
    m = {
        names.DOCK_BYTES_IN_WAREHOUSES: float(sum(w.get("bytes", 0) for w in stats.get("warehouses", []))),
        names.DOCK_BYTES_MOVED: float(bytes_moved(stats)),
        names.DOCK_DRIVER_BYTES: float(driver_bytes(stats)),
    }
    for op, latency in stats.get("latency_ms", {}).items():  # controller service times
        m[names.dock_p99(op)] = latency["p99_ms"]
    return m


def _staleness(record: StepRecord) -> dict[str, float]:
    # Of each trained row: updates the trained policy (after step - 1 of them) is ahead of the weights that
    # sampled the row's oldest token.
    behind = [float(record.step - 1 - v) for s in record.scored for v in s.versions]
    return {
        names.STALENESS_MEAN: statistics.fmean(behind) if behind else 0.0,
        names.STALENESS_MAX: max(behind, default=0.0),
    }


def _sampling(counts: SamplingCounts) -> dict[str, float]:
    return {
        names.DAPO_ROUNDS: float(counts.rounds),
        names.DAPO_GENERATED_GROUPS: float(counts.generated_groups),
        names.DAPO_INFORMATIVE_GROUPS: float(counts.informative_groups),
        names.DAPO_FILLED_GROUPS: float(counts.filled_groups),
        names.DAPO_DROPPED_GROUPS: float(counts.dropped_groups),
    }
