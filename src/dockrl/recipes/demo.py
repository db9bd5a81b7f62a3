"""The demo: a tiny model learns arithmetic from a noisy teacher by SFT, then GRPO removes the
teacher's bad habit, through the full system.

    dockrl data arithmetic ─▶ dockrl make-tiny ─▶ dockrl sft ─▶ eval (before) ─▶ dockrl train (GRPO:
    Ray, 2 actor ranks in one gloo group, 2 warehouses) ─▶ eval (after) ─▶ summary.json with both

The task is single-digit addition and subtraction (`What is 7-9?`). The SFT answers come from a hedging
teacher (`hedging_teacher_rows`): 70% of the time it follows the right answer with a second guess
("-2 or -1"). The warm-started model learns the arithmetic and the habit; `exact_answer` reads the final
number, so greedy answers that hedge are wrong. GRPO with the exact-answer reward on the true answers
teaches the model to stop after its answer, which held-out accuracy shows.

Configs: `dockrl/configs/demo_sft.yaml` and `demo_grpo.yaml`; paths inside them are set from `out_dir`.

`--task vision` (docs/vision.md, "Demo"): the same story on images. The synthetic vision task's colour and bars
questions (data/synthetic_vision.py), a tiny Qwen2.5-VL whose vision tower trains, SFT on a teacher that
hedges 70% of the time ("red or blue"), then GRPO with `exact_answer` (which reads the last word); held-out
accuracy is of greedy answers to the test images (`demo_vision_sft.yaml`, `demo_vision_grpo.yaml`).
"""

from __future__ import annotations

import logging
import shutil
import time
from importlib import resources
from pathlib import Path
from typing import Any

from dockrl.config import SFTConfig, TrainConfig, load_config
from dockrl.data.synthetic import write_task
from dockrl.data.synthetic_vision import write_vision_task
from dockrl.models.tiny import make_tiny
from dockrl.observe.run_dir import RunDir
from dockrl.recipes.eval import evaluate_model_dir
from dockrl.recipes.grpo import train
from dockrl.recipes.preflight import preflight_sft, preflight_train
from dockrl.recipes.sft import sft
from dockrl.rewards.runner import RewardSpec

log = logging.getLogger(__name__)

# The task and model sizes of the demo: all 200 single-digit +/- problems, 40 of them held out.
TASK: dict[str, Any] = dict(num_train=160, num_test=40, max_operand=9, teacher_error=0.7, teacher_samples=4)
MODEL: dict[str, Any] = dict(
    family="qwen2", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512
)
# `--family qwen3_moe`: the same shape with every MLP a mixture of 8 experts of width 128, 2 per token.
MOE_MODEL: dict[str, Any] = dict(
    MODEL, family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128
)


# `--task tools`: three-digit multiplication, which the tiny model cannot do alone, with a calculator. First
# stage: SFT on conversations that all call the calculator, standing in for pretraining (the random model must
# learn to copy operands and results at all). Warm start: SFT on a teacher that calls the calculator 30% of
# the time and otherwise estimates (data.synthetic.tool_teacher_rows), so greedy answers estimate; GRPO with
# the exact answer and the built-in tool environment then favours the tool.
TOOL_TASK: dict[str, Any] = dict(
    num_train=400,
    num_test=40,
    min_operand=100,
    max_operand=999,
    ops="*",
    tool_rate=0.3,
    teacher_samples=1,
    num_sft=4800,
    num_tool_traces=25600,
)
# `--task agent`: the tool task and its SFT stages, with GRPO through an agent function that calls the
# calculator through the OpenAI tools API (configs/calculator_agent.py; docs/agents.md), held out the same way.
# `--task vision`: the synthetic vision task (data/synthetic_vision.py: count the dots, name the colour, the
# taller bar) on a tiny Qwen2.5-VL (its vision tower trained), SFT on a noisy teacher (VISION_TASK's
# teacher_error of its answers another answer of the same question), then GRPO with the exact answer.
VISION_TASK: dict[str, Any] = dict(
    num_train=1000,
    num_test=90,
    kinds=("colour", "bars"),
    teacher_error=0.7,
    teacher_samples=2,
    teacher_hedge=True,
)
VISION_MODEL: dict[str, Any] = dict(family="qwen2_5_vl", hidden_size=64, num_layers=2, vocab_size=512)
TASK_CONFIGS = {
    "arithmetic": ("demo_sft.yaml", "demo_grpo.yaml"),
    "tools": ("demo_tools_sft.yaml", "demo_tools_grpo.yaml"),
    "agent": ("demo_tools_sft.yaml", "demo_agent_grpo.yaml"),
    "vision": ("demo_vision_sft.yaml", "demo_vision_grpo.yaml"),
}
TOOLS_PRETRAIN_CONFIG = "demo_tools_pretrain.yaml"

# What run_demo writes under its out_dir.
DEMO_PARTS = ("data", "tiny-model", "sft-tools", "sft", "grpo", "summary.json")


def config_path(name: str) -> Path:
    """Path of a config shipped with dockrl (`dockrl/configs/<name>`)."""
    return Path(str(resources.files("dockrl") / "configs" / name))


