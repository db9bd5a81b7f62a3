"""dockrl data gsm8k|math: published layouts (written here as small fixture files) -> prompt files with bare
final answers that the loader reads and the rule rewards score."""

import json

import pytest

from dockrl.cli import main
from dockrl.data.convert import DEFAULT_SYSTEM_PROMPT, convert
from dockrl.data.datasets import DatasetError, load_prompts
from dockrl.rewards.builtin import exact_answer

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {
        "question": "A farm sells 1,250 eggs a day. How many in 2 days?",
        "answer": "1,250 * 2 = 2,500\n#### 2,500",
    },
    {"question": "No final answer here.", "answer": "we never finish"},
]
MATH = [
    {
        "problem": "What is $1/2 + 1/4$?",
        "solution": "Add: $\\frac{1}{2}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$.",
    },
    {"problem": "Solve $x+1=3$.", "solution": "So $x = \\boxed{2}$.", "answer": "2"},
    {"problem": "Unboxed.", "solution": "the answer is 5"},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_final_answers_are_bare_numbers(tmp_path):
    src = _jsonl(tmp_path / "train.jsonl", GSM8K)
    result = convert("gsm8k", src, tmp_path / "out" / "gsm8k_train.jsonl")
    assert result["rows"] == 2 and result["skipped_without_answer"] == 1
    records = load_prompts(result["out"])
    assert [r.label for r in records] == ["7", "2500"]
    assert records[0].prompt == [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": GSM8K[0]["question"]},
    ]
    # The rewards read the bare label: a boxed or plain final answer scores 1.
    assert exact_answer("", "3 + 4 = 7, so \\boxed{7}", records[0].label).score == 1.0
    assert exact_answer("", "It is 2,500 eggs", records[1].label).score == 1.0


def test_math_takes_the_answer_field_or_the_last_box_with_nested_braces(tmp_path):
    src = _jsonl(tmp_path / "math.jsonl", MATH)
    result = convert(
        "math", src, tmp_path / "converted", system_prompt=""
    )  # a directory: OUT/<src name>.jsonl
    assert result["out"] == str(tmp_path / "converted" / "math.jsonl")
    with pytest.raises(DatasetError, match="is the source file itself"):
        convert("math", src, tmp_path)
    records = load_prompts(result["out"])
    assert [r.label for r in records] == ["\\frac{3}{4}", "2"] and result["skipped_without_answer"] == 1
    assert records[0].prompt == MATH[0]["problem"]  # plain text without a system prompt


def test_parquet_sources_and_the_cli(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(GSM8K), tmp_path / "test.parquet")
    assert main(["data", "gsm8k", str(tmp_path / "test.parquet"), str(tmp_path / "gsm8k_test.jsonl")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == 2
    assert [r.label for r in load_prompts(tmp_path / "gsm8k_test.jsonl")] == ["7", "2500"]


def test_malformed_rows_name_the_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(DatasetError, match="bad.jsonl: line 2 is not valid JSON"):
        convert("gsm8k", src, tmp_path / "o.jsonl")
    _jsonl(src, [{"problem": "x"}])
    with pytest.raises(DatasetError, match=r"line 1 lacks field\(s\) \['question', 'answer'\] of the gsm8k"):
        convert("gsm8k", src, tmp_path / "o.jsonl")
