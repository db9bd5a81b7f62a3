"""`dockrl bench startup`: where a tiny run's wall time goes outside its steps, phase by phase.

```
 process start -> cli -> config -> data -> ray -> dock -> started/<group>... -> setup -> loggers -> steps -> close -> exit
```

Each run is `dockrl train` of the tests' tiny model on the arithmetic task (2 steps, actor.dp=2, colocated, one
reward worker by default) in a child process, as a user types it. The run marks each phase's end on one clock
from its process start (observe/startup.py, summary.json "startup"); `exit` is the command's wall time after
the last mark. `outside` = wall time minus the sum of `timing/step` (the issue's measure), `cpu` the machine's
CPU seconds over the run (every process: the driver, Ray's daemons, the workers), from /proc/stat. The first
run warms the file caches and is not counted (--runs counts the measured ones); figures are the median over
the measured runs, with the minimum beside them. Module-level imports stay light.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG = """\
rollout:
  samples_per_prompt: 4
  max_new_tokens: 8
actor:
  lr: 1.0e-3
  micro_batch_size: 4
algo:
  name: grpo
  kl_coef: 0.001
reward:
  functions:
    - name: exact_answer
run:
  steps: 2
  prompts_per_step: 4
  device: cpu
  progress: false
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench startup`."""
    parser.add_argument("--runs", type=int, default=3, help="measured runs (after one warm-up run)")
    parser.add_argument("--dp", type=int, default=2, help="actor.dp of the run")
    parser.add_argument("--steps", type=int, default=2, help="run.steps")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on each run")
    parser.add_argument(
        "overrides", nargs="*", help="more dotted overrides of the run, e.g. reward.num_processes=0"
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per phase (median and minimum seconds over the measured runs), then the totals."""
    from dockrl.bench.train_runs import read_run, tiny_workspace, train_argv

    with tempfile.TemporaryDirectory(prefix="dockrl-startup-") as tmp:
        root = Path(tmp)
        model, data = tiny_workspace(root)
        config = root / "startup.yaml"
        config.write_text(CONFIG)
        measured = []
        for index in range(args.runs + 1):
            name = f"run{index}"
            overrides = [f"actor.dp={args.dp}", f"run.steps={args.steps}", *args.overrides]
            argv = train_argv(config, model, data, root, name, *overrides)
            cpu_before, start = _machine_cpu_s(), time.monotonic()
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s)
            wall, cpu = time.monotonic() - start, _machine_cpu_s() - cpu_before
            if done.returncode != 0:
                raise RuntimeError(f"dockrl train failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            metrics, summary = read_run(root / "runs" / name)
            if index > 0:  # the first run only warms the caches
                measured.append(_phases(summary["startup"], wall, cpu, metrics))
    return _rows(measured)


def _phases(marks: dict[str, float], wall: float, cpu: float, metrics: list[dict]) -> dict[str, float]:
    """Each phase's own seconds (its mark minus the previous one), exit, and the run's totals."""
    out, previous = {}, 0.0
    for phase, at in marks.items():
        out[phase] = at - previous
        previous = at
    out["exit"] = wall - previous
    steps = sum(m.get("timing/step", 0.0) for m in metrics)
    out.update({"total: wall": wall, "total: steps": steps, "total: outside steps": wall - steps})
    out["total: cpu (all processes)"] = cpu
    out["first step: rollout"] = metrics[0].get("timing/rollout", 0.0)
    out["first step: reward"] = metrics[0].get("timing/reward", 0.0)
    return out


def _rows(runs: list[dict[str, float]]) -> list[dict[str, Any]]:
    phases = list(dict.fromkeys(p for run in runs for p in run))
    return [
        {
            "phase": phase,
            "median_s": round(statistics.median(r.get(phase, 0.0) for r in runs), 3),
            "min_s": round(min(r.get(phase, 0.0) for r in runs), 3),
        }
        for phase in phases
    ]


def _machine_cpu_s() -> float:
    """User + nice + system seconds of every CPU since boot (Linux; 0 elsewhere)."""
    import os

    try:
        with open("/proc/stat") as f:
            user, nice, system = (int(x) for x in f.readline().split()[1:4])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")
