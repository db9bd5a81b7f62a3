"""The stages of an RL step, each named once: the dock consumer, the column producer, the timer label and the
supervisor's stage are one `Stage`.

```
 driver ──prompt_ids, label──▶ dock ◀──▶ rollout ◀──▶ reward_model, teacher ◀──▶ reward (generation side)
                               dock ◀──▶ reference, old_logprobs, critic_values, critic_update, update
                               dock ◀──▶ checkpoint (reads every column of the rows in flight at a save,
                                                     writes them back on resume; recipes/inflight.py)
 not at the dock: setup, step, weight_sync, start_next, eval, save   (timer labels, supervisor stages)
```

`Stage` is a StrEnum: a member equals its value, so `timing/<value>` metric names, the consumer names in
the dock's stats and fault-injection targets read as plain strings. Which stage writes and reads which column
is declared in columns.py; every dock client checks a put's producer and a get's consumer against it.
"""

from __future__ import annotations

from enum import StrEnum

from dockrl.dock.errors import DockError


class Stage(StrEnum):
    """One stage of the step (see the module docstring); its value is its metric and consumer name."""

    # At the dock: producers and consumers of columns (columns.py says which).
    DRIVER = "driver"  # adds the step's prompts (prompt_ids, label)
    ROLLOUT = "rollout"  # generation: the colocated actor or the separate rollout replicas
    REWARD_MODEL = "reward_model"  # the reward model's score head
    TEACHER = "teacher"  # on-policy distillation: the teacher's log-probs (TeacherWorker)
    REWARD = "reward"  # rule rewards, the total reward, group advantages (RewardWorker)
    REFERENCE = "reference"  # the reference model's log-probs (ActorWorker.compute_ref)
    OLD_LOGPROBS = "old_logprobs"  # the policy's log-probs before the update (ActorWorker.compute_old)
    CRITIC_VALUES = "critic_values"  # PPO's critic: values
    CRITIC_UPDATE = "critic_update"  # PPO's critic: GAE advantages and returns, value updates
    UPDATE = "update"  # the actor's optimizer steps
    CHECKPOINT = "checkpoint"  # a save reads rows in flight, a resume writes them back (every column)
    # Not at the dock: the driver's own stages (timer labels and the supervisor's stage).
    SETUP = "setup"  # workers build their models (supervisor)
    STEP = "step"  # one whole RL step (timer, supervisor)
    WEIGHT_SYNC = "weight_sync"  # weights to the separate rollout replicas (timer)
    START_NEXT = "start_next"  # an asynchronous run starts a later step's generation (timer)
    EVAL = "eval"  # held-out accuracy (supervisor)
    SAVE = "save"  # a checkpoint (supervisor, fault injection)


DOCK_STAGES = frozenset(
    {
        Stage.DRIVER,
        Stage.ROLLOUT,
        Stage.REWARD_MODEL,
        Stage.TEACHER,
        Stage.REWARD,
        Stage.REFERENCE,
        Stage.OLD_LOGPROBS,
        Stage.CRITIC_VALUES,
        Stage.CRITIC_UPDATE,
        Stage.UPDATE,
        Stage.CHECKPOINT,
    }
)
"""The stages that put to or get from the dock (the others only time or name what the driver does)."""


def as_stage(name: str, role: str) -> Stage:
    """`name` as a dock Stage, or a DockError naming it, the `role` it was given as, and the dock stages."""
    try:
        stage = Stage(name)
    except ValueError:
        stage = None
    if stage not in DOCK_STAGES:
        raise DockError(
            f"{role} '{name}' is not a dock stage; the dock stages are "
            f"{sorted(s.value for s in DOCK_STAGES)} (dockrl/dock/stages.py)"
        )
    return stage
