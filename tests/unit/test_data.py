"""data/: prompt loading (JSON lines, JSON array, Parquet), error messages, rendering, synthetic tasks."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dockrl.data import (
    DatasetError,
    PromptRecord,
    arithmetic_rows,
    load_prompts,
    render_prompt,
    write_jsonl,
    write_task,
)


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------- loading


def test_load_jsonl(tmp_path):
    path = _write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "What is 1+1?", "answer": "2", "extra": 0}),
            "",  # blank lines are skipped
            json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 7}),
        ],
    )
    records = load_prompts(path)
    assert records == [
        PromptRecord("What is 1+1?", "2", 0, str(path), "line 1"),
        PromptRecord(
            [{"role": "user", "content": "hi"}], 7, 1, str(path), "line 3"
        ),  # its line, past the blank
    ]
    assert [r.prompt for r in load_prompts(path, limit=1)] == ["What is 1+1?"]


def test_load_json_array_and_custom_fields(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"question": "q0", "gt": 0}, {"question": "q1", "gt": 1}]))
    records = load_prompts(path, prompt_field="question", label_field="gt")
    assert [(r.prompt, r.label, r.index) for r in records] == [("q0", 0, 0), ("q1", 1, 1)]
    unlabelled = load_prompts(path, prompt_field="question", label_field=None)
    assert [r.label for r in unlabelled] == [None, None]


def test_load_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    table = pa.table(
        {
            "question": ["What is 2+2?", "What is 3+3?"],
            "solution": ["4", "6"],
            "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        }
    )
    pq.write_table(table, path)
    records = load_prompts(path, prompt_field="question", label_field="solution")
    assert [(r.prompt, r.label, r.index, r.source) for r in records] == [
        ("What is 2+2?", "4", 0, str(path)),
        ("What is 3+3?", "6", 1, str(path)),
    ]
    chats = load_prompts(path, prompt_field="messages", label_field=None, limit=1)
    assert chats[0].prompt == [{"role": "user", "content": "a"}]
    with pytest.raises(DatasetError, match=r"p\.parquet.*'answer'.*'question', 'solution', 'messages'"):
        load_prompts(path, prompt_field="question")  # default label_field "answer" is absent


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = _write_lines(
        tmp_path / "bad.jsonl",
        [
            json.dumps({"prompt": "a", "answer": "1"}),
            json.dumps({"prompt": "b", "answer": "2"}),
            '{"prompt": "c",',
        ],
    )
    with pytest.raises(DatasetError, match=r"bad\.jsonl: line 3 is not valid JSON") as info:
        load_prompts(path)
    assert "line 3" in str(info.value)


def test_missing_field_names_file_line_field_and_present_fields(tmp_path):
    path = _write_lines(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt": "a", "answer": "1"}), json.dumps({"question": "b", "answer": "2"})],
    )
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert "p.jsonl" in message and "line 2" in message
    assert "'prompt' is missing" in message and "['answer', 'question']" in message


def test_other_loading_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_prompts(empty)
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"'\.csv'.*\.jsonl"):
        load_prompts(csv)
    not_object = _write_lines(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DatasetError, match="line 1 is a JSON list"):
        load_prompts(not_object)
    bad_prompt = _write_lines(tmp_path / "num.jsonl", [json.dumps({"prompt": 5, "answer": "5"})])
    with pytest.raises(DatasetError, match="must be text or a list"):
        load_prompts(bad_prompt)


# ---------------------------------------------------------------- rendering


class FakeTokenizer:
    """Duck-typed chat template: '<role>content' per message, then '<assistant>' for the reply."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_render_prompt():
    text = PromptRecord("What is 1+1?", "2", 0, "mem")
    chat = PromptRecord(
        [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}], None, 1, "mem"
    )
    tok = FakeTokenizer()
    assert render_prompt(text, tok) == "<user>What is 1+1?<assistant>"
    assert (
        render_prompt(text, tok, system_prompt="Be brief.")
        == "<system>Be brief.<user>What is 1+1?<assistant>"
    )
    assert render_prompt(text, tok, system_prompt="S", use_chat_template=False) == "S\n\nWhat is 1+1?"
    assert render_prompt(chat, tok) == "<system>own<user>hi<assistant>"
    with pytest.warns(UserWarning, match="own system message"):
        assert render_prompt(chat, tok, system_prompt="other") == "<system>own<user>hi<assistant>"


def test_render_prompt_rejects_token_ids():
    class IdsTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return [1, 2, 3]

    with pytest.raises(TypeError, match="tokenize=False"):
        render_prompt(PromptRecord("x", None, 0, "mem"), IdsTokenizer())


# ---------------------------------------------------------------- synthetic tasks


def test_arithmetic_rows_deterministic_distinct_and_correct():
    rows = arithmetic_rows(200, seed=3, ops="+-*", num_operands=3, min_operand=-5, max_operand=20)
    assert rows == arithmetic_rows(200, seed=3, ops="+-*", num_operands=3, min_operand=-5, max_operand=20)
    assert rows != arithmetic_rows(200, seed=4, ops="+-*", num_operands=3, min_operand=-5, max_operand=20)
    assert len({r["prompt"] for r in rows}) == 200
    for row in rows:
        assert row["prompt"].startswith("What is ") and row["prompt"].endswith("?")
        expression = row["prompt"][len("What is ") : -1]
        assert set(expression) <= set("0123456789+-*()")
        assert row["answer"] == str(eval(expression))  # Python's precedence is the reference
    # pinned: a changed generator silently changes every dataset made with a seed
    assert arithmetic_rows(1, seed=0)[0] == {"prompt": "What is 49-97?", "answer": "-48"}


