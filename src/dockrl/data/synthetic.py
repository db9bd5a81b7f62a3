"""Synthetic verifiable tasks for tests and demos (a tiny model can learn them in minutes on CPU).

Each task is a function ``rows(n, *, seed, **task_kwargs) -> list[{"prompt": str, "answer": str}]`` in
``TASKS``; rows are distinct and deterministic for a seed, so ``write_task`` can split them into disjoint
train and test files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

ARITHMETIC_OPS = "+-*"


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with * binding tighter than + and -."""
    terms = [operands[0]]  # products, each added with its sign
    signs = [1]
    for op, operand in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= operand
        else:
            terms.append(operand)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))


def _format_operand(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def arithmetic_rows(
    n: int,
    *,
    seed: int = 0,
    min_operand: int = 0,
    max_operand: int = 99,
    ops: str = "+-",
    num_operands: int = 2,
) -> list[dict]:
    """``n`` distinct rows like ``{"prompt": "What is 12+34?", "answer": "46"}``, deterministic for a seed.

    Args:
        n: number of rows.
        seed: random seed; the same arguments give the same rows.
        min_operand, max_operand: inclusive operand range (negative operands are parenthesised).
        ops: the operators to draw from, a subset of "+-*" (usual precedence: * before + and -).
        num_operands: operands per expression (>= 2).

    Raises:
        ValueError: bad ranges or operators, or ``n`` larger than the number of distinct expressions.
    """
    unknown = sorted(set(ops) - set(ARITHMETIC_OPS))
    if not ops or unknown:
        raise ValueError(f"ops={ops!r}: use a non-empty subset of {ARITHMETIC_OPS!r}")
    if min_operand > max_operand:
        raise ValueError(f"min_operand={min_operand} > max_operand={max_operand}")
    if num_operands < 2:
        raise ValueError(f"num_operands={num_operands}: use 2 or more")
    operators = sorted(set(ops))
    num_distinct = (max_operand - min_operand + 1) ** num_operands * len(operators) ** (num_operands - 1)
    if n > num_distinct:
        raise ValueError(
            f"n={n} exceeds the {num_distinct} distinct expressions of this range; widen the operand range "
            "or add operands/operators"
        )
    rng = random.Random(seed)
    rows: dict[str, str] = {}
    while len(rows) < n:
        operands = [rng.randint(min_operand, max_operand) for _ in range(num_operands)]
        chosen = [rng.choice(operators) for _ in range(num_operands - 1)]
        expression = _format_operand(operands[0]) + "".join(
            op + _format_operand(x) for op, x in zip(chosen, operands[1:])
        )
        rows.setdefault(f"What is {expression}?", str(_evaluate(operands, chosen)))
    return [{"prompt": prompt, "answer": answer} for prompt, answer in rows.items()]


TASKS: dict[str, Callable[..., list[dict]]] = {"arithmetic": arithmetic_rows}


def hedging_teacher_rows(rows: list[dict], *, error: float, samples: int, seed: int = 0) -> list[dict]:
    """SFT rows written by a hedging teacher: `samples` answers per prompt, each of which, with
    probability `error`, follows the right answer with a second guess ("7 or 9"). Answer checkers read the
    final number, so a student that copies the habit is marked wrong even when its first answer is right.

    Several independent answers per prompt make the warm-started model learn the habit as a distribution
    (it stops after the answer some of the time), which RL against the true `answer` can then remove.
    This is the demo's noisy-teacher warm start.
    """
    if not 0 <= error <= 1 or samples < 1:
        raise ValueError(f"error={error} must be in [0, 1] and samples={samples} >= 1")
    rng = random.Random(seed)
    out = []
    for row in rows:
        for _ in range(samples):
            answer = row["answer"]
            if rng.random() < error:
                answer = f"{answer} or {int(answer) + rng.choice([-2, -1, 1, 2])}"
            out.append({"prompt": row["prompt"], "answer": answer})
    return out


def tool_call_text(expression: str) -> str:
    """A calculator call in the Qwen2.5 form (`envs.tool_calls`), as the tool teacher writes it."""
    arguments = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{arguments}</tool_call>"


def estimate(answer: int) -> str:
    """The answer rounded to two significant figures ("About 290000"): the tool teacher's habit when it
    does not call the calculator, wrong for the exact-answer check unless the product happens to be round."""
    digits = len(str(abs(answer)))
    return f"About {round(answer, 2 - digits) if digits > 2 else answer}"


def tool_teacher_rows(rows: list[dict], *, tool_rate: float, samples: int, seed: int = 0) -> list[dict]:
    """SFT conversations of a teacher that, `samples` times per prompt, calls the calculator with probability
    `tool_rate` (user question -> assistant tool call -> tool result -> assistant answer) and otherwise
    estimates ("About 290000", `estimate`). With `tool_rate` < 0.5 a student that learns both habits answers
    greedily with an estimate (its first token is "About" more often than "<tool_call>"), which the exact
    answer check marks wrong; RL against the true answer with the calculator environment then favours the
    tool, which held-out accuracy shows."""
    if not 0 <= tool_rate <= 1 or samples < 1:
        raise ValueError(f"tool_rate={tool_rate} must be in [0, 1] and samples={samples} >= 1")
    rng = random.Random(seed)
    out = []
    for row in rows:
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        for _ in range(samples):
            user = {"role": "user", "content": row["prompt"]}
            if rng.random() < tool_rate:
                messages = [
                    user,
                    {"role": "assistant", "content": tool_call_text(expression)},
                    {"role": "tool", "content": row["answer"]},
                    {"role": "assistant", "content": row["answer"]},
                ]
            else:
                messages = [user, {"role": "assistant", "content": estimate(int(row["answer"]))}]
            out.append({"messages": messages, "answer": row["answer"]})
    return out


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSON lines (UTF-8, parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_task(
    task: str,
    out_dir: str | Path,
    *,
    num_train: int,
    num_test: int,
    seed: int = 0,
    teacher_error: float | None = None,
    teacher_samples: int = 4,
    tool_rate: float | None = None,
    num_sft: int | None = None,
    num_tool_traces: int = 0,
    **task_kwargs,
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` of a synthetic task, with no prompt in both.

    Args:
        task: a name in ``TASKS``.
        out_dir: folder to write into (created).
        num_train, num_test: rows per split.
        seed: random seed of the task generator.
        teacher_error, teacher_samples: write ``sft.jsonl`` by the hedging teacher (`hedging_teacher_rows`).
        tool_rate, num_sft: write ``sft.jsonl`` by the tool teacher (`tool_teacher_rows`) for the first
            ``num_sft`` prompts (default: the training prompts; more than ``num_train`` draws further distinct
            prompts, never a test one).
        num_tool_traces: also write ``tools.jsonl``: one conversation that calls the calculator for each of
            this many further distinct prompts (after the SFT ones), for a model that must first learn to use
            a tool at all (the tool demo's first stage).
        task_kwargs: passed to the task (e.g. ``max_operand=20, ops="+-*"`` for "arithmetic").

    Returns:
        {"train": path, "test": path}.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; tasks: {sorted(TASKS)}")
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train={num_train} and num_test={num_test} must be >= 0")
    num_sft_rows = num_train if num_sft is None else num_sft
    num_fit = max(num_train, num_sft_rows + num_tool_traces)  # prompts the model may see (RL, SFT, traces)
    rows = TASKS[task](num_fit + num_test, seed=seed, **task_kwargs)  # distinct, so the split is disjoint
    out_dir = Path(out_dir)
    paths = {
        "train": write_jsonl(rows[:num_train], out_dir / "train.jsonl"),
        "test": write_jsonl(rows[num_fit:], out_dir / "test.jsonl"),
    }
    if teacher_error is not None:
        sft = hedging_teacher_rows(
            rows[:num_train], error=teacher_error, samples=teacher_samples, seed=seed + 1
        )
        paths["sft"] = write_jsonl(sft, out_dir / "sft.jsonl")
    if num_tool_traces:
        traces = tool_teacher_rows(
            rows[num_sft_rows : num_sft_rows + num_tool_traces], tool_rate=1.0, samples=1, seed=seed + 2
        )
        paths["tools"] = write_jsonl(traces, out_dir / "tools.jsonl")
    if tool_rate is not None:  # tool-use conversations for the first num_sft training prompts
        traces = tool_teacher_rows(
            rows[:num_sft_rows],
            tool_rate=tool_rate,
            samples=teacher_samples,
            seed=seed + 1,
        )
        paths["sft"] = write_jsonl(traces, out_dir / "sft.jsonl")
    return paths
