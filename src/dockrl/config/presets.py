"""Algorithm presets: the one table of what each algorithm name means, and the closed choices its rows use.

An algorithm name (`algo.name`) is a preset of orthogonal settings. Each `algo.*` setting left unset (None)
takes the value of the algorithm's row; `config/step_plan.py` resolves them once into the step plan, and no
code outside config/ reads the name. A new algorithm is one row here, plus its estimator or loss in algos/ if
that is new too.

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

opd is on-policy distillation (docs/distillation.md): the `none` estimator gives every row a zero sequence
advantage, and the teacher's per-token term (distill.coef x (teacher - sampling log-prob)) is the whole signal;
without a reference model (the teacher anchors the policy), as Agarwal et al. 2024 and Lu et al. 2025 train.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

# Advantage estimators (algos/estimators.py computes them). The group estimators need only the rewards of whole
# groups (what a RewardWorker holds); gae needs a critic's values per token.
# `none` (opd's): no sequence advantage at all, only the teacher's per-token term (distill.coef).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "none")
ADV_ESTIMATORS = (*GROUP_ESTIMATORS, "gae")
# Estimators whose advantages are whitened over every valid token of the step (by the trainer: it needs all rows).
WHITENED_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
# Estimators whose returns take a per-token KL penalty in the reward (algo.kl_in_reward): PPO's GAE (in the
# critic) and REINFORCE++'s returns-to-go (in the actor, before the step's whitening).
KL_REWARD_ESTIMATORS = ("gae", "reinforce_pp", "reinforce_pp_baseline")

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
RatioLevel = Literal["token", "sequence"]
LossNormalizer = Literal["tokens", "max_new_tokens"]


@dataclass(frozen=True)
class Preset:
    """One algorithm: what each of its settings left unset means (see the module docstring's table)."""

    estimator: str  # the advantage estimator (ADV_ESTIMATORS); gae runs PPO's critic
    clip_low: float  # the importance ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float
    loss_agg: str  # LossAgg
    kl_coef: float  # of the KL to the reference; 0 loads no reference model
    ratio_level: str = "token"  # RatioLevel: sequence is GSPO's one ratio per sequence
    loss_normalizer: str = "tokens"  # LossNormalizer: max_new_tokens is Dr. GRPO's constant


# The closed choices of algo.name and algo.adv_estimator (schema.py declares the settings with them).
# Algorithm spells out PRESETS' rows, in table order, so mypy checks the names a config can hold; the check
# after the table keeps the two equal.
Algorithm = Literal[
    "grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "gspo", "ppo", "opd"
]
AdvEstimator = Literal[ADV_ESTIMATORS]  # type: ignore[valid-type]


def _ppo_clip(estimator: str) -> Preset:
    """A row with PPO's clip, token-mean aggregation and KL to the reference."""
    return Preset(estimator, clip_low=0.2, clip_high=0.2, loss_agg="token-mean", kl_coef=0.001)


PRESETS: dict[Algorithm, Preset] = {
    "grpo": _ppo_clip("grpo"),
    "dapo": Preset("grpo", 0.2, 0.28, "token-mean", 0.0),  # clip-higher, no reference model (Yu et al. 2025)
    "rloo": _ppo_clip("rloo"),
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
LOSS_AGGS: tuple[str, ...] = typing.get_args(LossAgg)
RATIO_LEVELS: tuple[str, ...] = typing.get_args(RatioLevel)
LOSS_NORMALIZERS: tuple[str, ...] = typing.get_args(LossNormalizer)
# The estimator each algorithm uses unless algo.adv_estimator overrides it.
DEFAULT_ESTIMATOR: dict[str, str] = {name: preset.estimator for name, preset in PRESETS.items()}
