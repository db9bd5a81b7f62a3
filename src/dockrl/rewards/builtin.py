"""Built-in verifiers: exact numeric answer, math-verify equivalence, regex format.

All are pure Python (math-verify pulls in sympy, imported on first use), return ``RewardResult`` with
score 1.0 or 0.0, and are safe to call from any thread. Those marked ``cheap`` (exact_answer, format) take
microseconds and cannot hang on any response (a linear scan, a fixed regex without nested quantifiers), so the
RewardRunner calls them in its own thread (reward.inline=cheap) rather than through its process pool;
math_verify (sympy, seconds on adversarial input) stays in the pool.
"""

from __future__ import annotations

import functools
import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Any

from dockrl.rewards.result import RewardResult

# A plain decimal number: optional sign, optional thousands commas ("1,234"), optional fraction.
_NUMBER = r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
# In free text a minus glued to a preceding digit is subtraction ("5-3"), not a sign.
_NUMBER_IN_TEXT = re.compile(r"(?<![\d.])" + _NUMBER)
_NUMBER_EXACT = re.compile(_NUMBER)
_BOXED = "\\boxed{"
_WORD = re.compile(r"[^\W_]+")  # letters and digits: the final word of "The shape is red."


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    begin = start + len(_BOXED)
    for pos in range(begin, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:pos]
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(response: str, *, word: bool = False) -> str | None:
    """The answer a response gives: the last ``\\boxed{}`` content, else the last number (with `word`: the
    last word of letters and digits), else None."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip().strip("$").strip()
    found = (_WORD if word else _NUMBER_IN_TEXT).findall(response)
    return found[-1] if found else None


def _as_number(text: str) -> Decimal | None:
    text = text.strip()
    if not _NUMBER_EXACT.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def exact_answer(prompt: str, response: str, label: Any) -> RewardResult:
    """1.0 when the response's answer equals ``label``, else 0.0 (for the synthetic tasks).

    The answer is the last ``\\boxed{...}`` content if there is one, otherwise the last number in the
    response, or for a label that is not a number ("red", "left") its last word. It is compared with
    ``str(label)`` numerically when both parse as decimal numbers ("4.50" == "4.5", "1,000" == "1000"),
    otherwise as strings after stripping whitespace.
    """
    expected = str(label).strip()
    answer = extract_answer(response, word=_as_number(expected) is None)
    correct = False
    if answer is not None:
        answer_num, expected_num = _as_number(answer), _as_number(expected)
        if answer_num is not None and expected_num is not None:
            correct = answer_num == expected_num
        else:
            correct = answer.strip() == expected
    score = 1.0 if correct else 0.0
    return RewardResult(score=score, components={"correct": score})


def math_verify_reward(prompt: str, response: str, label: Any) -> RewardResult:
    """1.0 when math-verify finds the response's final answer equivalent to ``label``, else 0.0.

    A label without ``$`` or ``\\boxed`` is wrapped in ``$...$`` so math-verify parses it as LaTeX.

    math-verify 0.9 bounds ``parse`` (``parsing_timeout``) and ``verify`` (``timeout_seconds``) with
    ``signal.alarm``, which raises ValueError outside the main thread. On the main thread (the
    RewardRunner's worker processes, a plain script) its own 5 s timeouts stay on; on any other thread
    (a threaded Ray actor, a thread pool) they are turned off (None) and bounding the time is the
    caller's job: RewardRunner kills calls that exceed its timeout.
    """
    from math_verify import parse, verify

    on_main_thread = threading.current_thread() is threading.main_thread()
    parse_timeout = 5 if on_main_thread else None
    verify_timeout = 5 if on_main_thread else None
    gold_text = str(label).strip()
    if "$" not in gold_text and "\\boxed" not in gold_text:
        # math-verify reads a bare gold like "x^2+1" or "\\sqrt{2}" as plain text; as LaTeX it parses.
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=parse_timeout)
    answer = parse(response, parsing_timeout=parse_timeout)
    correct = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=verify_timeout)
    score = 1.0 if correct else 0.0
    return RewardResult(score=score, components={"correct": score})


def _warm_math_verify() -> None:
    # First use imports sympy and builds the LaTeX grammar (~1 s); done at worker start-up, not in a call.
    math_verify_reward("", "$1$", "1")


math_verify_reward.warmup = _warm_math_verify  # type: ignore[attr-defined]  # see base.py: warmup


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def format_reward(
    prompt: str, response: str, label: Any, *, pattern: str = r"^\s*-?\d+(\.\d+)?\s*$"
) -> RewardResult:
    r"""1.0 when the whole response matches ``pattern`` (``re.fullmatch``, DOTALL), else 0.0.

    The default accepts a bare number; set ``pattern`` through the reward spec's kwargs, e.g.
    ``r".*\\boxed\{.+\}.*"`` to require a boxed answer anywhere.
    """
    score = 1.0 if _compiled(pattern).fullmatch(response) else 0.0
    return RewardResult(score=score)


exact_answer.cheap = True  # type: ignore[attr-defined]  # see rewards/base.py: cheap
format_reward.cheap = True  # type: ignore[attr-defined]  # with its own pattern only (base.is_cheap)

BUILTIN_REWARDS = {
    "exact_answer": exact_answer,
    "math_verify": math_verify_reward,
    "format": format_reward,
}
