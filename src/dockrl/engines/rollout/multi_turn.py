"""Multi-turn rollout: trajectories of policy turns and environment observations, token in and token out.

```
 pull whole groups (prompt_ids, env_row) ─▶ per row: a fresh environment, reset(row) ─▶ turn 1 request
 engine.step() ─▶ a finished turn: its sampled tokens join the trajectory (loss_mask 1, their log-probs)
     └▶ env.step(message) in a thread pool; the engine keeps decoding the other samples meanwhile
 an observation returns ─▶ its tokens (the chat template's delta) join the trajectory (loss_mask 0) ─▶ next
     turn request: prompt + trajectory so far; only its new tokens prefilled on the KV kept (see below)
 a trajectory ends (the environment says done, or a limit) ─▶ response_ids / rollout_logprobs / loss_mask /
     policy_version / env_reward / env_failed put for its row
```

Token in, token out: the tokens of a trajectory are the prompt's, the ones the policy sampled, and the
observation tokens, each appended as it happens; a sampled token is never decoded and encoded again.
Observation tokens are the chat template's delta: with `history` the conversation so far and `assistant` the
message just sampled, the observation text is

    render(history + [assistant] + observation, add_generation_prompt=True)
        minus render(history + [assistant])                  what the new messages add, and before it
    render(history + [assistant]) minus render(history, add_generation_prompt=True) minus the sampled text
                                                             the template's close of the assistant turn

encoded on its own. The second part matters: ChatML renders "<|im_end|>\\n" after an assistant message, the
policy stops at "<|im_end|>", and the "\\n" belongs to no one unless it is put here (the newline peers lost at
every tool boundary). A turn cut at its token limit is closed the same way. Where the template is not
append-only (it re-renders earlier turns differently, as Qwen3 strips earlier `<think>` blocks), the trajectory
keeps its own history: the earlier turns stay as sampled, only the new suffix is taken from the template, and
`env/template_mismatch` counts the turns where a fresh render of the conversation would differ.

KV across turns (keep_kv, rollout.keep_kv_across_turns): a trajectory gives up its slot while its environment
runs - holding it would block other samples for as long as a tool runs (seconds, against milliseconds of
decode) - but its KV stays: each turn's request carries the row as its `kv_key`, the engine keeps the finished
turn's KV under it (max-length slots: the slot is parked; paged: its blocks), and the next turn's request, whose
prompt is the whole trajectory so far, prefills only what the kept positions lack (the last sampled token and
the observation) on top of them. An agent's request that continues its trajectory does the same; one that
rewrote its history (a prefix break) finds no match and is prefilled whole. Kept KV takes only room nothing
else needs: a new sequence that needs the slot or the blocks takes them, oldest kept first, and that
trajectory's next turn re-prefills its prefix in one batched prefill, shared with the other prompts admitted
in the same step (what every turn did with keep_kv off). The tokens are the same either way; the log-probs
differ by fp32 reassociation (the kept keys came from decode steps, not from a prefill of the whole prefix).
`rollout/prefill_tokens` counts the positions prefilled in a step, `rollout/kv_reused_tokens` those found kept.

Seeds: turn k of row r samples with `turn_seed(row_seed(r), k)`, so a trajectory depends only on its row, the
weights and the environment: a deterministic environment regenerates it exactly (how exact resume treats
trajectories in flight at a checkpoint: they are regenerated).

Limits (env.*): max_turns, max_tool_calls, max_response_tokens over the whole trajectory (sampled and
observation tokens), rollout.max_new_tokens per turn (a turn cut there still goes to the environment, whose
parser sees what was written, and the template closes it), call_timeout_s per environment call. A trajectory
that runs out ends truncated (`env/truncated`); an environment that raises ends its trajectory as failed
(env_failed = 1: the reward stage drops its group or scores it 0, per reward.on_error).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dockrl.dock.api import Pull, RowSource
from dockrl.dock.columns import (
    ENV_FAILED,
    ENV_REWARD,
    ENV_ROW,
    LOSS_MASK,
    POLICY_VERSION,
    PROMPT_IDS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
)
from dockrl.dock.errors import DockTimeoutError
from dockrl.dock.stages import Stage
from dockrl.engines.rollout.backend import RolloutBackend
from dockrl.engines.rollout.requests import Request
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.envs.base import Message, ModelRequest, Observation, check_messages
from dockrl.envs.chat_delta import ChatDelta
from dockrl.envs.host import EnvCalls, Outcome

ENV_METRICS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "timeouts",
    "truncated",
    "template_mismatch",
    "prefix_breaks",
)

# The engine's prefill counters, reported per call in "env" (rollout/prefill_tokens, rollout/kv_reused_tokens).
KV_STATS = ("prefill_tokens", "kv_reused_tokens", "shared_prompt_tokens")


@dataclass(frozen=True)
class TurnLimits:
    """How far a trajectory may go (module docstring)."""

    max_turns: int
    max_tool_calls: int
    max_response_tokens: int
    call_timeout_s: float


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (0-based) of a trajectory whose row seed is `seed`."""
    return seed if turn == 0 else (seed * 1_000_033 + turn * 104_729) % (2**63 - 1)


