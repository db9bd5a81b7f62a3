"""The TRL arm of `dockrl bench multiturn` (bench/trl_turns.py): TRL's own tool loop, its turns forced, runs every
trajectory for exactly `turns` policy turns with the real calculator's answers in the conversation, and counts
the tokens it sampled consistently."""

import re
from pathlib import Path

import pytest

import dockrl
from dockrl.cli import build_parser

pytest.importorskip("trl")


def test_trl_runs_its_tool_loop_for_every_forced_turn(tmp_path, monkeypatch):
    from dockrl.bench.rollout_turns import CalculatorTurns, response_budget, trajectory_rows
    from dockrl.bench.trl_turns import trl_arm
    from dockrl.models.tiny import make_tiny
    from dockrl.models.tokenizer import Tokenizer

    # TRL's child without tests/ on its path: tests/vllm would pass for a vLLM install without a version
    monkeypatch.setenv("PYTHONPATH", str(Path(dockrl.__file__).parents[1]))
    args = build_parser().parse_args(
        ["bench", "multiturn", "--prompts=2", "--samples=2", "--turns=3", "--new-tokens=8", "--rounds=1"]
    )
    model = make_tiny(tmp_path / "m", family="qwen2", hidden_size=32, num_layers=1, seed=0, tools=True)
    budget = response_budget(args)  # 3 x 8 + 2 x 32: room for both tool answers and every turn's 8 tokens
    out = trl_arm(args, model, trajectory_rows(args), budget, "fp32")
    assert isinstance(out, dict), out
    (round_,), trajectories = out["rounds"], out["trajectories"]
    assert out["config"]["max_tool_calling_iterations"] == 2 and out["precision"] == "fp32"
    assert len(trajectories) == 4 and round_["policy_turns"] == 4 * 3
    for t in trajectories:
        a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", t["question"]).groups())
        assert t["policy_turns"] == 3
        # the real calculator's answer, twice, as TRL's chat-template suffix wrote it into the token stream
        assert t["tool_results"] == [str(a * b)] * 2
        assert t["text"].count(f"<tool_response>\n{a * b}\n</tool_response>") == 2
        # each policy turn samples 1..8 tokens; the rest of the completion is the two tool suffixes
        assert 3 <= t["sampled_tokens"] <= 3 * 8 < t["completion_tokens"] <= budget
    # what the generate calls returned is what the tool mask counts as sampled (nothing cut by the budget)
    assert (
        round_["sampled_tokens"]
        == round_["generated_tokens"]
        == sum(t["sampled_tokens"] for t in trajectories)
    )
    assert round_["completion_tokens"] == sum(t["completion_tokens"] for t in trajectories)
    # TRL's prompts (its tool schema read from the calculator function) are dockrl's, token for token
    tokenizer = Tokenizer.from_dir(model)
    dockrl_prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}],
                add_generation_prompt=True,
                tools=CalculatorTurns.tools,
            )
        )
        for row in trajectory_rows(args)
    ]
    assert round_["prompt_tokens"] == sum(map(len, dockrl_prompts))
    # every turn re-prefills: turn 1 the prompts, each later turn prompt + completion so far + tool suffix
    assert round_["prefill_tokens"] > round_["prompt_tokens"] * 3