def test_arithmetic_rows_errors():
    with pytest.raises(ValueError, match="subset of '\\+-\\*'"):
        arithmetic_rows(3, ops="+/")
    with pytest.raises(ValueError, match="exceeds the 8 distinct"):
        arithmetic_rows(9, min_operand=0, max_operand=1, ops="+-")  # 2 * 2 * 2 expressions
    assert len(arithmetic_rows(8, min_operand=0, max_operand=1, ops="+-")) == 8  # all of them


def test_write_task_train_test_disjoint(tmp_path):
    paths = write_task("arithmetic", tmp_path / "arith", num_train=300, num_test=50, seed=1, max_operand=20)
    assert paths == {"train": tmp_path / "arith" / "train.jsonl", "test": tmp_path / "arith" / "test.jsonl"}
    train, test = load_prompts(paths["train"]), load_prompts(paths["test"])
    assert len(train) == 300 and len(test) == 50
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    with pytest.raises(ValueError, match=r"unknown synthetic task 'sorting'.*\['arithmetic'\]"):
        write_task("sorting", tmp_path, num_train=1, num_test=1)


def test_write_jsonl_round_trip(tmp_path):
    path = write_jsonl([{"prompt": "é", "answer": "1"}], tmp_path / "deep" / "x.jsonl")
    assert load_prompts(path)[0].prompt == "é"


def test_hedging_teacher_rows_and_sft_file(tmp_path):
    from dockrl.data.synthetic import hedging_teacher_rows, write_task

    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(200)]
    sft = hedging_teacher_rows(rows, error=0.7, samples=4, seed=3)
    assert len(sft) == 800 and sft == hedging_teacher_rows(rows, error=0.7, samples=4, seed=3)
    hedged = [r for r in sft if " or " in r["answer"]]
    assert 0.65 < len(hedged) / len(sft) < 0.75
    truth = {r["prompt"]: int(r["answer"]) for r in rows}
    for r in sft:
        first, _, second = r["answer"].partition(" or ")
        assert int(first) == truth[r["prompt"]]  # the first answer is always right
        if second:
            assert abs(int(second) - int(first)) in (1, 2)
    paths = write_task("arithmetic", tmp_path, num_train=20, num_test=5, max_operand=9, teacher_error=0.5)
    assert sum(1 for _ in open(paths["sft"])) == 80


def test_tool_teacher_conversations_call_the_calculator_or_estimate():
    from dockrl.data.synthetic import arithmetic_rows, estimate, tool_teacher_rows
    from dockrl.envs.tool_calls import parse_tool_calls
    from dockrl.envs.tools import Calculator

    rows = arithmetic_rows(50, seed=0, min_operand=100, max_operand=999, ops="*")
    traces = tool_teacher_rows(rows, tool_rate=0.3, samples=2, seed=1)
    assert len(traces) == 100
    called = [t for t in traces if len(t["messages"]) == 4]
    assert 12 <= len(called) <= 48  # Binomial(100, 0.3): within 3.9 standard deviations (4.58)
    for trace in traces:
        user, *rest = trace["messages"]
        if len(rest) == 3:  # call -> result -> answer: the call computes the answer exactly
            (call,) = parse_tool_calls(rest[0]["content"], "qwen2").calls
            assert (
                Calculator().run(call.arguments)
                == rest[1]["content"]
                == rest[2]["content"]
                == trace["answer"]
            )
        else:  # an estimate: two significant figures
            assert rest[0]["content"] == estimate(int(trace["answer"]))
    assert (estimate(287663), estimate(-1234), estimate(99)) == ("About 290000", "About -1200", "About 99")
    assert sum(estimate(int(r["answer"])) == f"About {r['answer']}" for r in rows) == sum(
        int(r["answer"]) % 10 ** (len(r["answer"]) - 2) == 0 for r in rows
    )  # right only where the product is round


def test_write_task_tool_traces_are_distinct_from_sft_and_test(tmp_path):
    from dockrl.data.synthetic import write_task

    paths = write_task(
        "arithmetic",
        tmp_path,
        num_train=10,
        num_test=5,
        min_operand=100,
        max_operand=999,
        ops="*",
        tool_rate=0.3,
        teacher_samples=1,
        num_sft=20,
        num_tool_traces=30,
    )
    read = lambda name: [json.loads(line) for line in open(paths[name])]  # noqa: E731
    sft, tools, train, test = read("sft"), read("tools"), read("train"), read("test")
    assert (len(sft), len(tools), len(train), len(test)) == (20, 30, 10, 5)
    asked = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert all(len(t["messages"]) == 4 for t in tools)  # every trace calls the calculator
    assert len(asked(sft) | asked(tools)) == 50  # distinct prompts
    assert not (asked(sft) | asked(tools)) & {r["prompt"] for r in test}
    assert {r["prompt"] for r in train} <= asked(sft)
