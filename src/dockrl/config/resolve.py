"""Resolution: a checked config, plus what the preflight found, becomes the frozen `Resolved` that the recipe and
every worker read.

    check_train(cfg)           pure cross-field rules (config/validate.py): raise or warn, change nothing
    preflight (recipes/)       files, devices, loggers: checks them, finds run.device, run.precision, the
                               directories a checkpoint root stands for
    resolve(cfg, found)        a resolved copy of cfg and its step plan, frozen; the user's cfg is untouched
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from dockrl.config.schema import TrainConfig
from dockrl.config.step_plan import StepPlan, resolved_kl_coef, step_plan

T = TypeVar("T")


@dataclass(frozen=True)
class Resolved:
    """A run's resolved config and its step plan, fixed before any process starts.

    `cfg` is the run's own copy of the user's TrainConfig with what depends on something else filled in:
    algo.kl_coef (the algorithm's own when unset), run.device and run.precision (never auto), model.path,
    model.ref_path and critic.path (a checkpoint root replaced by the directories it holds). It is what the run
    writes to its config.yaml. Nothing writes to `cfg` or `plan` after this point: a changed setting is a new
    Resolved (`with_found`)."""

    cfg: TrainConfig
    plan: StepPlan

    def with_found(self, found: Mapping[str, Any]) -> Resolved:
        """This run resolved again with more settings found (dotted key -> value), e.g. the KL reference of
        the checkpoint a run resumes: {"model.ref_path": ...}."""
        return resolve(self.cfg, found)


def copy_with(cfg: T, found: Mapping[str, Any] | None = None) -> T:
    """A deep copy of config `cfg` with each dotted setting of `found` set (`run.device` -> "cpu")."""
    out = copy.deepcopy(cfg)
    for key, value in (found or {}).items():
        *sections, name = key.split(".")
        target: Any = out
        for section in sections:
            target = getattr(target, section)
        if name not in {f.name for f in dataclasses.fields(target)}:
            raise KeyError(f"{key} is not a setting of {type(cfg).__name__}")
        setattr(target, name, value)
    return out


def resolve(cfg: TrainConfig, found: Mapping[str, Any] | None = None) -> Resolved:
    """The resolved config of a checked `cfg` (config.validate.check_train) and what the preflight `found`
    (dotted key -> value); pure: reads nothing but its arguments."""
    out = copy_with(cfg, found)
    out.algo.kl_coef = resolved_kl_coef(out.algo)  # the algorithm's own when unset; config.yaml shows it
    return Resolved(out, step_plan(out))
