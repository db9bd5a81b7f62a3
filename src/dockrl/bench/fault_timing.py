"""`dockrl bench faults`: seconds from a worker's death (or hang) to the run's named error, per kind and stage.

For each case, runs `dockrl train` in a child process (its own local Ray) on a tiny PPO job with a reward
model, so every worker kind exists, under DOCKRL_FAULTS (workers/fault_injection.py): the target process is SIGKILLed
(or SIGSTOPped) when the driver starts the stage at step 1. The child's stderr is read as it arrives;
`to_error_s` is the time from the fault firing to the driver's one-line error, `to_exit_s` to the child's
exit (Ray shut down, every process of the run gone). A hang is detected after run.heartbeat_timeout_s.
"""

from __future__ import annotations

import argparse

CASES = (  # (action, target, stage)
    ("kill", "actor-0", "generate"),
    ("kill", "actor-0", "compute_ref"),
    ("kill", "actor-0", "update"),
    ("kill", "critic-0", "compute_values"),
    ("kill", "critic-0", "update"),
    ("kill", "reward-0", "generate"),
    ("kill", "reward_model-0", "generate"),
    ("kill", "dockrl-warehouse-0", "compute_ref"),
    ("kill", "dockrl-controller", "update"),
    ("hang", "actor-0", "compute_ref"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Which cases and the heartbeat timeout."""
    parser.add_argument("--heartbeat-timeout-s", type=float, default=30.0, help="run.heartbeat_timeout_s")
    parser.add_argument("--only", default=None, help="comma list of targets to run (default: every case)")


def _config(root, model: str, reward_model: str, data: str, heartbeat_s: float) -> str:
    path = root / "ppo.yaml"
    path.write_text(
        "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
        "actor: {dp: 1, micro_batch_size: 8}\n"
        "algo: {name: ppo, kl_coef: 0.01, kl_in_reward: true}\n"
        f"reward: {{num_processes: 0, model: {{path: {reward_model}, weight: 0.5}}}}\n"
        "dock: {num_warehouses: 1}\n"
        f"model: {{path: {model}}}\n"
        f"data: {{train_path: {data}}}\n"
        f"run: {{steps: 2, prompts_per_step: 4, progress: false, heartbeat_timeout_s: {heartbeat_s},"
        f" output_dir: {root}}}\n"
    )
    return str(path)


def _run_case(config: str, action: str, target: str, stage: str, name: str) -> dict:
    import os
    import re
    import subprocess
    import sys
    import time

    env = {**os.environ, "DOCKRL_FAULTS": f"{action}:{target}:{stage}:1:during"}
    start = time.time()
    child = subprocess.Popen(
        [sys.executable, "-m", "dockrl.cli", "train", config, f"run.name={name}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    fired = error_at = None
    error = ""
    assert child.stderr is not None  # stderr=PIPE
    for line in child.stderr:
        match = re.search(r"DOCKRL_FAULTS: firing .*\(wall clock ([0-9.]+)\)", line)
        if match:
            fired = float(match.group(1))
        if line.startswith("dockrl train: error: "):
            error_at, error = time.time(), line.strip()
    child.wait()
    exit_at = time.time()
    named = f"{target} (" in error and "at step 1" in error
    return {
        "case": f"{action} {target} @ {stage}",
        "to_error_s": round(error_at - fired, 2) if fired and error_at else None,
        "to_exit_s": round(exit_at - fired, 2) if fired else None,
        "run_s": round(exit_at - start, 1),
        "named": named,
        "error": error.removeprefix("dockrl train: error: ")[:160],
    }


def run(args: argparse.Namespace) -> list[dict]:
    """Build a tiny model, reward model and data, then run every case."""
    import tempfile
    from pathlib import Path

    from dockrl.data.synthetic import write_task
    from dockrl.models.tiny import make_tiny

    only = set(args.only.split(",")) if args.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny(root / "model", family="qwen2", hidden_size=64, num_layers=2, seed=0)
        reward_model = make_tiny(
            root / "rm", family="qwen2", hidden_size=64, num_layers=2, seed=1, reward_model=True
        )
        data = write_task("arithmetic", root / "data", num_train=64, num_test=8, seed=0)["train"]
        config = _config(root, str(model), str(reward_model), str(data), args.heartbeat_timeout_s)
        for i, (action, target, stage) in enumerate(CASES):
            if only is None or target in only:
                rows.append(_run_case(config, action, target, stage, f"case{i}"))
    return rows
