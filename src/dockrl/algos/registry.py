"""The algorithm's vocabulary, declared once: advantage estimators by name with their traits, the preset table of
`algo.name`, the policy loss plan and the closed choices of the loss settings.

    @estimator(name, traits)   registers an advantage estimator (algos/estimators.py holds the built-in ones);
                               config accepts every registered name and checks its traits, never its name
    PRESETS                    what each algo.name means: one row of settings (the table below)
    LossPlan                   how the policy loss is formed (config/step_plan.py resolves it from algo.*)
    LossAgg, KLEstimator, ...  the closed choices of the loss settings

This module imports no torch and no Ray, nor does algos/estimators.py, which registers the built-in estimators
when the package dockrl.algos is imported (before this module is): config/ imports the registry, and the driver
checks a config before any worker starts (tests/distributed/test_light_imports.py keeps it so).

An algorithm name is a preset of orthogonal settings. Each `algo.*` setting left unset (None) takes the value
of the algorithm's row; `config/step_plan.py` resolves them once into the step plan, and no code outside
config/ reads the name. A new algorithm is one row here, plus its estimator (algos/estimators.py) or loss
(algos/losses.py) if that is new too.

    name                   estimator               clip low/high  loss_agg             kl_coef  ratio     normaliser
    grpo                   grpo                    0.2 / 0.2      token-mean           0.001    token     tokens
    dapo                   grpo                    0.2 / 0.28     token-mean           0        token     tokens
    rloo                   rloo                    0.2 / 0.2      token-mean           0.001    token     tokens
    reinforce_pp           reinforce_pp            0.2 / 0.2      token-mean           0.001    token     tokens
    reinforce_pp_baseline  reinforce_pp_baseline   0.2 / 0.2      token-mean           0.001    token     tokens
    dr_grpo                dr_grpo                 0.2 / 0.2      seq-mean-token-sum   0        token     max_new_tokens
    gspo                   grpo                    3e-4 / 4e-4    seq-mean-token-mean  0        sequence  tokens
    ppo                    gae (a critic)          0.2 / 0.2      token-mean           0.001    token     tokens
    opd                    none                    0.2 / 0.2      token-mean           0        token     tokens

dapo and rloo compare the samples of a group and need at least two (`min_group_size`). opd is on-policy
distillation (docs/distillation.md): the `none` estimator gives every row a zero sequence advantage, and the
teacher's per-token term (distill.coef x (teacher - sampling log-prob)) is the whole signal; without a reference
model (the teacher anchors the policy), as Agarwal et al. 2024 and Lu et al. 2025 train.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# (rewards [N] tensor, group_size S, settings) -> advantages [N] fp32 tensor; rows [g*S, (g+1)*S) form group g.
# The tensors are typed Any: this module imports no torch (the config reads it before any worker starts).
EstimatorFn = Callable[[Any, int, "AdvantageSettings"], Any]

# ---------------------------------------------------------------- the loss settings' closed choices

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
RatioLevel = Literal["token", "sequence"]
LossNormalizer = Literal["tokens", "max_new_tokens"]
KLEstimator = Literal["k1", "k2", "k3"]
KLControl = Literal["fixed", "adaptive"]
RolloutIS = Literal["none", "tis", "decoupled"]

LOSS_AGGS: tuple[str, ...] = typing.get_args(LossAgg)
RATIO_LEVELS: tuple[str, ...] = typing.get_args(RatioLevel)
LOSS_NORMALIZERS: tuple[str, ...] = typing.get_args(LossNormalizer)
KL_ESTIMATORS: tuple[str, ...] = typing.get_args(KLEstimator)
KL_CONTROLLERS: tuple[str, ...] = typing.get_args(KLControl)

# ---------------------------------------------------------------- advantage estimators


@dataclass(frozen=True)
class AdvantageSettings:
    """The settings an estimator function may read (algo.adv_eps, algo.norm_adv_by_std: the grpo estimator's)."""

    eps: float = 1e-6  # added to the group std
    normalize_std: bool = True  # divide group-centred rewards by the group std


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: its function and the traits config and the step plan read."""

    name: str
    fn: EstimatorFn
    needs_critic: bool  # from a critic's token values (PPO's GAE), not from the reward stage's groups
    whitened: bool  # the trainer whitens the advantages over every valid token of the step
    kl_in_reward: bool  # its returns can take the per-token KL penalty (algo.kl_in_reward)
    group_baseline: bool  # subtracts a statistic of the group's rewards: all zero in groups of one
    std_normalized: bool  # divides by the group std: algo.norm_adv_by_std and algo.adv_eps act on it
    needs_teacher: bool  # no sequence advantage: the teacher's per-token term (distill.*) is the whole signal


_ESTIMATORS: dict[str, Estimator] = {}


def estimator(
    name: str,
    *,
    needs_critic: bool = False,
    whitened: bool = False,
    kl_in_reward: bool = False,
    group_baseline: bool = False,
    std_normalized: bool = False,
    needs_teacher: bool = False,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Register the decorated function as advantage estimator `name` (algo.adv_estimator, a preset's
    estimator) with its traits (`Estimator`'s fields). The function maps per-row rewards [N] of whole groups
    to per-row advantages [N] fp32; a `needs_critic` estimator's function raises (the critic computes it).
    Registering a name twice is an error."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered already ({_ESTIMATORS[name].fn})")
        _ESTIMATORS[name] = Estimator(
            name,
            fn,
            needs_critic=needs_critic,
            whitened=whitened,
            kl_in_reward=kl_in_reward,
            group_baseline=group_baseline,
            std_normalized=std_normalized,
            needs_teacher=needs_teacher,
        )
        return fn

    return register


def unregister_estimator(name: str) -> None:
    """Remove estimator `name` (a test's own, registered for the test only)."""
    del _ESTIMATORS[name]


def estimators() -> dict[str, Estimator]:
    """Every registered estimator by name, the built-in ones first (a copy)."""
    return dict(_ESTIMATORS)


def estimator_names() -> tuple[str, ...]:
    """The names config accepts for algo.adv_estimator."""
    return tuple(estimators())


def estimator_named(name: str) -> Estimator:
    """The registered estimator `name`; a ValueError naming the registered ones otherwise."""
    known = estimators()
    if name not in known:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {tuple(known)}")
    return known[name]


# ---------------------------------------------------------------- the policy loss


@dataclass(frozen=True)
class LossPlan:
    """How the actor's policy loss is formed (algos.losses.policy_loss), resolved once from the config
    (config/step_plan.py loss_plan). A new loss knob is a setting (config/training_schema.py), a field here (and
    a preset column, where algorithms differ in it), its line in `loss_plan` and its use in algos/losses.py."""

    agg: LossAgg
    clip_low: float
    clip_high: float
    kl_coef: float  # of the KL term in the loss; 0 when the KL is in the reward (PPO's kl_in_reward)
    kl_estimator: KLEstimator
    entropy_coef: float
    sequence_ratio: bool  # algo.ratio_level=sequence (GSPO): one importance ratio per sequence
    seq_len_norm: float | None  # algo.loss_normalizer=max_new_tokens (Dr. GRPO): each row's token sum / this
    rollout_is: RolloutIS = (
        "none"  # importance weights old / rollout: tis truncates them, decoupled masks above the cap
    )
    rollout_is_cap: float = 2.0
    # distill.top_k > 0: the weight (distill.coef) of the top-k forward KL to the teacher in the loss; 0 without
    distill_coef: float = 0.0


# ---------------------------------------------------------------- the presets


@dataclass(frozen=True)
class Preset:
    """One algorithm: what each of its settings left unset means (see the module docstring's table)."""

    estimator: str  # the advantage estimator (a registered name); gae runs PPO's critic
    clip_low: float  # the importance ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float
    loss_agg: LossAgg
    kl_coef: float  # of the KL to the reference; 0 loads no reference model
    ratio_level: RatioLevel = "token"  # sequence is GSPO's one ratio per sequence
    loss_normalizer: LossNormalizer = "tokens"  # max_new_tokens is Dr. GRPO's constant
    min_group_size: int = 1  # the rollout.samples_per_prompt it needs (2: it compares a group's samples)


# The closed choice of algo.name (config/training_schema.py declares the setting with it). Algorithm spells out
# PRESETS' rows, in table order, so mypy checks the names a config can hold; the check after the table keeps
# the two equal.
Algorithm = Literal[
    "grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "gspo", "ppo", "opd"
]


def _ppo_clip(estimator: str, min_group_size: int = 1) -> Preset:
    """A row with PPO's clip, token-mean aggregation and KL to the reference."""
    return Preset(
        estimator,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        kl_coef=0.001,
        min_group_size=min_group_size,
    )


PRESETS: dict[Algorithm, Preset] = {
    "grpo": _ppo_clip("grpo"),
    # clip-higher, no reference model (Yu et al. 2025)
    "dapo": Preset("grpo", 0.2, 0.28, "token-mean", 0.0, min_group_size=2),
    "rloo": _ppo_clip("rloo", min_group_size=2),
    "reinforce_pp": _ppo_clip("reinforce_pp"),
    "reinforce_pp_baseline": _ppo_clip("reinforce_pp_baseline"),
    # a constant normaliser, no KL (Liu et al. 2025)
    "dr_grpo": Preset("dr_grpo", 0.2, 0.2, "seq-mean-token-sum", 0.0, loss_normalizer="max_new_tokens"),
    # sequence-level ratios (Zheng et al. 2025)
    "gspo": Preset("grpo", 3e-4, 4e-4, "seq-mean-token-mean", 0.0, ratio_level="sequence"),
    "ppo": _ppo_clip("gae"),
    # on-policy distillation: the teacher's per-token term only, no reference model
    "opd": Preset("none", 0.2, 0.2, "token-mean", 0.0),
}

ALGORITHMS: tuple[str, ...] = typing.get_args(Algorithm)
assert ALGORITHMS == tuple(PRESETS), "Algorithm must name PRESETS' rows, in table order"
# The estimator each algorithm uses unless algo.adv_estimator overrides it.
DEFAULT_ESTIMATOR: dict[str, str] = {name: preset.estimator for name, preset in PRESETS.items()}
