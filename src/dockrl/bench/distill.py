"""`dockrl bench distill`: on-policy distillation against GRPO, and the two combined, on the demo's task.

    teacher: the demo's model (hidden 128, 4 layers), SFT then GRPO on single-digit arithmetic (`dockrl demo`)
    student: a smaller one (hidden 128, 2 layers, the same tokenizer), after a shorter SFT (15 epochs, not 25)
    per seed, three runs from the same student checkpoint, the same steps and prompts per step:
        grpo          the demo's GRPO config (exact-answer reward)
        opd           algo.name=opd with the teacher (the exact-answer reward only logged)
        grpo+distill  GRPO plus distill.coef x the teacher term
        opd-top-k     algo.name=opd with distill.top_k=--top-k: the forward KL over the teacher's top-k and the
                      tail, a term of the loss (the teacher's top-k ids and log-probs in the dock)
    held-out accuracy (greedy, the 40 held-out problems) every --eval-every steps, the run's wall time, and the
    teacher's cost per step (timing/teacher_busy: its forward seconds; the step's time beside it), learning per
    step and per second (accuracy points, and the fall of distill/reverse_kl, the sampled tokens' reverse KL to
    the teacher that both forms log, per step and per training second), and the teacher column's bytes per
    response token (from the declared dtypes: 4 for teacher_logprobs, k x (4 + 4) for the top-k ids and
    log-probs)

Writes OUT/results.json and OUT/report.html with OUT/report/*.png (`dockrl report` of the runs side by side:
eval.png holds the accuracy curves, distill.png the reverse KL to the teacher).
Rows: one per (seed, mode), then the mean over seeds per mode. The figure predicts, at scale, what the
literature reports (Lu et al. 2025): a teacher's dense per-token signal reaches a given accuracy in fewer steps
than a one-bit verifier, for one teacher forward per sampled token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

# The student: smaller than the demo's model (its teacher), same family and vocabulary (make_tiny's tokenizer
# does not depend on the shape or the seed).
STUDENT: dict[str, Any] = dict(
    family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512
)
MODES = ("grpo", "opd", "grpo+distill", "opd-top-k")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/bench-distill", help="output directory")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (student init, SFT, RL)")
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out accuracy every this many steps")
    parser.add_argument("--sft-epochs", type=float, default=15.0, help="the student's short SFT (epochs)")
    parser.add_argument("--coef", type=float, default=0.5, help="distill.coef of grpo+distill")
    parser.add_argument("--top-k", type=int, default=16, help="distill.top_k of opd-top-k")
    parser.add_argument("--teacher", default=None, help="a trained teacher directory (default: train one)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--student-hidden", type=int, default=STUDENT["hidden_size"])
    parser.add_argument("--student-layers", type=int, default=STUDENT["num_layers"])


def run(args: argparse.Namespace) -> list[dict]:
    from dockrl.config import SFTConfig, TrainConfig, load_config
    from dockrl.data.synthetic import write_task
    from dockrl.models.tiny import make_tiny
    from dockrl.recipes.demo import TASK, config_path, run_demo
    from dockrl.recipes.eval import evaluate_model_dir
    from dockrl.recipes.grpo import train
    from dockrl.recipes.preflight import preflight_sft, preflight_train
    from dockrl.recipes.sft import sft
    from dockrl.rewards.runner import RewardSpec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = args.teacher
    teacher_s = None
    if teacher is None:
        start = time.perf_counter()
        summary = run_demo(out / "teacher", seed=0)
        teacher, teacher_s = summary["grpo_checkpoint"], time.perf_counter() - start
    data = write_task("arithmetic", out / "data", seed=0, **TASK)
    exact = [RewardSpec(name="exact_answer")]

    def accuracy(model: str) -> float:
        return evaluate_model_dir(model, str(data["test"]), exact, max_new_tokens=8, max_prompt_len=64)[
            "accuracy"
        ]

    teacher_accuracy = accuracy(str(Path(teacher) / "hf") if (Path(teacher) / "hf").is_dir() else teacher)
    rows: list[dict] = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        base = out / f"seed{seed}"
        shape = STUDENT | {"hidden_size": args.student_hidden, "num_layers": args.student_layers}
        student = make_tiny(base / "student-init", seed=seed, **shape)
        sft_cfg = load_config(
            SFTConfig,
            config_path("demo_sft.yaml"),
            [
                f"model.path={student}",
                f"data.train_path={data['sft']}",
                f"run.output_dir={base}",
                "run.name=sft",
                f"run.seed={seed}",
                f"run.epochs={args.sft_epochs}",
                "run.progress=false",
            ],
        )
        warm = sft(preflight_sft(sft_cfg))["checkpoint"]
        before = accuracy(warm)
        for mode in args.modes.split(","):
            overrides = [
                f"model.path={warm}",
                f"data.train_path={data['train']}",
                f"data.eval_path={data['test']}",
                f"run.output_dir={base}",
                f"run.name={mode}",
                f"run.seed={seed}",
                f"run.steps={args.steps}",
                f"run.eval_every={args.eval_every}",
                "run.progress=false",
            ]
            if mode == "opd":
                overrides += ["algo.name=opd", f"distill.teacher_path={teacher}", "distill.coef=1.0"]
            elif mode == "grpo+distill":
                overrides += [f"distill.teacher_path={teacher}", f"distill.coef={args.coef}"]
            elif mode == "opd-top-k":
                overrides += ["algo.name=opd", f"distill.teacher_path={teacher}", "distill.coef=1.0"]
                overrides += [f"distill.top_k={args.top_k}"]
            cfg = load_config(TrainConfig, config_path("demo_grpo.yaml"), overrides)
            start = time.perf_counter()
            summary = train(preflight_train(cfg))
            wall_s = time.perf_counter() - start
            metrics = [json.loads(line) for line in (base / mode / "metrics.jsonl").read_text().splitlines()]
            curve = {0: before} | {m["step"]: m["eval/accuracy"] for m in metrics if "eval/accuracy" in m}
            busy = [m["timing/teacher_busy"] for m in metrics if "timing/teacher_busy" in m]
            kl = [m.get("distill/reverse_kl") for m in (metrics[0], metrics[-1])]
            kl_fall = kl[0] - kl[1] if None not in kl else None
            rows.append(
                {
                    "seed": seed,
                    "mode": mode,
                    "accuracy_before": before,
                    "accuracy_after": curve[max(curve)],
                    "gain_points": 100 * (curve[max(curve)] - before),
                    "curve": curve,
                    "train_s": wall_s,
                    "step_s": statistics.median(m["timing/step"] for m in metrics),
                    "teacher_busy_s": statistics.median(busy) if busy else 0.0,
                    "reverse_kl_first_last": kl,
                    "points_per_step": 100 * (curve[max(curve)] - before) / max(curve),
                    "points_per_s": 100 * (curve[max(curve)] - before) / wall_s,
                    "kl_fall_per_step": None if kl_fall is None else kl_fall / max(1, len(metrics) - 1),
                    "kl_fall_per_s": None if kl_fall is None else kl_fall / wall_s,
                    "column_bytes_per_token": column_bytes_per_token(mode, args.top_k),
                    "run_dir": summary["run_dir"],
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    means = _means(rows)
    result = {
        "teacher": str(teacher),
        "teacher_accuracy": teacher_accuracy,
        "teacher_train_s": teacher_s,
        "runs": rows,
        "means": means,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    from dockrl.observe.report import write_report

    write_report([Path(r["run_dir"]) for r in rows], out)
    return [
        {k: v for k, v in r.items() if k not in ("curve", "run_dir", "reverse_kl_first_last")} for r in rows
    ] + means


def column_bytes_per_token(mode: str, top_k: int) -> int:
    """Bytes per response token of the teacher's dock column(s) in `mode` (0 without a teacher), from the
    columns' declared dtypes: teacher_logprobs, or top_k x (teacher_topk_ids + teacher_topk_logprobs)."""
    import torch

    from dockrl.dock.columns import TEACHER_LOGPROBS, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS, spec_of

    def size(column: str) -> int:
        return torch.empty(0, dtype=getattr(torch, spec_of(column).dtype)).element_size()

    if mode == "opd-top-k":
        return top_k * (size(TEACHER_TOPK_IDS) + size(TEACHER_TOPK_LOGPROBS))
    return size(TEACHER_LOGPROBS) if mode in ("opd", "grpo+distill") else 0