@dataclass
class _Trajectory:
    row: int
    seed: int
    prompt: list[int]
    history: list[Message]  # empty until the environment's reset answers
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENV_METRICS, 0))
    reward: float | None = None
    failed: str | None = None
    started: bool = False  # its environment's reset answered
    pending_text: str = ""  # the last assistant message, while its environment call runs
    turn_start: int = 0  # where the last turn's sampled tokens start in `ids`
    request: ModelRequest | None = None  # an agent's: its open request (it brings its prompt)


def _room(engine: RolloutBackend, live: dict, max_rows: int | None) -> int:
    """Trajectories this replica may start now: its free slots, within its share of the step."""
    free = engine.num_free_slots()
    return free if max_rows is None else min(free, max_rows - len(live))


def serve_multi_turn(
    engine: RolloutBackend,
    client: RowSource,
    *,
    consumer: Stage,
    params: SamplingParams,
    group_size: int,
    groups_per_pull: int,
    row_seed: Callable[[int], int],
    envs: EnvCalls,
    delta: ChatDelta,
    system_prompt: str | None,
    limits: TurnLimits,
    version: int | None = None,
    peers: Any = None,
    keep_kv: bool = True,
    max_rows: int | None = None,
) -> dict[str, Any]:
    """Generate a trajectory for every row `consumer` gets from the dock (module docstring); returns lengths,
    the summed env counters (ENV_METRICS), env_s (seconds environment calls ran, summed over calls that run
    concurrently), env_wait_s (wall seconds the loop waited on calls with nothing to decode: what the
    environments cost the rollout) and the engine's stats. `envs` runs the environment calls, on the head rank
    only of the tensor-parallel group `peers` talks for (a ReplicaClient; default: `client`): see Lockstep.
    keep_kv: a waiting trajectory's KV stays in the engine for its next turn (see "KV across turns"; an engine
    without `forget`, vLLM's, caches prefixes its own way). max_rows: the most trajectories held at once (this
    replica's share of the step: dock_feed.serve_from_dock)."""
    calls = Lockstep(envs, client if peers is None else peers)
    keep = keep_kv and hasattr(engine, "forget")
    if keep:
        engine.forget_all()  # type: ignore[attr-defined]  # KV of earlier weights
    counted = {key: engine.stats.get(key, 0) for key in KV_STATS}
    exhausted = False
    live: dict[int, _Trajectory] = {}
    waiting: set[int] = set()  # rows whose environment call runs: the same set on every tp peer
    lengths: list[int] = []
    totals = dict.fromkeys(ENV_METRICS, 0)
    totals["trajectories"] = totals["with_tool_calls"] = totals["failed"] = totals["policy_tokens"] = 0
    env_s = env_wait_s = 0.0

    cache = getattr(engine, "max_seq_len", None)  # tokens per sequence the engine holds (prompt included)

    def submit_turn(traj: _Trajectory) -> None:
        budget = limits.max_response_tokens - len(traj.ids)
        if cache is not None:  # a budget past the model's positions: the cache ends the trajectory first
            budget = min(budget, cache - len(traj.prompt) - len(traj.ids))
        if budget < 1:
            finish(traj, truncated=True)
            return
        turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget))
        request = traj.request
        if request is not None:  # an agent's max_tokens and stop strings, within the run's limits
            turn_params = dataclasses.replace(
                turn_params,
                max_new_tokens=min(turn_params.max_new_tokens, request.max_tokens or budget),
                stop_strings=[*turn_params.stop_strings, *request.stop],
            )
        seed = turn_seed(traj.seed, traj.counts["turns"])
        kv_key = traj.row if keep else None
        engine.add(Request(traj.prompt + traj.ids, [seed], turn_params, tag=[traj.row], kv_key=kv_key))

    def finish(traj: _Trajectory, truncated: bool = False) -> None:
        traj.counts["truncated"] += int(truncated)
        live.pop(traj.row, None)
        calls.drop(traj.row)
        if keep:
            engine.forget(traj.row)  # type: ignore[attr-defined]
        if not traj.ids:  # failed before its first turn: one masked stop token, so every row has a response
            traj.ids, traj.logprobs, traj.mask = [params.stop_token_ids[0]], [0.0], [0.0]
        ids = torch.tensor(traj.ids, dtype=torch.int64)
        batch: dict[str, list] = {
            RESPONSE_IDS: [ids],
            ROLLOUT_LOGPROBS: [torch.tensor(traj.logprobs, dtype=torch.float32)],
            LOSS_MASK: [torch.tensor(traj.mask, dtype=torch.float32)],
            ENV_REWARD: [math.nan if traj.reward is None else float(traj.reward)],
            ENV_FAILED: [float(traj.failed is not None)],
        }
        if version is not None:
            batch[POLICY_VERSION] = [torch.full((len(ids),), version, dtype=torch.int64)]
        if traj.request is not None:  # an agent's trajectory continues its own first request, not the row's
            batch[PROMPT_IDS] = [torch.tensor(traj.prompt, dtype=torch.int64)]
        client.put(consumer, [traj.row], batch)
        lengths.append(len(ids))
        for key in ENV_METRICS:
            totals[key] += traj.counts[key]
        totals["trajectories"] += 1
        totals["with_tool_calls"] += int(traj.counts["tool_calls"] > 0)
        totals["failed"] += int(traj.failed is not None)
        totals["policy_tokens"] += int(sum(traj.mask))

    def reset_done(traj: _Trajectory, obs: Observation) -> None:
        first = check_messages(obs.as_messages(), "environment reset")
        traj.history = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + first
        traj.started = True
        submit_turn(traj)

    def observed(traj: _Trajectory, obs: Observation) -> None:
        """An environment's answer to the trajectory's last assistant message."""
        for key in ("tool_calls", "tool_errors", "timeouts"):
            traj.counts[key] += int(obs.info.get(key, 0))
        if obs.done:
            traj.reward = obs.reward
            finish(traj)
            return
        if traj.counts["turns"] >= limits.max_turns or traj.counts["tool_calls"] > limits.max_tool_calls:
            traj.reward = obs.reward
            finish(traj, truncated=True)
            return
        new = check_messages(obs.as_messages(), "environment step")
        assistant = traj.pending_text
        sampled_text = delta.tokenizer.decode(traj.ids[traj.turn_start :], skip_special_tokens=False)
        obs_ids, append_only = delta.observation(traj.history, assistant, sampled_text, new)
        traj.counts["template_mismatch"] += int(not append_only)
        after = len(traj.ids) + len(obs_ids)
        if after >= limits.max_response_tokens or (cache is not None and len(traj.prompt) + after >= cache):
            finish(traj, truncated=True)  # no room left for another turn (in the budget, or in the cache)
            return
        traj.ids += obs_ids
        traj.logprobs += [0.0] * len(obs_ids)
        traj.mask += [0.0] * len(obs_ids)
        traj.history += [{"role": "assistant", "content": assistant}, *new]
        submit_turn(traj)

    def requested(traj: _Trajectory, request: ModelRequest) -> None:
        """An agent's request (serve/agent_host.py): its prompt continues the trajectory (the tokens between are
        observations), or starts the trajectory over (a prefix break: the agent rewrote its history)."""
        traj.counts["tool_calls"] += request.tool_results
        if traj.started and (
            traj.counts["turns"] >= limits.max_turns or traj.counts["tool_calls"] > limits.max_tool_calls
        ):
            finish(traj, truncated=True)
            return
        so_far = traj.prompt + traj.ids
        if traj.started and request.prompt_ids[: len(so_far)] == so_far:
            between = request.prompt_ids[len(so_far) :]
            after = len(traj.ids) + len(between)
            if after >= limits.max_response_tokens or (
                cache is not None and len(traj.prompt) + after >= cache
            ):
                finish(traj, truncated=True)  # no room for another turn (as observed())
                return
            traj.ids += between
            traj.logprobs += [0.0] * len(between)
            traj.mask += [0.0] * len(between)
        elif cache is not None and len(request.prompt_ids) >= cache:
            finish(traj, truncated=True)  # the request cannot fit: what the trajectory holds stays
            return
        else:
            traj.counts["prefix_breaks"] += int(traj.started)
            traj.prompt, traj.ids, traj.logprobs, traj.mask = list(request.prompt_ids), [], [], []
        traj.started, traj.request = True, request
        submit_turn(traj)

    def outcome(row: int, result: Outcome) -> None:
        """A call of `row`'s environment ended (the same outcomes, in the same order, on every tp peer)."""
        waiting.discard(row)
        traj = live.get(row)
        if traj is None:  # its trajectory already ended
            return
        if result.kind == "timeout":
            traj.counts["timeouts"] += 1
            finish(traj, truncated=True)
        elif result.kind != "ok" or result.observation is None:
            traj.failed = result.error or result.kind
            finish(traj)
        else:
            try:
                observation = result.observation
                if isinstance(observation, ModelRequest):
                    requested(traj, observation)
                elif observation.done and not traj.started:  # ended before a turn (an agent that never asked)
                    traj.reward = observation.reward
                    finish(traj)
                else:
                    (observed if traj.started else reset_done)(traj, observation)
            except ValueError as exc:  # the environment answered something that is not messages
                traj.failed = str(exc)
                finish(traj)

    try:
        while True:
            while not exhausted and _room(engine, live, max_rows) >= group_size:
                num_groups = min(groups_per_pull, _room(engine, live, max_rows) // group_size)
                status, got = _pull(client, consumer, num_groups * group_size, group_size, busy=bool(live))
                if status == "done":
                    exhausted = True
                if got is None:
                    break
                rows, batch = got
                for row, prompt, env_row in zip(rows, batch[PROMPT_IDS], batch[ENV_ROW]):
                    ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
                    live[row] = _Trajectory(row, row_seed(row), ids, [])
                    waiting.add(row)
                    calls.reset(row, dict(env_row), limits.call_timeout_s)
            if engine.has_work():
                for completion in engine.step():
                    traj = live[completion.tag[completion.sample]]
                    gen = completion.generation
                    traj.turn_start = len(traj.ids)
                    traj.ids += gen.token_ids.tolist()
                    traj.logprobs += gen.logprobs.tolist()
                    traj.mask += [1.0] * len(gen.token_ids)
                    traj.counts["turns"] += 1
                    if len(traj.ids) >= limits.max_response_tokens:  # no room for an observation
                        finish(traj, truncated=True)
                        continue
                    calls_left = limits.max_tool_calls + 1 - traj.counts["tool_calls"]  # one more ends it
                    waiting.add(traj.row)
                    if traj.request is not None:  # an agent: its open request is answered with the tokens
                        answer = {
                            "token_ids": gen.token_ids.tolist(),
                            "logprobs": gen.logprobs.tolist(),
                            "finish_reason": gen.finish_reason,
                        }
                        calls.step(traj.row, answer, limits.call_timeout_s, calls_left)
                        continue
                    # A turn cut at rollout.max_new_tokens still goes to the environment as it is (a call
                    # it holds is parsed; the template closes the turn in the observation tokens).
                    traj.pending_text = delta.tokenizer.decode(
                        _without_stop(gen.token_ids.tolist(), params.stop_token_ids),
                        skip_special_tokens=False,
                    )
                    calls.step(traj.row, traj.pending_text, limits.call_timeout_s, calls_left)
            elif not waiting:
                if exhausted:
                    break
                continue  # nothing running: the next pull blocks until rows arrive
            if not waiting:
                continue
            block = not engine.has_work()
            waited = time.perf_counter()
            for row, result in calls.ready(WAIT_S if block else 0.0):
                env_s += result.seconds
                outcome(row, result)
            if block:
                env_wait_s += time.perf_counter() - waited
    finally:
        for row in list(live):
            calls.drop(row)
        if keep:
            engine.forget_all()  # type: ignore[attr-defined]
    totals.update({key: engine.stats.get(key, 0) - counted[key] for key in KV_STATS})
    return {
        "response_lengths": lengths,
        "truncated": totals["truncated"],
        "env": {**totals, "env_s": env_s, "env_wait_s": env_wait_s},
        "interrupted": [],
        "continued": 0,
        **engine.stats,
    }


WAIT_S = 1.0  # how long an idle loop waits for an environment call before looking again


class Lockstep:
    """The environment calls of a tensor-parallel rollout group: the head rank makes them and broadcasts each
    look's outcomes, so every peer admits the same turns at the same engine step and each call runs once. With
    a group of one (or a RowSource without `broadcast`) a pass-through."""

    def __init__(self, envs: EnvCalls, client: RowSource):
        self.envs = envs
        self.broadcast = getattr(client, "broadcast", None)
        self.is_head = getattr(client, "is_head", True)

    def reset(self, row: int, env_row: dict[str, Any], limit_s: float) -> None:
        if self.is_head:
            self.envs.reset(row, env_row, limit_s)

    def step(self, row: int, message: Any, limit_s: float, tool_calls_left: int) -> None:
        if self.is_head:
            self.envs.step(row, message, limit_s, tool_calls_left)

    def drop(self, row: int) -> None:
        if self.is_head:
            self.envs.drop(row)

    def ready(self, wait_s: float) -> list[tuple[int, Outcome]]:
        got = self.envs.ready(wait_s) if self.is_head else []
        return got if self.broadcast is None else self.broadcast(got)


class LocalRows(RowSource):
    """A DockAPI-shaped source of rows in this process, for trajectories outside a training step (held-out
    evaluation): `get` hands out the rows in order (groups of one), `put` keeps what the rollout writes."""

    def __init__(self, prompts: list[list[int]], env_rows: list[dict[str, Any]]):
        self.prompts, self.env_rows = prompts, env_rows
        self.served = 0
        self.out: dict[int, dict[str, Any]] = {}

    def pull(self, request: Pull) -> tuple[list[int], dict[str, list]] | None:
        """The next rows in order (the request's count, at least one)."""
        if self.served == len(self.prompts):
            return None
        rows = list(range(self.served, min(len(self.prompts), self.served + max(1, request.count))))
        self.served = rows[-1] + 1
        return rows, {PROMPT_IDS: [self.prompts[r] for r in rows], ENV_ROW: [self.env_rows[r] for r in rows]}

    def put(self, producer: Stage, rows: list[int], batch: dict[str, list]) -> None:
        for i, row in enumerate(rows):
            self.out[row] = {column: values[i] for column, values in batch.items()}


def run_trajectories(
    engine: RolloutBackend,
    prompts: list[list[int]],
    env_rows: list[dict[str, Any]],
    **settings: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One trajectory per prompt outside the dock (serve_multi_turn's settings but the client, consumer and
    group size); returns each prompt's columns (response_ids, loss_mask, env_reward, ...) and the stats."""
    rows = LocalRows(prompts, env_rows)
    stats = serve_multi_turn(engine, rows, consumer=Stage.ROLLOUT, group_size=1, **settings)
    return [rows.out[i] for i in range(len(prompts))], stats


def final_turn(ids: Any, mask: Any) -> list[int]:
    """The tokens of a trajectory's last policy turn: the last run of loss_mask 1 (what reward functions read
    as the final answer)."""
    ids, mask = list(map(int, ids)), [float(m) for m in mask]
    end = len(mask)
    while end > 0 and mask[end - 1] == 0:
        end -= 1
    start = end
    while start > 0 and mask[start - 1] > 0:
        start -= 1
    return ids[start:end]


def turn_runs(ids: Any, mask: Any) -> list[tuple[bool, list[int]]]:
    """A trajectory's tokens as its runs, in order: (True, a policy turn's sampled tokens) or (False, the
    observation tokens between turns), split where loss_mask changes."""
    runs: list[tuple[bool, list[int]]] = []
    for token, m in zip(map(int, ids), (float(m) > 0 for m in mask)):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def _without_stop(ids: list[int], stop_token_ids: list[int]) -> list[int]:
    """The sampled tokens without a final stop token (the message the environment reads)."""
    return ids[:-1] if ids and ids[-1] in stop_token_ids else ids


def _pull(
    client: RowSource, consumer: Stage, count: int, group_size: int, busy: bool
) -> tuple[str, tuple[list[int], dict[str, list]] | None]:
    """("rows", got), ("done", None) once every row was served, or ("later", None) when a busy loop's poll
    found nothing ready yet."""
    try:
        got = client.get(
            consumer,
            [PROMPT_IDS, ENV_ROW],
            count,
            whole_groups=True,
            min_count=group_size,
            timeout_s=0.0 if busy else None,
        )
    except DockTimeoutError:
        if busy:
            return "later", None
        raise
    return ("done", None) if got is None else ("rows", got)
