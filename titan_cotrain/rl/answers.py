"""Final answers of math responses: where a response states one, and whether it is right.

* ``final_answer(text)``: the last ``\\boxed{...}`` (braces nested to any depth), else the
  last "the answer is X" / "answer: X" (case-insensitive; X runs to the end of its line or
  to a period followed by a space).
* ``math_equivalent(gold, answer)``: mathematical equality by ``math_verify`` (fractions,
  decimals, ``\\dfrac``, ``\\left(``, units in ``\\text{}``, sets, intervals, ...).
* ``integer_answer(text)``: the first number of ``text`` as an integer (commas and ``$``
  ignored), or None when there is none or it is not integral: GSM8K's answers.
"""

import re
import threading
from functools import lru_cache

__all__ = ["final_answer", "gsm8k_answer", "integer_answer", "last_boxed", "math_equivalent"]

_BOXED = "\\boxed{"
_STATED = re.compile(r"answer\s*(?:is\s*:?|:)\s*", re.IGNORECASE)
_HASHES = re.compile(r"####\s*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces close, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED): i - 1].strip()
        start = text.rfind(_BOXED, 0, start)  # unclosed (a truncated response): an earlier one
    return None


def _rest_of_statement(text: str, start: int) -> str | None:
    """``text`` from ``start`` to the end of its line or a period followed by a space, or None if empty."""
    line = text[start:].split("\n", 1)[0]
    answer = re.split(r"\.(?:\s|$)", line, maxsplit=1)[0].strip()
    return answer or None


def _stated(text: str) -> str | None:
    matches = list(_STATED.finditer(text))
    return _rest_of_statement(text, matches[-1].end()) if matches else None


def final_answer(text: str) -> tuple[str, str] | None:
    """``(answer, form)`` of ``text``: ``form`` is ``"boxed"`` or ``"stated"``; None when
    there is neither. A boxed answer wins over a stated one wherever they are."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    stated = _stated(text)
    return (stated, "stated") if stated is not None else None


def gsm8k_answer(text: str) -> tuple[str, str] | None:
    """As ``final_answer``, with GSM8K's ``#### X`` (the last one, form ``"####"``) first."""
    matches = list(_HASHES.finditer(text))
    if matches:
        answer = _rest_of_statement(text, matches[-1].end())
        if answer is not None:
            return answer, "####"
    return final_answer(text)


def integer_answer(text: str) -> int | None:
    """The first number in ``text`` (``1,234`` and ``$12`` read as 1234 and 12), if integral."""
    match = _NUMBER.search(text.replace(",", "").replace("$", ""))
    if match is None:
        return None
    value = float(match.group())
    return int(value) if value.is_integer() else None


def _timeout() -> int | None:
    """math_verify's timeouts use ``signal.alarm``, which only the main thread may set: off
    elsewhere (a reward computed in a worker thread then has no time limit)."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def _parsed(answer: str):
    """``answer`` parsed by math_verify: as written when it holds ``$...$`` LaTeX, else as the
    content of a ``\\boxed{}`` (so the whole of it is read as one expression)."""
    from math_verify import parse

    return parse(answer if "$" in answer else f"\\boxed{{{answer}}}", parsing_timeout=_timeout())


def math_equivalent(gold: str, answer: str) -> bool:
    """Whether ``answer`` equals the reference ``gold`` mathematically. Never raises: an
    answer math_verify cannot parse, a timeout or any error in it counts as wrong."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed, answer_parsed = _parsed(gold), _parsed(answer)
        return bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=_timeout()))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False
