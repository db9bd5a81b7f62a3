"""`dockrl bench async`: synchronous vs asynchronous GRPO on the same workload, what each side waits for.

    sync   rollout.placement=colocated, max_staleness=0: the actor's ranks generate, then train
    sep    rollout.placement=separate,  max_staleness=0: replicas generate while the trainer waits, and back
    async  rollout.placement=separate,  max_staleness=1: step t+1 generates while step t trains
    async2 rollout.placement=separate,  max_staleness=2: steps t+1 and t+2 generate while step t trains
    partial rollout.placement=separate, partial=true, max_staleness=1: a quarter of the tokens per step, cut
           responses continued next step (a step trains only the groups that finished)

Each runs `dockrl train` (the tests' tiny Qwen2 model unless --model, the arithmetic task, long-tailed response
lengths: a random policy stops at a random token, up to --max-new-tokens) for --steps steps in its own local
Ray. Reported per mode over the steps after the first: step time, and the idle fractions
  trainer idle = 1 - (reference + old log-probs + update) / step
  rollout idle = 1 - generating / step   (generating: the replicas' own busy time; colocated: the rollout stage)
and the last step's reward. On a machine with fewer cores than processes the overlap is bounded by the cores:
rollout and training then share them, so the async row shows the schedule, not the speed-up disaggregated
GPUs give (there the step time tends to max(rollout, train) instead of their sum).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from dockrl.observe import metric_names as names

MODES = {
    "sync": ["rollout.placement=colocated", "rollout.max_staleness=0"],
    "sep": ["rollout.placement=separate", "rollout.max_staleness=0"],
    "async": ["rollout.placement=separate", "rollout.max_staleness=1"],
    "async2": ["rollout.placement=separate", "rollout.max_staleness=2"],
    "partial": ["rollout.placement=separate", "rollout.partial=true", "rollout.max_staleness=1"],
}

BASE_CONFIG = (
    "rollout: {samples_per_prompt: 4, groups_per_pull: 2, max_batch_size: 16}\n"
    "actor: {dp: 1, lr: 1.0e-3, micro_batch_size: 8}\n"
    "algo: {kl_coef: 0.0}\n"
    "reward: {functions: [{name: exact_answer}]}\n"
    "run: {prompts_per_step: 8, progress: false, worker_timeout_s: 600, log_samples: 0}\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench async`."""
    parser.add_argument(
        "--modes", default="sync,sep,async,async2,partial", help=f"comma list of {', '.join(MODES)}"
    )
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is not timed)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="response length limit")
    parser.add_argument("--model", default=None, help="a model directory instead of the tests' tiny model")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on each run")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per mode."""
    from dockrl.bench.train_runs import tiny_workspace, train_argv

    rows = []
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-async-") as tmp:
        root = Path(tmp)
        config = root / "grpo.yaml"
        config.write_text(BASE_CONFIG)
        model, data = tiny_workspace(root)
        model = args.model or model
        for mode in args.modes.split(","):
            steps = (f"run.steps={args.steps}", f"rollout.max_new_tokens={args.max_new_tokens}")
            argv = train_argv(config, model, data, root, mode, *steps, *MODES[mode])
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s)
            if done.returncode != 0:
                raise RuntimeError(
                    f"dockrl train ({mode}) failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
                )
            rows.append(_row(root / "runs" / mode, mode))
    return rows


def _row(run_dir: Path, mode: str) -> dict[str, Any]:
    from dockrl.bench.train_runs import mean_after_first, read_run

    metrics, _ = read_run(run_dir)

    def mean(key: str) -> float:
        return mean_after_first(metrics, key)

    step = mean(names.TIMING_STEP)
    train = mean(names.TIMING_REFERENCE) + mean(names.TIMING_OLD_LOGPROBS) + mean(names.TIMING_UPDATE)
    busy = names.TIMING_ROLLOUT_BUSY
    generating = mean(busy) if busy in metrics[-1] else mean(names.TIMING_ROLLOUT)
    return {
        "mode": mode,
        "steps": len(metrics),
        "step_s": step,
        "rollout_busy_s": generating,
        "train_busy_s": train,
        "rollout_idle": max(0.0, 1 - generating / step),
        "trainer_idle": max(0.0, 1 - train / step),
        "staleness_max": max(m.get(names.STALENESS_MAX, 0.0) for m in metrics),
        "rows_trained_mean": mean(names.DOCK_ROWS),
        "response_length_mean": mean(names.RESPONSE_LENGTH_MEAN),
        # None: partial rollout finished no group that step
        "reward_mean": metrics[-1].get(names.REWARD_MEAN),
    }