def _mean_of(runs: list[dict], key: str) -> float | None:
    """The mean of a figure over seeds (None where a run has none: no teacher)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(values) if len(values) == len(runs) else None


def _means(rows: list[dict]) -> list[dict]:
    """Per mode: the mean over seeds of the gain, the final accuracy, the curve, the step and teacher times."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        runs = [r for r in rows if r["mode"] == mode]
        steps = sorted(set.intersection(*(set(r["curve"]) for r in runs)))
        out.append(
            {
                "seed": "mean",
                "mode": mode,
                "accuracy_before": statistics.fmean(r["accuracy_before"] for r in runs),
                "accuracy_after": statistics.fmean(r["accuracy_after"] for r in runs),
                "gain_points": statistics.fmean(r["gain_points"] for r in runs),
                "curve": {s: statistics.fmean(r["curve"][s] for r in runs) for s in steps},
                "train_s": statistics.fmean(r["train_s"] for r in runs),
                "step_s": statistics.fmean(r["step_s"] for r in runs),
                "teacher_busy_s": statistics.fmean(r["teacher_busy_s"] for r in runs),
                **{
                    key: _mean_of(runs, key)
                    for key in ("points_per_step", "points_per_s", "kl_fall_per_step", "kl_fall_per_s")
                },
                "column_bytes_per_token": runs[0]["column_bytes_per_token"],
            }
        )
    return out
