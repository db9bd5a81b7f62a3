"""Which step schedule a run uses, decided once from the config (the run loop picks its step function here).

    sync      rollout, scoring, log-probs and update of one step run back to back (rollout.max_staleness=0)
    async     steps t+1..t+lead generate in docks of their own while step t trains (rollout.max_staleness=k,
              rollout.placement=separate): recipes/async_step.py
    partial   one dock; each step's rollout cuts responses at a token budget and the next step continues them
              (rollout.partial); the rollout does not run ahead, so lead is 0: recipes/sync_step.py

Dynamic sampling (algo.dynamic_sampling, synchronous schedule only) repeats a step's rollout for up to
`dynamic_sampling_rounds` rounds; 0 means one plain round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dockrl.config.schema import TrainConfig

ScheduleKind = Literal["sync", "async", "partial"]


@dataclass(frozen=True)
class Schedule:
    """The step schedule of a run (see the module docstring)."""

    kind: ScheduleKind
    lead: int  # steps the rollout runs ahead of the update (async only; 0 otherwise)
    dynamic_sampling_rounds: int  # most rollout rounds per step with DAPO's dynamic sampling; 0: off

    @property
    def off_policy_rows(self) -> bool:
        """Rows may be sampled by older weights than the update's (async, partial): staleness is logged."""
        return self.kind != "sync"

    @property
    def partial(self) -> bool:
        """Responses are cut at a token budget and carried to the next step (rollout.partial)."""
        return self.kind == "partial"


def schedule_of(cfg: TrainConfig) -> Schedule:
    """The schedule of a validated `cfg` (validation rejects dynamic sampling with max_staleness > 0, and
    partial rollout without it)."""
    roll = cfg.rollout
    kind: ScheduleKind = "partial" if roll.partial else "async" if roll.max_staleness else "sync"
    return Schedule(
        kind=kind,
        lead=roll.max_staleness if kind == "async" else 0,
        dynamic_sampling_rounds=cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 0,
    )
