"""Pure-torch RL algorithm pieces (no Ray, no processes):

    registry.py        estimators by name with their traits, the presets of algo.name, LossPlan, the loss
                       settings' closed choices (no torch: config/ imports it)
    estimators.py      the reward stage's group estimators, one decorated function each; overlong shaping
    advantages.py      token-level: whitening over the step, KL-shaped returns, GAE
    losses.py          the clipped policy loss (from a LossPlan), KL estimators, aggregation, the value loss
    ppo.py             token rewards, the KL controller, the critic's diagnostics
    distill.py         on-policy distillation's per-token term
    logprobs.py, head_logprobs.py   log-probs and entropies (fused with the LM head)

The package imports nothing heavy: it registers the built-in estimators (estimators.py, no torch), and its other
names load their module (and torch) on first access, so that `dockrl.algos.registry` stays light for config/.
"""

import importlib

import dockrl.algos.estimators  # noqa: F401  registers the built-in estimators before any lookup

_EXPORTS = {
    "DEFAULT_ESTIMATOR": "dockrl.algos.registry",
    "KL_CONTROLLERS": "dockrl.algos.registry",
    "KL_ESTIMATORS": "dockrl.algos.registry",
    "AGG_MODES": "dockrl.algos.losses",
    "LossPlan": "dockrl.algos.registry",
    "estimator": "dockrl.algos.registry",
    "estimator_named": "dockrl.algos.registry",
    "compute_advantages": "dockrl.algos.estimators",
    "group_mean_advantages": "dockrl.algos.estimators",
    "group_normalized_advantages": "dockrl.algos.estimators",
    "needs_batch_whitening": "dockrl.algos.estimators",
    "overlong_penalty": "dockrl.algos.estimators",
    "rloo_advantages": "dockrl.algos.estimators",
    "gae_advantages": "dockrl.algos.advantages",
    "kl_shaped_returns": "dockrl.algos.advantages",
    "masked_moments": "dockrl.algos.advantages",
    "whiten": "dockrl.algos.advantages",
    "token_entropy": "dockrl.algos.logprobs",
    "token_logprobs": "dockrl.algos.logprobs",
    "PolicyLossOutput": "dockrl.algos.losses",
    "aggregate": "dockrl.algos.losses",
    "kl_penalty": "dockrl.algos.losses",
    "masked_mean": "dockrl.algos.losses",
    "policy_loss": "dockrl.algos.losses",
    "value_clip_frac": "dockrl.algos.losses",
    "value_loss": "dockrl.algos.losses",
    "KLController": "dockrl.algos.ppo",
    "explained_variance": "dockrl.algos.ppo",
    "explained_variance_moments": "dockrl.algos.ppo",
    "pad_rows": "dockrl.algos.ppo",
    "token_level_rewards": "dockrl.algos.ppo",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dockrl.algos' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
