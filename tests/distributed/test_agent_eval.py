"""`dockrl eval --agent`: an agent function written against the `openai` client, run on held-out rows over an
OpenAI-compatible server on the model (serve/agents.py): its requests recorded per sample, its reward used, or
the final message scored when it returns None; an agent that raises fails its sample only."""

import json

from dockrl.cli import main

AGENT = '''
async def solve(client, row):
    """Two requests: the question, then a follow-up on its own answer (the history sent back)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert second.model_extra["prompt_token_ids"][: len(first.model_extra["prompt_token_ids"])] == first.model_extra["prompt_token_ids"]
    if row["label"] == "7":
        raise RuntimeError("this agent breaks on 7")
    return 0.25 if int(row["label"]) % 2 else None
'''


def test_an_agent_function_is_evaluated_over_the_openai_api(tmp_path, tiny_model, capsys):
    data = tmp_path / "held_out.jsonl"
    rows = [
        {"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 5)]
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "agent.py").write_text(AGENT)
    records = tmp_path / "records.jsonl"
    args = [
        "eval",
        "--model",
        str(tiny_model),
        "--data",
        str(data),
        "--agent",
        str(tmp_path / "agent.py") + ":solve",
    ]
    assert main([*args, "--device", "cpu", "--max-new-tokens", "8", "--records", str(records)]) == 0
    result = json.loads(capsys.readouterr().out)
    got = [json.loads(line) for line in records.read_text().splitlines()]
    # answers 3 and 7 are odd: 0.25 from the agent, but 7 raises (failed, 0); 4 and 10: None, so exact_answer
    # scores the final message (a random model: 0)
    assert [r["reward"] for r in got] == [0.25, 0.0, 0.0, 0.0]
    assert [r["failed"] is not None for r in got] == [False, True, False, False]
    assert all(r["requests"] == 2 for r in got) and result["requests_per_sample"] == 2.0
    assert result["failed"] == 1 and result["num_prompts"] == 4 and result["reward_mean"] == 0.0625


def test_a_plain_function_is_not_an_agent(tmp_path, tiny_model, arithmetic_data, capsys):
    (tmp_path / "sync_agent.py").write_text("def solve(client, row):\n    return 1.0\n")
    args = ["eval", "--model", str(tiny_model), "--data", str(arithmetic_data["test"])]
    assert main([*args, "--agent", str(tmp_path / "sync_agent.py") + ":solve"]) == 2
    assert "must be an `async def solve(client, row)" in capsys.readouterr().err
