"""Resuming a run exactly: which checkpoint, whether its config still matches, and the driver's state.

    plan_resume(cfg, run)        before Ray starts: run.resume -> a checkpoint root or None; a config whose
                                 computation differs from the checkpoint's is refused here, keys named;
                                 the later checkpoints of this run directory are abandoned (a new timeline)
    timeline_head(run, origin)   what a restart continues from: this timeline's newest checkpoint, or origin
    reference_path(cfg, point)   the KL reference the run loads (the config is never rewritten with it)
    trainer_state(...)           what the driver writes into trainer_state.json at each save
    restore(point, run, sampler) the driver's side of resuming: sampler position, RNG states, metrics and
                                 samples trimmed to the checkpoint's step; returns the first step to run

The workers restore their own side from the checkpoint's shards (ActorWorker.setup, CriticWorker.setup).
Everything a step computes derives from (seed, step, row) and the restored state, never from arrival order or
wall time, so the resumed run repeats the uninterrupted one bit for bit on the same machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dockrl.checkpoint import directory
from dockrl.checkpoint.state import (
    computation_config,
    config_changes,
    config_hash,
    rng_states,
    set_rng_states,
)
from dockrl.config.loader import to_dict
from dockrl.config.schema import TrainConfig
from dockrl.errors import ConfigError
from dockrl.observe.run_dir import RunDir
from dockrl.recipes.common import EpochSampler

log = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """A complete checkpoint to continue from, with its trainer_state.json."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        """The last step the checkpoint includes."""
        return int(self.state["step"])

    @property
    def kl_coef(self) -> float | None:
        """PPO's KL controller coefficient at the checkpoint (None without a critic)."""
        return self.state.get("kl_coef")


def plan_resume(cfg: TrainConfig, run: RunDir, data_fingerprint: str) -> ResumePoint | None:
    """The checkpoint `run.resume` asks for (None: start fresh). Raises ConfigError when its computation
    config or training data differ from this run's (unless run.resume_force), or when run.resume=never would
    start a new run in a directory that holds one."""
    directory.clean_staging(run.checkpoints)
    mode = cfg.run.resume
    if mode == "never":
        run.refuse_if_taken("run.name", resume_hint=True)
        return None
    if mode == "auto":
        path = directory.newest_checkpoint(run.checkpoints)
        if path is None:
            log.info("run.resume=auto: no complete checkpoint in %s; starting fresh", run.checkpoints)
            return None
    else:
        path = Path(mode)
    point = ResumePoint(path, directory.read_trainer_state(path))
    check_compatible(cfg, point, data_fingerprint)
    abandoned = directory.abandon_from(run.checkpoints, point.step, point.path)
    if abandoned:
        log.warning(
            "run.resume=%s starts a new timeline at step %d: the later checkpoints of %s are renamed, kept "
            "and never resumed from: %s",
            mode,
            point.step,
            run.checkpoints,
            ", ".join(p.name for p in abandoned),
        )
    return point


def check_compatible(cfg: TrainConfig, point: ResumePoint, data_fingerprint: str) -> None:
    """Refuse a checkpoint whose computation config or data differ from `cfg`'s (run.resume_force skips); a
    changed parallel layout (state.LAYOUT_KEYS) is reported in one line and accepted."""
    saved, current = point.state["config"], computation_config(to_dict(cfg))
    layout = config_changes(saved, current, layout=True)
    if layout:
        log.warning(
            "run.resume: the parallel layout changed (%s): the checkpoint's model and optimizer state are "
            "resharded on load, so the resumed run repeats the original to fp32 rounding, not bit for bit",
            "; ".join(layout),
        )
    changes = config_changes(saved, current)
    if point.state["data_fingerprint"] != data_fingerprint:
        changes.append(
            f"data.train_path: the encoded prompts differ from the checkpoint's ({cfg.data.train_path})"
        )
    if not changes:
        return
    if cfg.run.resume_force:
        log.warning("run.resume_force=true: resuming %s despite changes: %s", point.path, "; ".join(changes))
        return
    raise ConfigError(
        f"run.resume={cfg.run.resume!r}: checkpoint {point.path} was written with different settings, so the "
        f"resumed run would not repeat the original: {'; '.join(changes)}. Restore those settings, or set "
        "run.resume_force=true to resume anyway"
    )


def reference_path(cfg: TrainConfig, point: ResumePoint | None) -> str:
    """The KL reference this run loads: model.ref_path when set, else the reference of the run it resumes
    (which never moves silently, even when run.resume_force accepted a changed model.path), else model.path.

    Resolved the same way on every run and never written into the config: the config a checkpoint records
    stays the user's, so the next resume compares the user's settings with the user's settings (a resolved
    path written into model.ref_path made every second resume a "config change"); trainer_state.json records
    the resolved path as reference_path."""
    if cfg.model.ref_path is not None:
        return cfg.model.ref_path
    return cfg.model.path if point is None else point.state["reference_path"]


def trainer_state(
    cfg: TrainConfig,
    step: int,
    sampler: EpochSampler,
    data_fingerprint: str,
    kl_coef: float | None,
    reference: str,
    parent: str | None,
) -> dict[str, Any]:
    """The driver's state at the end of `step` (trainer_state.json); `reference`: the KL reference the run
    loads (`reference_path`); `parent`: the checkpoint this one descends from (None: the run's start)."""
    computation = computation_config(to_dict(cfg))
    return {
        "step": step,
        "sampler": {"epoch": sampler.epoch, "position": sampler.position, "seed": sampler.seed},
        "data_fingerprint": data_fingerprint,
        "rng": rng_states(),
        "kl_coef": kl_coef,
        # DAPO's dynamic sampling keeps no state across steps: the sampler position covers its extra prompts.
        "reference_path": reference,
        "parent": parent,
        "config": computation,
        "config_hash": config_hash(computation),
    }


def restore(point: ResumePoint | None, run: RunDir, sampler: EpochSampler, *, fresh: bool) -> int:
    """Put the driver where `point` left it, or at the start (then `fresh` clears the rows of metrics.jsonl
    and samples.jsonl, which run.resume=auto and restarts without a checkpoint want); returns the first step."""
    if point is None:
        if fresh:
            run.keep_history(0)
        return 1
    sampler.seek(point.state["sampler"]["epoch"], point.state["sampler"]["position"])
    set_rng_states(point.state["rng"])
    source = point.path.resolve().parent.parent
    run.keep_history(point.step, None if source == run.path.resolve() else source)
    return point.step + 1


def newest(run: RunDir) -> ResumePoint | None:
    """The newest complete checkpoint of this run directory, or None."""
    path = directory.newest_checkpoint(run.checkpoints)
    return None if path is None else ResumePoint(path, directory.read_trainer_state(path))


def timeline_head(run: RunDir, origin: ResumePoint | None) -> ResumePoint | None:
    """Where the current timeline, started at `origin` (None: at step 1), stands: the newest checkpoint of
    this run directory when it is newer than `origin` (plan_resume abandoned every later one, so a newer one
    was written by this timeline), else `origin` itself, even when it lies in another run's directory (a
    restart before this run's first save continues from it, not from the base model)."""
    here = newest(run)
    if origin is None or (here is not None and here.step > origin.step):
        return here
    return origin
