"""The experience table's columns, declared once: name, dtype, per-row or per-token, producer and readers.

Every producer and consumer (recipes, workers, benchmarks) names columns through these constants and itself
as a `Stage` (stages.py). Every dock client checks each put and get against this schema before any request:
a column declared nowhere, a get by a stage that is not among the column's readers, or a put by a stage that
is not its producer raises a DockError naming the column, the stage and the declared ones. A typo or a
wrong stage is an error at the call, never a 600-second wait for a column nobody writes.

`reward/<component>` is a family: each reward function's components. Per-token columns hold one value per
response token (ragged, unpadded); `prompt_ids` one per prompt token. The checkpoint stage (a save of the rows
in flight, recipes/inflight.py) reads every column, and a resume writes them back: it is a reader of every
column, and may put any column.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dockrl.dock.errors import DockError
from dockrl.dock.stages import Stage, as_stage


@dataclass(frozen=True)
class ColumnSpec:
    """One declared column (see the module docstring). `producers`: the stages that put it (one, but for
    `advantages`); `readers`: the stages that get it (the checkpoint among them)."""

    name: str
    dtype: str
    per: str  # "row", "token" (one per response token) or "prompt token"
    producers: tuple[Stage, ...]
    readers: tuple[Stage, ...]
    doc: str


_SCHEMA: dict[str, ColumnSpec] = {}


def _declare(
    name: str, dtype: str, per: str, producers: tuple[Stage, ...], readers: tuple[Stage, ...], doc: str
) -> str:
    _SCHEMA[name] = ColumnSpec(name, dtype, per, producers, (*readers, Stage.CHECKPOINT), doc)
    return name


PROMPT_IDS = _declare(
    "prompt_ids",
    "int64",
    "prompt token",
    (Stage.DRIVER, Stage.ROLLOUT),
    (
        Stage.ROLLOUT,
        Stage.REWARD,
        Stage.REWARD_MODEL,
        Stage.TEACHER,
        Stage.REFERENCE,
        Stage.OLD_LOGPROBS,
        Stage.CRITIC_VALUES,
        Stage.CRITIC_UPDATE,
        Stage.UPDATE,
    ),
    "the prompt, rendered with the chat template and tokenized; an agent run's rollout (env.name an agent "
    "function) puts it again with the agent's first request, which the row's response continues",
)
LABEL = _declare(
    "label", "object", "row", (Stage.DRIVER,), (Stage.REWARD,), "the ground truth handed to reward functions"
)
# A vision-language model's images, put by the driver with prompt_ids (every row of such a run: a text row has
# zero images), read where the model runs a forward over the prompt. Never gathered: each worker pulls its rows.
_IMAGE_READERS = (
    Stage.ROLLOUT,
    Stage.REWARD_MODEL,
    Stage.TEACHER,
    Stage.REFERENCE,
    Stage.OLD_LOGPROBS,
    Stage.CRITIC_VALUES,
    Stage.CRITIC_UPDATE,
    Stage.UPDATE,
)
IMAGE_PATCHES = _declare(
    "image_patches",
    "uint8",
    "image patch",
    (Stage.DRIVER,),
    _IMAGE_READERS,
    "vision-language models: [N, 3 x temporal_patch x patch x patch], the row's image patches in prompt order, "
    "before rescale and normalize (exact, 4x smaller than fp32; models/vision_processing.py); N is the sum of "
    "t x h x w over image_grid_thw, and prompt_ids holds N / merge_size^2 <|image_pad|> tokens",
)
IMAGE_GRID_THW = _declare(
    "image_grid_thw",
    "int64",
    "image",
    (Stage.DRIVER,),
    _IMAGE_READERS,
    "vision-language models: [n_images, 3], each image's (frames, patch rows, patch columns); [0, 3] for a row "
    "without images",
)
IMAGE_REFS = _declare(
    "image_refs",
    "object",
    "row",
    (Stage.DRIVER,),
    (Stage.REWARD,),
    "vision-language models: the row's images as references, never pixels: {ref, width, height} with ref the "
    "file's absolute path, or base64: or bytes: and a sha256 prefix; the reward workers copy them into "
    "samples.jsonl",
)
RESPONSE_IDS = _declare(
    "response_ids",
    "int64",
    "token",
    (Stage.ROLLOUT,),
    (
        Stage.REWARD,
        Stage.REWARD_MODEL,
        Stage.TEACHER,
        Stage.REFERENCE,
        Stage.OLD_LOGPROBS,
        Stage.CRITIC_VALUES,
        Stage.CRITIC_UPDATE,
        Stage.UPDATE,
    ),
    "the sampled response tokens",
)
ROLLOUT_LOGPROBS = _declare(
    "rollout_logprobs",
    "float32",
    "token",
    (Stage.ROLLOUT,),
    (Stage.TEACHER, Stage.REWARD, Stage.UPDATE),
    "log-probs of the sampled tokens under the rollout model (the rollout/trainer mismatch, algo.rollout_is; "
    "the student's side of distillation's per-token reverse KL)",
)
POLICY_VERSION = _declare(
    "policy_version",
    "int64",
    "token",
    (Stage.ROLLOUT,),
    (Stage.REWARD,),
    "the trainer updates before the weights that sampled each token (0: the initial weights); the row's "
    "staleness at update t is t - 1 - its oldest version, at most rollout.max_staleness",
)
PARTIAL_IDS = _declare(
    "partial_ids",
    "int64",
    "token",
    (Stage.ROLLOUT,),
    (Stage.ROLLOUT,),
    "rollout.partial: the tokens of a response interrupted at the pass's token budget, continued next step",
)
PARTIAL_LOGPROBS = _declare(
    "partial_logprobs",
    "float32",
    "token",
    (Stage.ROLLOUT,),
    (Stage.ROLLOUT,),
    "rollout.partial: their log-probs",
)
PARTIAL_VERSIONS = _declare(
    "partial_versions",
    "int64",
    "token",
    (Stage.ROLLOUT,),
    (Stage.ROLLOUT,),
    "rollout.partial: their policy versions (one pass per version, so their count of distinct values is the "
    "row's passes so far)",
)
ROUTED_EXPERTS = _declare(
    "routed_experts",
    "int16",
    "sequence token",
    (Stage.ROLLOUT,),
    (Stage.REFERENCE, Stage.OLD_LOGPROBS, Stage.UPDATE),
    "MoE models: [P + R - 1, L, k], the experts each of the L MoE layers routed every token the rollout fed "
    "(prompt, then the response but its last token) to; algo.routing_replay=r3 replays them in the trainer's "
    "passes, and without it they measure moe/routing_agreement",
)
LOSS_MASK = _declare(
    "loss_mask",
    "float32",
    "token",
    (Stage.ROLLOUT,),
    (Stage.TEACHER, Stage.REWARD, Stage.UPDATE),
    "multi-turn (env.name): 1 on the tokens the policy sampled, 0 on observation tokens (tool answers, the chat "
    "template's turn markers), which every loss, KL, entropy and normaliser leaves out",
)
ENV_ROW = _declare(
    "env_row",
    "object",
    "row",
    (Stage.DRIVER,),
    (Stage.ROLLOUT,),
    "multi-turn: the dataset row ({prompt, label}) each trajectory's environment is reset with",
)
ENV_REWARD = _declare(
    "env_reward",
    "float32",
    "row",
    (Stage.ROLLOUT,),
    (Stage.REWARD,),
    "multi-turn: the environment's final reward (NaN: it gave none; reward functions score the final answer)",
)
ENV_FAILED = _declare(
    "env_failed",
    "float32",
    "row",
    (Stage.ROLLOUT,),
    (Stage.REWARD,),
    "multi-turn: 1 when the environment raised on this trajectory (its group follows reward.on_error)",
)
RM_SCORE = _declare(
    "rm_score", "float32", "row", (Stage.REWARD_MODEL,), (Stage.REWARD,), "the reward model's raw score"
)
TEACHER_LOGPROBS = _declare(
    "teacher_logprobs",
    "float32",
    "token",
    (Stage.TEACHER,),
    (Stage.REWARD,),
    "distillation (distill.teacher_path): the teacher's log-prob of each sampled token, at the rollout's "
    "temperature; the reward stage adds distill.coef x (teacher_logprobs - rollout_logprobs) to the advantages",
)
TEACHER_TOPK_IDS = _declare(
    "teacher_topk_ids",
    "int32",
    "token",
    (Stage.TEACHER,),
    (Stage.UPDATE,),
    "top-k distillation (distill.top_k = k > 0): the teacher's k most likely token ids at each response "
    "position, [R, k], most likely first, at the rollout's temperature (4k bytes per token)",
)
TEACHER_TOPK_LOGPROBS = _declare(
    "teacher_topk_logprobs",
    "float32",
    "token",
    (Stage.TEACHER,),
    (Stage.UPDATE,),
    "top-k distillation: the teacher's log-probs of teacher_topk_ids, [R, k] (4k bytes per token); the update "
    "adds distill.coef x the forward KL over those ids and the tail's mass to the loss (algos/distill.py)",
)
REWARD = _declare(
    "reward",
    "float32",
    "row",
    (Stage.REWARD,),
    (Stage.CRITIC_UPDATE,),
    "the total reward: weighted rule rewards (+ reward model)",
)
REF_LOGPROBS = _declare(
    "ref_logprobs",
    "float32",
    "token",
    (Stage.REFERENCE,),
    (Stage.UPDATE, Stage.CRITIC_UPDATE),
    "the reference model's log-probs",
)
OLD_LOGPROBS = _declare(
    "old_logprobs",
    "float32",
    "token",
    (Stage.OLD_LOGPROBS,),
    (Stage.UPDATE, Stage.CRITIC_UPDATE),
    "the policy's log-probs before the update (off-policy updates, PPO's KL in the reward)",
)
UPDATE_WEIGHT = _declare(
    "update_weight",
    "float32",
    "row",
    (Stage.REWARD,),
    (Stage.UPDATE, Stage.CRITIC_UPDATE),
    "1, or 0 for the rows of a group the update leaves out (a reward call of the group failed, "
    "reward.on_error=drop_group): their tokens are masked out of the loss and its normalisers",
)
VALUES = _declare(
    "values", "float32", "token", (Stage.CRITIC_VALUES,), (Stage.CRITIC_UPDATE,), "the critic's values"
)
ADVANTAGES = _declare(
    "advantages",
    "float32",
    "token",
    (Stage.REWARD, Stage.CRITIC_UPDATE),
    (Stage.UPDATE,),
    "per-token advantages: the reward stage's (group estimators, plus distillation's per-token term) or "
    "critic_update's (GAE)",
)
RETURNS = _declare(
    "returns", "float32", "token", (Stage.CRITIC_UPDATE,), (), "GAE returns (the critic's regression target)"
)

REWARD_COMPONENT_PREFIX = "reward/"  # the family `reward/<component>`: float32 per row
_COMPONENT = ColumnSpec(
    REWARD_COMPONENT_PREFIX + "<component>",
    "float32",
    "row",
    (Stage.REWARD,),
    (Stage.CHECKPOINT,),  # metrics come from the reward workers' results, not from the dock
    "each reward function's components, e.g. `reward/exact_answer/correct`, `reward/rm`, `reward/overlong`",
)

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


def spec_of(name: str) -> ColumnSpec:
    """The declaration of a declared column (`reward/<component>` columns share one)."""
    return _SCHEMA.get(name) or _COMPONENT


def check_get(consumer: Stage | str, columns: Iterable[str]) -> Stage:
    """Before a get: every column declared and `consumer` a dock stage among each column's readers; returns
    the consumer as a Stage. Raises DockError naming the column, the stage and the declared readers."""
    columns = list(columns)
    check_columns(columns, "get")
    stage = as_stage(consumer, "dock get: consumer")
    for name in columns:
        readers = spec_of(name).readers
        if stage not in readers:
            raise DockError(
                f"dock get of column {name!r} by stage '{stage}': its declared readers are "
                f"{[str(r) for r in readers]} (dockrl/dock/columns.py)"
            )
    return stage


def check_put(producer: Stage | str, columns: Iterable[str], operation: str = "put") -> Stage:
    """Before a put (or add_groups): every column declared and `producer` a dock stage declared as its
    producer (or the checkpoint, which writes back what it saved); returns the producer as a Stage. Raises
    DockError naming the column, the stage and the declared producers."""
    columns = list(columns)
    check_columns(columns, operation)
    stage = as_stage(producer, f"dock {operation}: producer")
    for name in columns:
        producers = spec_of(name).producers
        if stage not in producers and stage is not Stage.CHECKPOINT:
            raise DockError(
                f"dock {operation} of column {name!r} by stage '{stage}': it is written by "
                f"{[str(p) for p in producers]} (dockrl/dock/columns.py)"
            )
    return stage


def schema() -> list[ColumnSpec]:
    """Every declared column, in declaration order."""
    return list(_SCHEMA.values())


def render_table() -> str:
    """The schema as a Markdown table (docs/columns.md)."""
    rows = ["| column | dtype | one value per | written by | read by | what |", "|---|---|---|---|---|---|"]
    for spec in [*schema(), _COMPONENT]:
        written = " or ".join(spec.producers)
        readers = ", ".join(spec.readers)
        rows.append(f"| `{spec.name}` | {spec.dtype} | {spec.per} | {written} | {readers} | {spec.doc} |")
    return "\n".join(rows)
