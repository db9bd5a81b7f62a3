"""The experience table's columns, declared once: name, dtype, per-row or per-token, producer and readers.

Every producer and consumer (recipes, workers, benchmarks) names columns through these constants, and the
dock's clients reject a put or get of a column declared nowhere here, naming it and the declared ones: a typo
is an error at the call, never a 600-second wait for a column nobody writes.

Stages (who writes and reads): driver (prompts), rollout (the actor's generation), reward_model, reward (the
RewardWorker), reference / old (the actor's log-prob stages), critic_values / critic_update (PPO's critic),
update (the actor's optimizer steps). `reward/<component>` is a family: each reward function's components.
Per-token columns hold one value per response token (ragged, unpadded); `prompt_ids` one per prompt token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dockrl.dock.errors import DockError


@dataclass(frozen=True)
class ColumnSpec:
    """One declared column (see the module docstring)."""

    name: str
    dtype: str
    per: str  # "row", "token" (one per response token) or "prompt token"
    producer: str
    readers: tuple[str, ...]
    doc: str


_SCHEMA: dict[str, ColumnSpec] = {}


def _declare(name: str, dtype: str, per: str, producer: str, readers: tuple[str, ...], doc: str) -> str:
    _SCHEMA[name] = ColumnSpec(name, dtype, per, producer, readers, doc)
    return name


PROMPT_IDS = _declare(
    "prompt_ids",
    "int64",
    "prompt token",
    "driver",
    ("rollout", "reward", "reward_model", "reference", "old", "critic_values", "critic_update", "update"),
    "the prompt, rendered with the chat template and tokenized",
)
LABEL = _declare(
    "label", "object", "row", "driver", ("reward",), "the ground truth handed to reward functions"
)
RESPONSE_IDS = _declare(
    "response_ids",
    "int64",
    "token",
    "rollout",
    ("reward", "reward_model", "reference", "old", "critic_values", "critic_update", "update"),
    "the sampled response tokens",
)
ROLLOUT_LOGPROBS = _declare(
    "rollout_logprobs",
    "float32",
    "token",
    "rollout",
    ("update",),
    "log-probs of the sampled tokens under the rollout model (the rollout/trainer mismatch, algo.rollout_is)",
)
POLICY_VERSION = _declare(
    "policy_version",
    "int64",
    "token",
    "rollout",
    ("reward",),
    "the trainer updates before the weights that sampled each token (0: the initial weights); the row's "
    "staleness at update t is t - 1 - its oldest version, at most rollout.max_staleness",
)
PARTIAL_IDS = _declare(
    "partial_ids",
    "int64",
    "token",
    "rollout",
    ("rollout",),
    "rollout.partial: the tokens of a response interrupted at the pass's token budget, continued next step",
)
PARTIAL_LOGPROBS = _declare(
    "partial_logprobs", "float32", "token", "rollout", ("rollout",), "rollout.partial: their log-probs"
)
PARTIAL_VERSIONS = _declare(
    "partial_versions",
    "int64",
    "token",
    "rollout",
    ("rollout",),
    "rollout.partial: their policy versions (one pass per version, so their count of distinct values is the "
    "row's passes so far)",
)
RM_SCORE = _declare("rm_score", "float32", "row", "reward_model", ("reward",), "the reward model's raw score")
REWARD = _declare(
    "reward",
    "float32",
    "row",
    "reward",
    ("critic_update",),
    "the total reward: weighted rule rewards (+ reward model)",
)
REF_LOGPROBS = _declare(
    "ref_logprobs",
    "float32",
    "token",
    "reference",
    ("update", "critic_update"),
    "the reference model's log-probs",
)
OLD_LOGPROBS = _declare(
    "old_logprobs",
    "float32",
    "token",
    "old",
    ("update", "critic_update"),
    "the policy's log-probs before the update (off-policy updates, PPO's KL in the reward)",
)
UPDATE_WEIGHT = _declare(
    "update_weight",
    "float32",
    "row",
    "reward",
    ("update", "critic_update"),
    "1, or 0 for the rows of a group the update leaves out (a reward call of the group failed, "
    "reward.on_error=drop_group): their tokens are masked out of the loss and its normalisers",
)
VALUES = _declare("values", "float32", "token", "critic_values", ("critic_update",), "the critic's values")
ADVANTAGES = _declare(
    "advantages",
    "float32",
    "token",
    "reward (group estimators) or critic_update (GAE)",
    ("update",),
    "per-token advantages",
)
RETURNS = _declare(
    "returns", "float32", "token", "critic_update", (), "GAE returns (the critic's regression target)"
)

REWARD_COMPONENT_PREFIX = "reward/"  # the family `reward/<component>`: float32 per row, written by reward

# Length metadata the controller keeps per row (for length-balanced allocation), derived from these columns.
PROMPT_LEN, RESPONSE_LEN = "prompt_len", "response_len"
LENGTH_OF = {PROMPT_IDS: PROMPT_LEN, RESPONSE_IDS: RESPONSE_LEN}


def reward_component(component: str) -> str:
    """The column of one reward component, e.g. reward_component("exact_answer/correct")."""
    return REWARD_COMPONENT_PREFIX + component


def declared(name: str) -> bool:
    """Whether `name` is a declared column (or of the `reward/<component>` family)."""
    return name in _SCHEMA or (
        name.startswith(REWARD_COMPONENT_PREFIX) and len(name) > len(REWARD_COMPONENT_PREFIX)
    )


def check_columns(names: Iterable[str], operation: str) -> None:
    """Raise DockError naming any undeclared column of a put or get (and the declared ones)."""
    unknown = [name for name in names if not declared(name)]
    if unknown:
        raise DockError(
            f"dock {operation} of undeclared column(s) {unknown}; the declared columns are "
            f"{sorted(_SCHEMA)} and {REWARD_COMPONENT_PREFIX}<component> (dockrl/dock/columns.py)"
        )


def schema() -> list[ColumnSpec]:
    """Every declared column, in declaration order."""
    return list(_SCHEMA.values())


def render_table() -> str:
    """The schema as a Markdown table (README, The experience table)."""
    rows = ["| column | dtype | one value per | written by | read by | what |", "|---|---|---|---|---|---|"]
    for spec in schema():
        readers = ", ".join(spec.readers) or "(diagnostics)"
        rows.append(
            f"| `{spec.name}` | {spec.dtype} | {spec.per} | {spec.producer} | {readers} | {spec.doc} |"
        )
    rows.append(
        f"| `{REWARD_COMPONENT_PREFIX}<component>` | float32 | row | reward | (metrics) | each reward function's "
        "components, e.g. `reward/exact_answer/correct`, `reward/rm`, `reward/overlong` |"
    )
    return "\n".join(rows)
