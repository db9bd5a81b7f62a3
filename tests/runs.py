"""Helpers for tests that run `dockrl train` end to end: configs, subprocess runs, metrics, run processes."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

# Metrics that measure wall time (or count restarts) differ between runs that compute the same numbers. So do
# the rollout-vs-trainer figures, to rounding (~1e-7): the rollout engine computes its log-probs in decode
# batches whose composition depends on arrival order (the sampled tokens and everything trained on do not).
_TIMED = ("timing/", "throughput/", "run/", "rollout/kl", "rollout/logprob_abs_diff")


def tiny_paths(tiny_model, arithmetic_data) -> list[str]:
    """The overrides that point a config at the session's tiny model and arithmetic task (conftest fixtures)."""
    return [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}"]


def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def computed_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-time (and batch-composition) figures: what an exact resume must reproduce
    bit for bit."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if not k.startswith(_TIMED) and not k.endswith("_p99_ms")}
        for row in rows
    ]


def metric_differences(actual: list[dict], expected: list[dict]) -> list[str]:
    """`step N key: actual != expected` for every computed figure that differs (for assertion messages)."""
    out = [f"{len(actual)} rows != {len(expected)} rows"] if len(actual) != len(expected) else []
    for a, e in zip(actual, expected):
        for key in sorted(set(a) | set(e)):
            if a.get(key) != e.get(key):
                out.append(f"step {e.get('step')} {key}: {a.get(key)!r} != {e.get(key)!r}")
    return out


def run_cli(
    args: list[str], *, env: dict | None = None, timeout: float = 120.0
) -> tuple[subprocess.CompletedProcess, str]:
    """`dockrl ARGS` in a child process with its own local Ray; returns (result, marker). The marker is in the
    environment of every process of that run (driver, Ray daemons, workers) so a test can find them."""
    marker = uuid.uuid4().hex
    child_env = {**os.environ, "DOCKRL_TEST_RUN": marker, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "dockrl.cli", *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result, marker


def processes_of(marker: str, prefix: str = "ray::") -> list[str]:
    """`pid cmdline` of live processes whose environment carries `marker` and whose title starts with `prefix`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if f"DOCKRL_TEST_RUN={marker}".encode() in environ and cmdline.startswith(prefix) and state != "Z":
            found.append(f"{entry.name} {cmdline}")
    return found


def wait_gone(marker: str, within_s: float, prefix: str = "ray::") -> list[str]:
    """Poll until no process of the run is left or `within_s` passed; returns the survivors."""
    deadline = time.monotonic() + within_s
    while True:
        left = processes_of(marker, prefix)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
