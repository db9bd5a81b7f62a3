"""run.loggers: W&B offline and MLflow's local SQLite store get every step's metrics and samples; a resumed run
continues the same W&B and MLflow runs; config errors name the logger and the fix."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import yaml

from dockrl.observe.loggers import logger_problem
from dockrl.observe.run_dir import RunDir

CONFIG = {
    "algo": {"name": "grpo", "kl_coef": 0.0},
    "run": {"steps": 4, "loggers": ["jsonl", "wandb", "mlflow"]},
}
SAMPLE = {"prompt": "1+1=", "response": "2", "label": "2", "reward": 1.0}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline with its settings and caches under tmp_path; MLflow's default store (no tracking URI)."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def _steps(run: RunDir, steps: range, first_step: int, names: list[str]) -> None:
    with run.loggers(names, CONFIG, first_step):
        for step in steps:
            run.log_metrics(step, {"reward/mean": step / 10 + first_step, "kl/mean": float("nan")})
            run.log_samples(step, [{**SAMPLE, "reward": float(step)}])


def test_wandb_offline_and_mlflow_store_hold_every_step_and_resume_continues_them(offline, tmp_path):
    from mlflow.tracking import MlflowClient

    run = RunDir(tmp_path / "runs", "r")
    names = ["jsonl", "wandb", "mlflow"]
    _steps(run, range(1, 4), 1, names)
    ids = json.loads((run.path / "loggers.json").read_text())
    run.keep_history(2)  # resumed from step 2: step 3 runs again, then step 4
    _steps(run, range(3, 5), 3, names)
    assert json.loads((run.path / "loggers.json").read_text()) == ids  # the same W&B and MLflow runs

    # W&B: one offline run directory per attempt, both of run id ids["wandb"]; history rows by step, the NaN
    # metric left out, the samples a wandb.Table; the config as the run's config.
    attempts = sorted((run.path / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(attempts) == 2
    histories = [_wandb_history(attempt / f"run-{ids['wandb']}.wandb") for attempt in attempts]
    assert [[row["_step"] for row in history] for history in histories] == [[1, 2, 3], [3, 4]]
    assert [row["reward/mean"] for row in histories[0]] == pytest.approx([1.1, 1.2, 1.3])
    assert [row["reward/mean"] for row in histories[1]] == pytest.approx([3.3, 3.4])
    assert all("kl/mean" not in row for history in histories for row in history)
    assert all(row["samples._type"] == "table-file" for history in histories for row in history)
    table = json.loads(next(attempts[0].glob("files/media/table/samples_1_*.table.json")).read_text())
    assert table == {"columns": ["prompt", "response", "label", "reward"], "data": [["1+1=", "2", "2", 1.0]]}

    # MLflow: one run in experiment dockrl of runs/mlflow.db, artifacts in runs/mlartifacts; a replayed step
    # keeps both values in the metric's history.
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    mlflow_run = client.get_run(ids["mlflow"])
    assert mlflow_run.info.run_name == "r" and mlflow_run.info.status == "FINISHED"
    assert client.get_experiment(mlflow_run.info.experiment_id).name == "dockrl"
    history = sorted(
        (m.step, m.timestamp, m.value) for m in client.get_metric_history(ids["mlflow"], "reward/mean")
    )
    assert [(step, value) for step, _, value in history] == [
        (1, pytest.approx(1.1)),
        (2, pytest.approx(1.2)),
        (3, pytest.approx(1.3)),
        (3, pytest.approx(3.3)),
        (4, pytest.approx(3.4)),
    ]
    assert "kl/mean" not in mlflow_run.data.metrics
    assert mlflow_run.data.params["algo.name"] == "grpo" and mlflow_run.data.params["run.steps"] == "4"
    artifacts = Path(mlflow_run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(tmp_path / "runs" / "mlartifacts")
    assert json.loads((artifacts / "samples" / "step_000004.json").read_text()) == {
        "columns": ["prompt", "response", "label", "reward"],
        "data": [["1+1=", "2", "2", 4.0]],
    }
    assert yaml.safe_load((artifacts / "config.yaml").read_text()) == CONFIG
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[0]["kl/mean"] is None


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of a .wandb file: a LevelDB-style log (7-byte file header; 32 KiB blocks of records,
    each a 7-byte header of crc32, length and type FULL/FIRST/MIDDLE/LAST) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, payload, rows = 7, 32768, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # a key, or a path of keys into a nested value
                rows.append(
                    {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
                )
        elif kind == 0:  # zeroed tail of a preallocated block
            break
    return rows


@pytest.mark.parametrize(
    ("names", "env", "message"),
    [
        (["jsonl", "neptune"], {}, r"unknown logger\(s\) \['neptune'\]"),
        (["wandb"], {"WANDB_MODE": "online"}, r"no API key .* set WANDB_MODE=offline"),
    ],
)
def test_logger_problems_name_the_fix(names, env, message, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    problem, fix = logger_problem(names)
    assert re.search(message, f"{problem}; {fix}")
    assert logger_problem(["jsonl", "tensorboard"]) is None


def test_mlflow_file_store_through_its_tracking_uri(offline, monkeypatch, tmp_path):
    """MLflow's own file store (./mlruns layout) when the user points MLFLOW_TRACKING_URI at it: MLflow 3 keeps
    it behind MLFLOW_ALLOW_FILE_STORE; dockrl's logger takes whatever store the URI names."""
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "arithmetic")
    assert logger_problem(["mlflow"]) is None
    run = RunDir(tmp_path / "runs", "r")
    _steps(run, range(1, 3), 1, ["jsonl", "mlflow"])
    run_id = json.loads((run.path / "loggers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "arithmetic"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean"))
    assert history == [(1, pytest.approx(1.1)), (2, pytest.approx(1.2))]
    assert (tmp_path / "mlruns").is_dir() and not (tmp_path / "runs" / "mlflow.db").exists()
