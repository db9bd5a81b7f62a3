"""Prompts that leave no room for the response within the model's positions are found by the data pass of
`dockrl train`, before Ray or any worker starts (issue 45 item 4): the error names the file, the line of the
first such prompt, how many there are and the fix. Before the check the run started, and its rollout worker
failed mid-step on the first such prompt ("exceeds the cache limit")."""

import json

from runs import run_cli


def _write_data(path, prompts):
    with path.open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "answer": "5"}) + "\n")
    return path


def test_a_prompt_without_room_for_the_response_is_named_before_any_process_starts(tmp_path):
    from dockrl.models.tiny import make_tiny

    # 64 positions, 32 of them for the response: the short prompts render to 15 tokens, the long ones to 71
    model = make_tiny(
        tmp_path / "model", family="qwen2", hidden_size=64, num_layers=2, max_position_embeddings=64
    )
    long = "What is " + "+".join(["12"] * 20) + "?"
    data = _write_data(tmp_path / "prompts.jsonl", ["What is 2+3?"] * 2 + [long, "What is 1+4?", long])
    config = tmp_path / "grpo.yaml"
    config.write_text(
        "rollout: {samples_per_prompt: 2, max_new_tokens: 32}\n"
        "run: {steps: 1, prompts_per_step: 4, device: cpu, progress: false, worker_timeout_s: 120}\n"
    )
    result, _ = run_cli(
        [
            "train",
            str(config),
            f"model.path={model}",
            f"data.train_path={data}",
            f"run.output_dir={tmp_path}",
            "run.name=room",
        ],
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr
    assert f"{data}: 2 prompts" in error and "first at line 3 (71 tokens)" in error, error[-2000:]
    assert "max_position_embeddings=64 - rollout.max_new_tokens=32 = 32" in error, error[-2000:]
    assert "data.max_prompt_len=32" in error, error[-2000:]  # the fix: skip them, or make room
    # no process ran: Ray never started, and the run directory holds no failure log of a worker
    assert "Started a local Ray instance" not in error
    assert not (tmp_path / "room" / "errors.log").exists()


def test_multi_turn_prompts_that_leave_less_than_the_trajectory_budget_are_warned_of(caplog):
    """Multi-turn: a full first turn must fit (an error otherwise, as single-turn); a trajectory the model's
    positions cut short is warned of, naming the first such prompt (the rollout truncates it there)."""
    import pytest

    from dockrl.errors import ConfigError
    from dockrl.recipes.common import EncodedPrompt, check_prompt_room

    prompts = [EncodedPrompt([1] * n, "", None, i, where=f"line {i + 1}") for i, n in enumerate([10, 40, 30])]
    with caplog.at_level("WARNING"):
        check_prompt_room("p.jsonl", prompts, max_positions=64, max_new_tokens=16, trajectory=40)
    assert (
        "2 prompts (first at line 2, 40 tokens)" in caplog.text and "data.max_prompt_len to 24" in caplog.text
    )
    with pytest.raises(
        ConfigError, match=r"p.jsonl: 1 prompt leaves no room .* first at line 2 \(40 tokens\)"
    ):
        check_prompt_room("p.jsonl", prompts, max_positions=64, max_new_tokens=32, trajectory=40)
