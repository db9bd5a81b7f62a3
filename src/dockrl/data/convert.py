"""Converters from published math datasets to dockrl prompt files (`dockrl data gsm8k|math SRC OUT`).

    GSM8K      question, answer = "<reasoning> #### 72"            -> prompt, answer "72"
    MATH(-500) problem, answer (MATH-500) or solution "... \\boxed{\\frac{1}{2}} ..."  -> prompt, answer
               "\\frac{1}{2}" (the `answer` field when the row has one, else the last \\boxed{} of the
               solution)

SRC is a local .jsonl/.json or .parquet file in the published layout (nothing is downloaded). Each output row
is {"prompt": [system message, user message], "answer": bare final answer, "source_index": row number}; the
system message asks for the final answer in \\boxed{}, which both `exact_answer` and `math_verify` read
(`--system-prompt ''` writes the question as plain text instead). A row without an extractable answer is
skipped and counted; a malformed row is an error naming the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dockrl.data.datasets import JSON_SUFFIXES, PARQUET_SUFFIXES, DatasetError, iter_json_rows
from dockrl.rewards.builtin import last_boxed

DEFAULT_SYSTEM_PROMPT = "Reason step by step, then put the final answer in \\boxed{}."


def gsm8k_answer(row: dict) -> str | None:
    """The number after the last `####` of GSM8K's answer, without thousands separators; None without one."""
    answer = str(row["answer"])
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip().replace(",", "").rstrip(".")
    return final or None


def math_answer(row: dict) -> str | None:
    """MATH-500's `answer` field, else the last \\boxed{} of MATH's `solution`; None without either."""
    if row.get("answer") not in (None, ""):
        return str(row["answer"]).strip()
    boxed = last_boxed(str(row.get("solution") or ""))
    return boxed.strip() if boxed else None


# name -> (question field, answer extractor, fields the rows must have)
LAYOUTS: dict[str, tuple[str, Callable[[dict], str | None], tuple[str, ...]]] = {
    "gsm8k": ("question", gsm8k_answer, ("question", "answer")),
    "math": ("problem", math_answer, ("problem",)),
}


def convert(
    layout: str, src: str | Path, out: str | Path, *, system_prompt: str = DEFAULT_SYSTEM_PROMPT
) -> dict[str, Any]:
    """Convert `src` (the `layout` dataset) into the prompt file `out`; returns counts and paths."""
    if layout not in LAYOUTS:
        raise DatasetError(f"unknown dataset layout {layout!r}; known: {sorted(LAYOUTS)}")
    question_field, extract, required = LAYOUTS[layout]
    src, out = Path(src), Path(out)
    if out.suffix.lower() != ".jsonl":
        out = out / f"{src.stem}.jsonl"
    if out.resolve() == src.resolve():
        raise DatasetError(f"{out} is the source file itself; write the prompt file elsewhere")
    written = skipped = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for index, (where, row) in enumerate(_rows(src)):
            missing = [f for f in required if row.get(f) is None]
            if missing:
                raise DatasetError(
                    f"{src}: {where} lacks field(s) {missing} of the {layout} layout; fields present: "
                    f"{sorted(row)}"
                )
            answer = extract(row)
            if answer is None:
                skipped += 1
                continue
            question = str(row[question_field]).strip()
            prompt: Any = question
            if system_prompt:
                prompt = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
            handle.write(json.dumps({"prompt": prompt, "answer": answer, "source_index": index}) + "\n")
            written += 1
    if written == 0:
        raise DatasetError(f"{src}: no row of the {layout} layout had an extractable answer ({skipped} rows)")
    return {"out": str(out), "rows": written, "skipped_without_answer": skipped}


def _rows(src: Path) -> Iterator[tuple[str, dict]]:
    """("line N" or "row N", row) of a JSON lines, JSON array or Parquet file."""
    if not src.is_file():
        raise DatasetError(f"dataset file {str(src)!r} does not exist")
    suffix = src.suffix.lower()
    if suffix in JSON_SUFFIXES:
        yield from iter_json_rows(src)
    elif suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(src).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"row {number}", row
                number += 1
    else:
        raise DatasetError(
            f"dataset file {str(src)!r} has suffix {suffix!r}; supported: {JSON_SUFFIXES + PARQUET_SUFFIXES}"
        )
