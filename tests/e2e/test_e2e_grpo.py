"""End to end: two GRPO steps through the CLI (Ray, dock with 2 warehouses, actor tp=2 -> rollout tp=1), then eval."""

import json
import math

import pytest
import torch

from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from runs import tiny_paths

REQUIRED = [
    "timing/rollout",
    "timing/reward",
    "timing/reference",
    "timing/update",
    "timing/step",
    "throughput/tokens_per_s",
    "throughput/rollout_tokens_per_s",
    "throughput/update_tokens_per_s",
    "reward/mean",
    "reward/std",
    "train/accuracy",
    "response_length/mean",
    "response_length/min",
    "response_length/max",
    "actor/kl",
    "actor/entropy",
    "actor/clip_frac",
    "actor/grad_norm",
    "actor/lr",
    "actor/pg_loss",
]


def test_two_grpo_steps_through_cli(ray_session, tmp_path, tiny_model, arithmetic_data, capsys):
    config = tmp_path / "grpo.yaml"
    config.write_text(
        "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2, tp: 1}\n"
        # Trains tensor-parallel (tp=2) and generates with tp=1 (2 replicas): the allgather-swap runs every step.
        "actor: {dp: 1, tp: 2, lr: 1.0e-3, micro_batch_size: 4}\n"
        "algo: {kl_coef: 0.01}\n"
        # A random model never answers right; a length reward gives the groups reward spread to learn from.
        "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
        "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
        # The KV cache is dropped after each rollout and built again at the next (the CUDA default).
        "reshard: {free_kv_cache: true}\n"
        # fp32: trainer and rollout log-probs then agree to rounding (checked below)
        "run: {steps: 2, prompts_per_step: 4, progress: false, worker_timeout_s: 300, log_samples: 2, "
        "precision: fp32}\n"
    )
    code = main(
        [
            "train",
            str(config),
            f"model.path={tiny_model}",
            f"data.train_path={arithmetic_data['train']}",
            f"data.eval_path={arithmetic_data['test']}",
            "data.eval_limit=8",
            f"run.output_dir={tmp_path}",
            "run.name=e2e",
        ]
    )
    assert code == 0
    run = tmp_path / "e2e"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in REQUIRED:
            assert key in row and row[key] is not None and math.isfinite(row[key]), key
        assert row["dock/rows"] == 16
        assert 1 <= row["response_length/min"] <= row["response_length/max"] <= 6
        assert row["actor/grad_norm"] > 0
        # trainer (tp=2) and rollout engine (tp=1) compute the same fp32 log-probs of the sampled tokens: their
        # gap is rounding (~1e-7 here; 1e-5 leaves 100x for other CPUs), and so is the KL between them
        assert row["rollout/logprob_abs_diff"] < 1e-5 and 0 <= row["rollout/kl"] < 1e-9
    assert (
        "eval/accuracy" not in rows[0] and 0 <= rows[1]["eval/accuracy"] <= 1
    )  # eval_every=0: at the end only
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all({"prompt", "response", "reward"} <= set(s) for s in samples)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 <= summary["eval_accuracy"] <= 1

    checkpoint = summary["checkpoint"]  # a checkpoint root: eval and load_state_dict read its hf/
    trained, initial = load_state_dict(f"{checkpoint}/hf"), load_state_dict(tiny_model)
    assert set(trained) == set(initial)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the update moved the weights"

    capsys.readouterr()  # `dockrl eval --model` takes the checkpoint root as well as its hf/ directory
    assert main(["eval", "--model", checkpoint, "--data", str(arithmetic_data["test"]), "--limit", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 8 and 0 <= result["accuracy"] <= 1


def test_a_reward_file_next_to_the_config_trains(
    ray_session, tmp_path, tiny_model, arithmetic_data, monkeypatch
):
    """reward.functions=[{name: ./my_reward.py:fn}] from a directory on no import path: the driver reads the file
    when the config loads and every reward worker and process runs the shipped source."""
    import html
    import json

    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "my_reward.py").write_text(
        "def fn(prompt, response, label):\n    return float(len(response) % 2 == 0)\n"
    )
    (configs / "grpo.yaml").write_text(
        "rollout: {samples_per_prompt: 4, max_new_tokens: 6}\n"
        "actor: {dp: 1, lr: 1.0e-3, micro_batch_size: 8}\n"
        "reward: {functions: [{name: ./my_reward.py:fn}], num_processes: 1}\n"
        "run: {steps: 3, prompts_per_step: 4, progress: false, worker_timeout_s: 300, log_samples: 1,\n"
        "      loggers: [jsonl, tensorboard]}\n"
    )
    monkeypatch.chdir(tmp_path)
    args = [*tiny_paths(tiny_model, arithmetic_data), "run.output_dir=runs"]
    assert main(["train", str(configs / "grpo.yaml"), *args, "run.name=file_reward"]) == 0
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "file_reward" / "metrics.jsonl").read_text().splitlines()
    ]
    samples = [
        json.loads(line)
        for line in (tmp_path / "runs" / "file_reward" / "samples.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(
        s["reward"] == float(len(s["response"]) % 2 == 0) for s in samples
    )  # the file's function scored
    # run.loggers=[jsonl, tensorboard]: every metric as a TensorBoard scalar, the samples as text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "runs" / "file_reward" / "tensorboard"))
    board.Reload()
    scalars = board.Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars] == [
        (r["step"], pytest.approx(r["reward/mean"])) for r in rows
    ]
    assert "samples" in board.Tags()["tensors"] or "samples/text_summary" in board.Tags()["tensors"]
    # dockrl report of the run: PNG plots (reward, length, KL and entropy, timeline, ...) and report.html with them
    # and the run's samples; two runs side by side need --out.
    run = tmp_path / "runs" / "file_reward"
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    for plot in ("reward.png", "length.png", "kl_entropy.png", "timeline.png"):
        assert (run / "report" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"report/{plot}" in page
    assert html.escape(samples[-1]["response"])[:20] in page
    assert main(["report", str(run), str(run)]) == 2  # several runs, no --out
    assert main(["report", str(run), str(run), "--out", str(tmp_path / "both")]) == 0
    assert (
        tmp_path / "both" / "report" / "timeline_runs-file_reward.png"
    ).is_file()  # same names: parent added


def test_the_console_script_leaves_no_process_and_marks_its_start_up(tmp_path, tiny_model, arithmetic_data):
    """`dockrl train` as a user runs it (its own local Ray): it exits without Ray's graceful shutdown, and the
    reaper still takes every process of the run down; summary.json has the start-up phases, in order."""
    from dockrl.workers.reaper import SWEEP_S
    from runs import run_cli, wait_gone

    config = tmp_path / "grpo.yaml"
    config.write_text(
        "rollout: {samples_per_prompt: 2, max_new_tokens: 4}\n"
        "reward: {functions: [{name: exact_answer}]}\n"
        "run: {steps: 1, prompts_per_step: 2, progress: false}\n"
    )
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data), f"run.output_dir={tmp_path}"]
    result, marker = run_cli([*args, "run.name=console"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_gone(marker, within_s=SWEEP_S + 5, prefix="") == []  # Ray's daemons and workers too
    phases = json.loads((tmp_path / "console" / "summary.json").read_text())["startup"]
    order = ["cli", "config", "data", "ray", "dock", "started/actors", "setup", "first step", "close"]
    assert [p for p in phases if p in order] == order
    assert all(phases[a] <= phases[b] for a, b in zip(order, order[1:]))
