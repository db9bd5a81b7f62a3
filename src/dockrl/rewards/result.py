"""What a reward function returns: `RewardResult`, and the `RewardFn` signature (base.py resolves names to
functions, builtin.py holds the built-in ones; both import this module, which imports neither)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardResult:
    """Score of one sample plus optional named sub-scores (logged as ``<fn name>/<component>``).

    Attributes:
        score: the value the reward function contributes (before its weight).
        components: diagnostics such as ``{"correct": 1.0, "format": 0.0}``; not summed into the score.
    """

    score: float
    components: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[str, str, Any], RewardResult | float]
