"""Pure-torch RL algorithm pieces: log-probs, advantages, policy losses (no Ray, no processes)."""

from dockrl.algos.advantages import group_normalized_advantages
from dockrl.algos.logprobs import token_entropy, token_logprobs
from dockrl.algos.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    PolicyLossOutput,
    aggregate,
    kl_penalty,
    masked_mean,
    policy_loss,
)

__all__ = [
    "AGG_MODES",
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
