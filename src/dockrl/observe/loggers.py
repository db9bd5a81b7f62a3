"""Metric loggers besides the JSON lines: TensorBoard, Weights & Biases and MLflow (run.loggers).

The driver opens the chosen loggers around its step loop (`RunDir.loggers`) and hands every logger each step's
metrics and samples:

  step loop --metrics, samples--> RunDir --+--> metrics.jsonl, samples.jsonl   (always)
                                           +--> TensorBoardLogger   RUN_DIR/tensorboard/ event files
                                           +--> WandbLogger         a W&B run (RUN_DIR/wandb/ holds its local files)
                                           +--> MlflowLogger        an MLflow run in a tracking store

A resumed run continues the same W&B and MLflow runs: their ids are kept in RUN_DIR/loggers.json. TensorBoard
purges the events of replayed steps; W&B drops a step at or below the last one it holds and MLflow keeps both
values of a replayed step in the metric's history (the newest wins in its charts).

wandb and mlflow are imported only when chosen (`pip install 'dockrl[wandb]'` / `'dockrl[mlflow]'`); W&B runs
offline with WANDB_MODE=offline, MLflow writes to MLFLOW_TRACKING_URI or, unset, to a SQLite store beside the run
directories (RUN_PARENT/mlflow.db, artifacts in RUN_PARENT/mlartifacts; `mlflow ui --backend-store-uri
sqlite:///runs/mlflow.db`).
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

# name -> (modules it imports, install hint); jsonl needs nothing.
LOGGERS: dict[str, tuple[tuple[str, ...], str]] = {
    "jsonl": ((), ""),
    "tensorboard": (("tensorboard",), "pip install tensorboard"),
    "wandb": (("wandb",), "pip install 'dockrl[wandb]'"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "pip install 'dockrl[mlflow]'"),
}
SAMPLE_COLUMNS = ["prompt", "response", "label", "reward"]


class Logger(Protocol):
    """Where one step's metrics (finite floats by `section/name`) and samples go."""

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def samples(self, step: int, samples: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def logger_problem(names: list[str]) -> tuple[str, str] | None:
    """(problem, fix) when run.loggers names an unknown logger, one whose package is missing, or W&B online
    without credentials; None when every logger can start."""
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        return f"unknown logger(s) {unknown}", f"use any of {list(LOGGERS)}"
    for name in names:
        modules, hint = LOGGERS[name]
        if name == "mlflow" and os.environ.get("MLFLOW_TRACKING_URI"):
            modules = ("mlflow",)  # a server or a store of the user's: the SQLite default is not used
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            return f"{name} needs the package(s) {missing}, which are not installed", hint
    if "wandb" in names and not _wandb_can_log():
        return (
            "wandb logs online and finds no API key (WANDB_API_KEY or a `wandb login` entry in ~/.netrc)",
            "run `wandb login`, or set WANDB_MODE=offline (then `wandb sync RUN_DIR/wandb/offline-run-*`)",
        )
    return None


def _wandb_can_log() -> bool:
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get(
        "WANDB_API_KEY"
    ):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_loggers(names: list[str], run_path: Path, config: dict[str, Any], first_step: int) -> list[Logger]:
    """Start the loggers of `names` other than jsonl for the run in `run_path` (continuing its W&B and MLflow
    runs when RUN_DIR/loggers.json names them). On an error the ones already started are closed."""
    ids_file = run_path / "loggers.json"
    ids = json.loads(ids_file.read_text()) if ids_file.is_file() else {}
    opened: list[Logger] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardLogger(run_path / "tensorboard", first_step))
            elif name == "wandb":
                opened.append(WandbLogger(run_path, config, ids))
            elif name == "mlflow":
                opened.append(MlflowLogger(run_path, config, ids))
    except BaseException:
        for logger in opened:
            logger.close()
        raise
    ids_file.write_text(json.dumps(ids, indent=2) + "\n")
    return opened


class TensorBoardLogger:
    """Event files: every metric as a scalar, the samples as a Markdown text table. Events of steps from
    `first_step` on, left by an earlier attempt of a resumed run, are purged."""

    def __init__(self, path: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(path), purge_step=first_step)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self.writer.add_text("samples", markdown_table(samples), step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run named after the run directory (project: WANDB_PROJECT or "dockrl"), its local files in
    RUN_DIR/wandb/; the resolved config as the run's config and the samples as a wandb.Table per step."""

    def __init__(self, run_path: Path, config: dict[str, Any], ids: dict[str, str]):
        import wandb

        self.wandb = wandb
        ids.setdefault("wandb", secrets.token_hex(4))  # W&B run ids: lowercase letters and digits
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "dockrl"),
            name=run_path.name,
            id=ids["wandb"],
            resume="allow",
            dir=str(run_path),
            config=config,
        )

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        rows = [[s.get(c, "") for c in SAMPLE_COLUMNS] for s in samples]
        table = self.wandb.Table(columns=SAMPLE_COLUMNS, data=rows)  # type: ignore[arg-type]  # list[str | int]
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run named after the run directory in experiment MLFLOW_EXPERIMENT_NAME (or "dockrl"): the
    metrics by step, the resolved config as params (`section.name`) and as config.yaml, the samples as a table
    artifact per step (samples/step_NNNNNN.json, MLflow's {"columns", "data"} layout)."""

    def __init__(self, run_path: Path, config: dict[str, Any], ids: dict[str, str]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = run_path.parent.resolve()
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{store / 'mlflow.db'}")
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dockrl")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            location = None if uri else (store / "mlartifacts").as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        if "mlflow" in ids:
            self.run_id = ids["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(experiment_id, run_name=run_path.name).info.run_id
        ids["mlflow"] = self.run_id
        params = [
            Param(
                key, (value if isinstance(value, str) else json.dumps(value))[:6000]
            )  # MLflow's value limit
            for key, value in _flatten(config).items()
        ]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_dict(self.run_id, config, "config.yaml")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in values.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        table = {"columns": SAMPLE_COLUMNS, "data": [[s.get(c, "") for c in SAMPLE_COLUMNS] for s in samples]}
        self.client.log_dict(self.run_id, table, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def markdown_table(samples: list[dict[str, Any]]) -> str:
    """Samples as a Markdown table (TensorBoard's text plugin renders it); cells on one line, pipes escaped.
    Samples of a vision-language run get an images column: each image's path (or reference) and size."""
    columns = SAMPLE_COLUMNS + (["images"] if any(s.get("images") for s in samples) else [])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(_value(s, c)) for c in columns) + " |" for s in samples]
    return "\n".join(lines)


def image_text(image: dict[str, Any]) -> str:
    """One image of a sample (data/datasets.py RowImages.refs) as text: "path (WxH)"."""
    return f"{image.get('ref', '?')} ({image.get('width', '?')}x{image.get('height', '?')})"


def _value(sample: dict[str, Any], column: str) -> Any:
    if column == "images":
        return "; ".join(image_text(image) for image in sample.get("images") or [])
    return sample.get(column, "")


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
