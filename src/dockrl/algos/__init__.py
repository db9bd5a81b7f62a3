"""Pure-torch RL algorithm pieces: log-probs, advantages, policy and value losses, PPO's KL controller
(no Ray, no processes)."""

from dockrl.algos.advantages import group_normalized_advantages
from dockrl.algos.estimators import (
    ADV_ESTIMATORS,
    DEFAULT_ESTIMATOR,
    GROUP_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    group_mean_advantages,
    masked_moments,
    needs_batch_whitening,
    overlong_penalty,
    rloo_advantages,
    whiten,
)
from dockrl.algos.logprobs import token_entropy, token_logprobs
from dockrl.algos.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    PolicyLossOutput,
    aggregate,
    kl_penalty,
    masked_mean,
    policy_loss,
    value_clip_frac,
    value_loss,
)
from dockrl.algos.ppo import (
    KL_CONTROLLERS,
    KLController,
    explained_variance,
    explained_variance_moments,
    pad_rows,
    token_level_rewards,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "DEFAULT_ESTIMATOR",
    "GROUP_ESTIMATORS",
    "compute_advantages",
    "gae_advantages",
    "group_mean_advantages",
    "masked_moments",
    "needs_batch_whitening",
    "overlong_penalty",
    "rloo_advantages",
    "value_clip_frac",
    "value_loss",
    "whiten",
    "KL_CONTROLLERS",
    "KLController",
    "explained_variance",
    "explained_variance_moments",
    "pad_rows",
    "token_level_rewards",
    "KL_ESTIMATORS",
    "PolicyLossOutput",
    "aggregate",
    "group_normalized_advantages",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
]
