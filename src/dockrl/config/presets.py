"""The choices of algo.adv_estimator as the schema declares them. The algorithm table itself (the presets of
algo.name, the registered advantage estimators and their traits, the loss settings' closed choices) is
algos/registry.py, torch-free, which config/ imports; its names are re-exported here for older imports.
"""

from __future__ import annotations

from typing import Literal

from dockrl.algos.registry import (
    ALGORITHMS,
    DEFAULT_ESTIMATOR,
    LOSS_AGGS,
    LOSS_NORMALIZERS,
    PRESETS,
    RATIO_LEVELS,
    Preset,
    estimator_names,
)

# The estimators registered when config is first imported (the built-in ones): the declared type of
# algo.adv_estimator, for mypy and `dockrl config-docs`. The loader accepts every name registered by the time a
# config is loaded (the setting's `choices`), so an estimator registered later is a valid choice too.
ADV_ESTIMATORS: tuple[str, ...] = estimator_names()
AdvEstimator = Literal[ADV_ESTIMATORS]  # type: ignore[valid-type]

__all__ = [
    "ADV_ESTIMATORS",
    "ALGORITHMS",
    "DEFAULT_ESTIMATOR",
    "LOSS_AGGS",
    "LOSS_NORMALIZERS",
    "PRESETS",
    "RATIO_LEVELS",
    "AdvEstimator",
    "Preset",
]
