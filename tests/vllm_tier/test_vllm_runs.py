"""GRPO through the CLI with rollout.backend=vllm: colocated (dp=2 engines, and one engine over rollout.tp=2
ranks under LoRA), separate replicas one step off-policy (full weights and LoRA), partial rollout and a tool
environment; every weight update is checked on the probe sequence and reported."""

import json
import math

from dockrl.cli import main

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2, backend: vllm, max_batch_size: 16}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "run: {steps: 3, prompts_per_step: 4, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)
# fp32 on both sides: vLLM (oneDNN) and the trainer (torch) differ by rounding only, ~1e-7 per token measured;
# the probe bound (1e-3, vllm_backend.PROBE_TOL) and the run's own log-prob gap (1e-5: 100x) have room.
PROBE_BOUND, LOGPROB_BOUND = 1e-3, 1e-5


def _run(tmp_path, model, data, name, *overrides, env_line=""):
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG + env_line)
    args = ["train", str(config), f"model.path={model}", f"data.train_path={data['train']}"]
    assert main([*args, f"run.output_dir={tmp_path}", f"run.name={name}", *overrides]) == 0
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _check_updates(rows, steps, loads):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert 0 <= row["rollout/probe_abs_diff"] < PROBE_BOUND
        assert row["rollout/logprob_abs_diff"] < LOGPROB_BOUND and math.isfinite(row["actor/kl"])
    assert sum("timing/weight_load" in r for r in rows) == loads


def test_colocated_engines_on_every_rank_through_cli(ray_session, tmp_path, vllm_model, arithmetic_data):
    rows = _run(tmp_path, vllm_model, arithmetic_data, "colocated")
    _check_updates(rows, 3, loads=3)
    for row in rows:
        assert row["rollout/weight_load_mb"] > 0 and 1 <= row["response_length/mean"] <= 6


def test_lora_into_one_engine_over_two_ranks_through_cli(ray_session, tmp_path, vllm_model, arithmetic_data):
    """actor.lora: the switch merges W + s B A into each bucket it streams; rollout.tp=2: one vLLM engine over
    both ranks, which cuts its own slices of the full tensors."""
    rows = _run(
        tmp_path, vllm_model, arithmetic_data, "lora_tp2", "rollout.tp=2", "actor.lora.rank=4", "run.steps=2"
    )
    _check_updates(rows, 2, loads=2)


def test_separate_replicas_one_step_off_policy_through_cli(
    ray_session, tmp_path, vllm_model, arithmetic_data
):
    overrides = ["rollout.placement=separate", "rollout.replicas=2", "rollout.max_staleness=1"]
    rows = _run(tmp_path, vllm_model, arithmetic_data, "separate", *overrides)
    # steps 1 and 2 generate with version 0 (one load), step 3 with version 1
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/probe_abs_diff"] < PROBE_BOUND for r in rows if "rollout/probe_abs_diff" in r)
    assert sum("timing/weight_load" in r for r in rows) == 2


def test_separate_lora_replica_through_cli(ray_session, tmp_path, vllm_model, arithmetic_data):
    """The replica receives adapters only and loads the merged weights into its engine."""
    overrides = ["rollout.placement=separate", "actor.lora.rank=4", "actor.dp=1", "run.steps=2"]
    rows = _run(tmp_path, vllm_model, arithmetic_data, "separate_lora", *overrides)
    _check_updates(rows, 2, loads=2)


def test_partial_rollout_continues_rows_through_cli(ray_session, tmp_path, vllm_model, arithmetic_data):
    overrides = ["rollout.partial=true", "rollout.max_staleness=1", "rollout.partial_tokens=2"]
    rows = _run(tmp_path, vllm_model, arithmetic_data, "partial", *overrides)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/probe_abs_diff"] < PROBE_BOUND for r in rows)
    assert sum(r.get("rollout/interrupted", 0) for r in rows) > 0  # rows were cut and carried


def test_tool_environment_through_cli(ray_session, tmp_path, vllm_model, arithmetic_data):
    env_line = "env: {name: tools, kwargs: {tools: [calculator]}, max_turns: 2}\n"
    rows = _run(tmp_path, vllm_model, arithmetic_data, "tools", "run.steps=1", env_line=env_line)
    (row,) = rows
    assert row["env/turns"] >= 1 and row["env/failed"] == 0
    assert row["rollout/probe_abs_diff"] < PROBE_BOUND