def run_demo(
    out_dir: str | Path = "runs/demo",
    overrides: list[str] | None = None,
    seed: int = 0,
    task: str = "arithmetic",
    family: str = "qwen2",
) -> dict[str, Any]:
    """Run the whole demo; returns (and writes to out_dir/summary.json) accuracies and wall time. `seed` seeds
    the tiny model's initialisation, the SFT order and the GRPO run (sampling, data order); the task and its
    held-out split stay the same, so runs with different seeds score the same 40 problems. `task`:
    arithmetic (single-turn), vision (single-turn, an image each), tools (multi-turn with the calculator; accuracies are of whole trajectories) or
    agent (the same with an agent function calling the calculator over the OpenAI API).
    `family`: qwen2 (dense) or qwen3_moe (MOE_MODEL)."""
    if task not in TASK_CONFIGS:
        raise ValueError(f"--task {task!r}: use one of {sorted(TASK_CONFIGS)}")
    if family not in ("qwen2", "qwen3_moe"):
        raise ValueError(f"--family {family!r}: use qwen2 or qwen3_moe")
    if task == "vision" and family != "qwen2":
        raise ValueError(f"--family {family!r} with --task vision: the vision demo's model is a qwen2_5_vl")
    sft_config, grpo_config = TASK_CONFIGS[task]
    start = time.perf_counter()
    out = Path(out_dir)
    for part in DEMO_PARTS:  # a demo run again starts over (only what the demo itself writes is removed)
        target = out / part
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    tools = task in ("tools", "agent")
    if task == "vision":
        data = write_vision_task(out / "data", seed=0, **VISION_TASK)
        shape = VISION_MODEL
    else:
        data = write_task("arithmetic", out / "data", seed=0, **(TOOL_TASK if tools else TASK))
        shape = MOE_MODEL if family == "qwen3_moe" else MODEL
    model_dir = make_tiny(out / "tiny-model", seed=seed, tools=tools, **shape)
    log.info("demo: data in %s, tiny model in %s", out / "data", model_dir)

    def sft_stage(config: str, model: str | Path, train_path: Path, name: str) -> dict[str, Any]:
        paths = [f"model.path={model}", f"data.train_path={train_path}", f"run.output_dir={out}"]
        cfg = load_config(SFTConfig, config_path(config), [*paths, f"run.name={name}", f"run.seed={seed}"])
        return sft(preflight_sft(cfg))

    start_from: str | Path = model_dir
    if tools:  # the first stage: learn to call the calculator and copy
        start_from = sft_stage(TOOLS_PRETRAIN_CONFIG, model_dir, data["tools"], "sft-tools")["checkpoint"]
    sft_summary = sft_stage(sft_config, start_from, data["sft"], "sft")
    warm = sft_summary["checkpoint"]

    grpo_cfg = load_config(
        TrainConfig,
        config_path(grpo_config),
        [
            f"model.path={warm}",
            f"data.train_path={data['train']}",
            f"data.eval_path={data['test']}",
            f"run.output_dir={out}",
            "run.name=grpo",
            f"run.seed={seed}",
            *(overrides or []),
        ],
    )
    env = grpo_cfg.env if grpo_cfg.env.name is not None else None
    evaluations: dict[str, dict[str, Any]] = {}

    def accuracy(model: str, when: str) -> float:
        if task == "agent":  # the agent itself, held out over the API (greedy)
            from dockrl.recipes.eval import evaluate_agent

            assert env is not None and env.source_file is not None
            result = evaluate_agent(
                model,
                str(data["test"]),
                f"{env.source_file}:{str(env.name).rpartition(':')[2]}",
                [RewardSpec(name="exact_answer")],
                max_new_tokens=grpo_cfg.rollout.max_new_tokens,
            )
            evaluations[when] = {k: v for k, v in result.items() if k != "records"}
            calls = [r["requests"] > 1 for r in result["records"]]
            evaluations[when]["tool_call_rate"] = sum(calls) / max(1, len(calls))
            return result["accuracy"]
        result = evaluate_model_dir(
            model,
            str(data["test"]),
            [RewardSpec(name="exact_answer")],
            max_new_tokens=grpo_cfg.rollout.max_new_tokens,  # what GRPO trains (and its eval scores) at
            max_prompt_len=grpo_cfg.data.max_prompt_len,
            env=env,
        )
        evaluations[when] = {k: v for k, v in result.items() if k != "records"}
        return result["accuracy"]

    before = accuracy(warm, "before")
    log.info("demo: held-out accuracy after SFT = %.3f", before)
    grpo_summary = train(preflight_train(grpo_cfg))
    after = accuracy(grpo_summary["checkpoint"], "after")
    summary = {
        "accuracy_before_grpo": before,
        "accuracy_after_grpo": after,
        "improvement_points": 100 * (after - before),
        "grpo_steps": grpo_summary["steps"],
        "seed": seed,
        "wall_time_s": time.perf_counter() - start,
        "sft_checkpoint": warm,
        "grpo_checkpoint": grpo_summary["checkpoint"],
        "grpo_run_dir": grpo_summary["run_dir"],
        "task": task,
    }
    if env is not None:  # how often the greedy trajectories called the calculator, before and after
        summary["tool_call_rate_before_grpo"] = evaluations["before"]["tool_call_rate"]
        summary["tool_call_rate_after_grpo"] = evaluations["after"]["tool_call_rate"]
    RunDir(out.parent, out.name).write_summary(summary)
    RunDir(out, "grpo").write_summary({"accuracy_before_grpo": before, "accuracy_after_grpo": after})
    print(
        f"\nheld-out accuracy: after SFT {100 * before:.1f}%  ->  after GRPO {100 * after:.1f}%  "
        f"({100 * (after - before):+.1f} points, {summary['wall_time_s']:.0f} s)"
    )
    return summary
