"""A run directory per run: config.yaml, metrics.jsonl, samples.jsonl, summary.json, checkpoints/.

run/
  config.yaml       the resolved config
  metrics.jsonl     one JSON object per step (flat `section/name` keys)
  samples.jsonl     a few prompt/response/reward triples per step
  summary.json      final figures
  checkpoints/      step_000010/ ... resumable checkpoints (dockrl.checkpoint.directory)
  loggers.json      the W&B and MLflow run ids a resumed run continues (run.loggers: wandb, mlflow)
  tensorboard/      event files (run.loggers: tensorboard): every metric as a scalar, the samples as text
  wandb/            W&B's local files (run.loggers: wandb; offline runs wait here for `wandb sync`)

A resumed run keeps writing the same metrics.jsonl and samples.jsonl: `keep_history(step)` first drops the
rows of steps after the checkpoint it resumes from, so no step appears twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from dockrl.observe.loggers import Logger, open_loggers


class RunDir:
    """Owns the files of one run. Created by the driver only."""

    def __init__(self, parent: str | Path, name: str | None = None):
        name = name or time.strftime("%Y%m%d-%H%M%S")
        self.path = Path(parent) / name
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.sinks: list[Logger] = []  # the loggers besides jsonl, inside `loggers(...)`

    def holds_run(self) -> bool:
        """Whether an earlier run wrote steps or checkpoints here (a new run would mix its records with them)."""
        metrics = self.path / "metrics.jsonl"
        has_steps = metrics.is_file() and metrics.stat().st_size > 0
        return has_steps or (self.checkpoints.is_dir() and any(self.checkpoints.iterdir()))

    def refuse_if_taken(self, setting: str, resume_hint: bool) -> None:
        """Raise ConfigError when this directory already holds a run: `setting` is the run-name key, and
        `resume_hint` adds run.resume=auto to the fixes."""
        from dockrl.errors import ConfigError

        if not self.holds_run():
            return
        fixes = f"choose another {setting}=..."
        if resume_hint:
            fixes += ", continue it with run.resume=auto,"
        raise ConfigError(
            f"{setting}={self.path.name!r}: {self.path} already holds a run (steps in metrics.jsonl or "
            f"checkpoints); a new run there would mix its records with that one's. {fixes[0].upper()}"
            f"{fixes[1:]} or delete the directory"
        )

    def write_config(self, cfg: dict[str, Any]) -> None:
        """Write the resolved config as YAML."""
        (self.path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    @contextmanager
    def loggers(self, names: list[str], config: dict[str, Any], first_step: int = 1):
        """Send metrics and samples to the loggers of run.loggers besides the JSON lines while in the block
        (dockrl.observe.loggers: a resumed run continues its W&B and MLflow runs and TensorBoard purges the
        events of replayed steps); each logger is closed at the end."""
        self.sinks = open_loggers(names, self.path, config, first_step)
        try:
            yield
        finally:
            sinks, self.sinks = self.sinks, []
            for sink in sinks:
                sink.close()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step's metrics (non-finite values are written as null so the file stays JSON, and left
        out for the other loggers)."""
        row = {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        finite = {k: v for k, v in row.items() if k != "step" and v is not None}
        for sink in self.sinks:
            sink.metrics(step, finite)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append prompt/response/reward triples of one step (and send them to the other loggers as tables)."""
        with open(self.path / "samples.jsonl", "a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")
        if samples:
            for sink in self.sinks:
                sink.samples(step, samples)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write (or update) summary.json."""
        path = self.path / "summary.json"
        current = json.loads(path.read_text()) if path.exists() else {}
        current.update(summary)
        path.write_text(json.dumps(current, indent=2) + "\n")

    def keep_history(self, last_step: int, source: Path | None = None) -> None:
        """Make metrics.jsonl and samples.jsonl hold exactly the rows of steps <= `last_step`, taken from
        this run directory or, when resuming another run's checkpoint, from run directory `source`."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            origin = (source or self.path) / name
            lines = origin.read_text().splitlines() if origin.is_file() else []
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= last_step]
            staging = self.path / f"{name}.tmp"
            staging.write_text("".join(line + "\n" for line in kept))
            os.replace(staging, self.path / name)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class StageTimer:
    """Wall-clock timings of named stages: `with timer("rollout"): ...` adds to seconds["rollout"] (logged as
    timing/rollout by recipes/step_metrics.py)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add a duration measured elsewhere (stages that overlap, or repeat within a step)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
