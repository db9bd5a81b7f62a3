"""What the benchmarks that run whole `dockrl train` jobs share: a workspace with the tests' tiny model and
the arithmetic task, the command line of one run, and its metrics averaged over the steps after the first."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def tiny_workspace(root: Path) -> tuple[Path, dict[str, Path]]:
    """The tests' tiny Qwen2 model and the arithmetic task under `root`: (model dir, {"train", "test"})."""
    from dockrl.data.synthetic import write_task
    from dockrl.models.tiny import make_tiny

    model = make_tiny(root / "model", family="qwen2", hidden_size=64, num_layers=2, seed=0)
    return model, write_task("arithmetic", root / "data", num_train=256, num_test=32, seed=0)


def train_argv(
    config: Path, model: Any, data: dict[str, Path], root: Path, name: str, *overrides: str
) -> list[str]:
    """`python -m dockrl.cli train` of run `name` under root/runs, with `overrides` last."""
    return [
        *(sys.executable, "-m", "dockrl.cli", "train", str(config)),
        f"model.path={model}",
        f"data.train_path={data['train']}",
        f"run.output_dir={root / 'runs'}",
        f"run.name={name}",
        *overrides,
    ]


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    """(metrics.jsonl rows, summary.json) of a finished run."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((run_dir / "summary.json").read_text())


def mean_after_first(metrics: list[dict], key: str) -> float:
    """The mean of `key` over the steps after the first (which pays start-up), 0 where a step lacks it."""
    timed = metrics[1:] or metrics
    return statistics.fmean(m.get(key, 0.0) for m in timed)
