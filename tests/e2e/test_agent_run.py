"""Agent functions trained through the CLI (docs/agents.md): an `async def solve(client, row)` written against the
`openai` client, with the calculator as an OpenAI tool, on the environment tier in front of the rollout: with
tensor-parallel rollout ranks in lockstep, and held-out through the same agents; a bad agent file is a config
error before Ray."""

import json
import math

import pytest

from dockrl.cli import main
from runs import tiny_paths

pytest.importorskip("openai")

AGENT_FILE = '''
import json

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


async def solve(client, row):
    """Ask; answer each calculator call; ask again: two requests per sample."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        messages.append({"role": "user", "content": "Answer with the number only."})
    return None  # the reward functions score the final message
'''

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}]}\n"
    "run: {steps: 2, prompts_per_step: 2, progress: false, worker_timeout_s: 300, precision: fp32, log_samples: 2}\n"
    "env: {name: ./agent.py:solve, max_turns: 3, max_response_tokens: 200, call_timeout_s: 120}\n"
)


def test_an_agent_function_trains_with_tensor_parallel_rollout(
    ray_session, tmp_path, tiny_model, arithmetic_data
):
    (tmp_path / "agent.py").write_text(AGENT_FILE)
    config = tmp_path / "agent.yaml"
    config.write_text(CONFIG)
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    args += [f"run.output_dir={tmp_path}", "run.name=agent", "rollout.tp=2"]
    args += [f"data.eval_path={arithmetic_data['test']}", "data.eval_limit=4"]  # held out through the agents
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        # every sample made its two requests (one policy turn each), continued token in and token out
        assert row["env/turns"] == 2.0 and row["agent/prefix_breaks"] == 0.0 and row["env/failed"] == 0.0
        assert row["env/truncated"] == 0.0 and math.isfinite(row["actor/kl"])
        # the response holds both turns and the masked tokens between them (the chat template's, the user's)
        assert row["response_length/mean"] > 2 * 6
    samples = [json.loads(line) for line in (tmp_path / "agent" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(len([t for t in s["turns"] if t["role"] == "assistant"]) == 2 for s in samples)
    # the row's prompt is the agent's first request: the calculator's schema rendered by the chat template
    assert all("calculator" in s["prompt"] for s in samples)
    summary = json.loads((tmp_path / "agent" / "summary.json").read_text())
    assert summary["eval_accuracy"] == 0.0  # a random model answers no held-out problem


def test_a_bad_agent_is_a_config_error_before_ray(tmp_path, tiny_model, arithmetic_data, capsys):
    (tmp_path / "agent.py").write_text("async def solve(client):\n    return 1.0\n")
    config = tmp_path / "agent.yaml"
    config.write_text(CONFIG)
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data), f"run.output_dir={tmp_path}"]
    assert main(args) == 2
    assert "must take (client, row)" in capsys.readouterr().err
