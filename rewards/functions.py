"""Reward functions: verl's signature, PPOZ's built-ins, and loading a user's function by name.

A reward function scores one response:

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

the signature of verl's `custom_reward_function`, so a function written for verl runs here
unchanged. A dict result must hold a numeric "score" (the reward); its other numeric entries
are reported as metrics (verl does the same with `reward_extra_info`).

Built-ins, chosen by `data_source` when no function is named (`builtin_for`):
- `math`: the response's final answer (the last `\\boxed{...}`, else the text after the last
  `####`, else the last number in the text) equals the ground truth as a number, within a
  relative tolerance (integers, decimals, thousands separators, fractions `a/b`, `\\frac{a}{b}`,
  a trailing `%` or unit is left out); 1.0 or 0.0.
- `exact_match`: the response, stripped (and case-folded where asked), equals the ground truth; 1.0 or 0.0.
- `first_word` (by name only): the response's first word is the ground truth; 1.0 or 0.0.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from common.protocol import DEFAULT_MAX_ABS_REWARD, reward_problem

RewardFn = Callable[..., Any]

DEFAULT_RELATIVE_TOLERANCE = 1e-6
# data_source substrings that pick the math built-in (verl's GSM8K and MATH sources, PPOZ's arithmetic demo)
MATH_SOURCES = ("gsm8k", "math", "arithmetic", "aime", "amc", "numina")


class RewardError(ValueError):
    """A reward function that cannot be loaded, or a result that is not a reward: named, never a silent 0.

    `reason` is what CompositeReward counts the unrewarded response under (`rule_score/out_of_range`, ...)."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


def bound_reason(value: float) -> str:
    """The counter a value refused by reward_problem is counted under: not_finite or out_of_range."""
    return "out_of_range" if math.isfinite(value) else "not_finite"


@dataclass(frozen=True)
class Score:
    """One response's reward and the extra figures its function reported."""

    reward: float
    extra: dict[str, float] = field(default_factory=dict)


# --- the built-ins -------------------------------------------------------------------------------
# A number as written: digits with thousands separators done right (1,234,567) or none, a decimal
# part, an exponent. The last number of a response is found with _NUMBER_IN_TEXT; an answer must be
# one number (or fraction) as a whole (parse_number).
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?"
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+)")
_WHOLE = re.compile(rf"(-)?\(?(-?(?:{_NUM}))\)?(?:/\(?(-?(?:{_NUM}))\)?)?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")  # \frac12
_UNIT = re.compile(r"\s*(?:\\(?:text|mbox|mathrm)\{[^{}]*\}|[A-Za-z][A-Za-z ]*)$")  # "7 apples", "5 \text{cm}"


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed: no answer


def final_answer(text: str) -> str | None:
    """The answer a math response commits to: its last \\boxed{}, else what follows its last `####`
    (GSM8K's marker), else its last number; None when it has none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """The number an answer states, or None. The whole answer must be one number or fraction: `1,234`,
    `-3.5`, `1.5e-3`, `3/4`, `\\frac{3}{4}`, `-\\frac{-1}{2}`, `\\frac12`, `$12`, `45%`, `7 apples` (a trailing
    unit word is left out). An expression (`\\sqrt{2}`, `2^{10}`, `\\frac{1}{2}\\pi`, `1,2,3`) is no number."""
    t = text.strip().replace("\u2212", "-")  # the minus sign
    for mark in ("\\!", "\\,", "\\;", "\\ ", "$", "\\%", "%", "\\left", "\\right"):
        t = t.replace(mark, "")
    t = _FRAC.sub(lambda m: f"({m.group(1).strip()})/({m.group(2).strip()})", t)
    t = _FRAC_SHORT.sub(r"\1/\2", t)
    t = _UNIT.sub("", t.strip().rstrip(".").strip())
    t = re.sub(r"^[A-Za-z]\s*=\s*", "", t)  # "x = 5"
    match = _WHOLE.fullmatch(t.replace(" ", ""))
    if match is None:
        return None
    sign, numerator, denominator = match.groups()
    try:
        value = Fraction(numerator.replace(",", ""))
        if denominator is not None:
            value /= Fraction(denominator.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if sign else value


def numbers_equal(a: Fraction, b: Fraction, rel_tol: float = DEFAULT_RELATIVE_TOLERANCE) -> bool:
    return a == b or math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=0.0)


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the response's final answer equals the ground truth as a number, else 0.0.

    `extra_info["rel_tol"]` overrides the relative tolerance (1e-6). A ground truth that is not a
    number is a RewardError: the dataset is at fault, not the response."""
    if ground_truth is None:
        raise RewardError("math reward: the record has no ground truth")
    expected = parse_number(str(ground_truth))
    if expected is None:
        raise RewardError(f"math reward: the ground truth {str(ground_truth)[:80]!r} is not a number")
    rel_tol = float((extra_info or {}).get("rel_tol", DEFAULT_RELATIVE_TOLERANCE))
    answer = final_answer(solution_str)
    got = parse_number(answer) if answer is not None else None
    return 1.0 if got is not None and numbers_equal(got, expected, rel_tol) else 0.0


def exact_match_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the stripped response equals the stripped ground truth (case-folded with
    `extra_info["ignore_case"]`), else 0.0. A list of ground truths accepts any of them."""
    if ground_truth is None:
        raise RewardError("exact-match reward: the record has no ground truth")
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    fold = bool((extra_info or {}).get("ignore_case", False))

    def norm(s: Any) -> str:
        s = " ".join(str(s).split())
        return s.casefold() if fold else s

    return 1.0 if any(norm(solution_str) == norm(t) for t in truths) else 0.0


def first_word_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the response's first word is the ground truth (a one-word answer followed by anything), else 0.0."""
    if ground_truth is None:
        raise RewardError("first-word reward: the record has no ground truth")
    return 1.0 if solution_str.split()[:1] == [str(ground_truth).strip()] else 0.0


BUILTINS: dict[str, RewardFn] = {"math": math_score, "exact_match": exact_match_score, "first_word": first_word_score}


def builtin_for(data_source: str) -> str:
    """The built-in a record's `data_source` selects: math for math-like sources, exact match otherwise."""
    source = data_source.lower()
    return "math" if any(name in source for name in MATH_SOURCES) else "exact_match"


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """The reward when no function is named: the built-in `data_source` selects."""
    return float(BUILTINS[builtin_for(data_source)](data_source, solution_str, ground_truth, extra_info))


# --- a user's function ---------------------------------------------------------------------------
def load_reward_fn(spec: str) -> RewardFn:
    """`module:function` (importable, from the working directory too, as under `python -m`), `path/to/file.py:function`,
    or a built-in's name (`math`, `exact_match`, `default`). Errors name what was missing."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    if spec == "default":
        return default_compute_score
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardError(
            f"--reward-fn {spec!r}: expected module:function, path/to/file.py:function or one of {', '.join([*BUILTINS, 'default'])}"
        )
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise RewardError(f"--reward-fn {spec!r}: no file {path}")
        module_name = f"ppoz_reward_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise RewardError(f"--reward-fn {spec!r}: {path} cannot be imported")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"--reward-fn {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        working_directory = _importable_from_working_directory()
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            where = f"the working directory {working_directory} and the installed packages"
            raise RewardError(f"--reward-fn {spec!r}: cannot import {target!r} (looked in {where}): {e}") from e
        _check_not_shadowed(spec, target, module, working_directory)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"--reward-fn {spec!r}: {target} has no function {name!r}")
    _check_signature(spec, fn)
    return fn


def _importable_from_working_directory() -> str:
    """Put the working directory first on the import path, as `python -m` does and the `ppoz` console script does
    not (its script's folder is first there instead), so that `my_rewards:compute_score` finds the my_rewards.py
    beside the user; returns the directory."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def _check_not_shadowed(spec: str, target: str, module: Any, working_directory: str) -> None:
    """A file of the user's named as a module that is already loaded (one of PPOZ's own packages, `rewards` or
    `train`, or the standard library's) is never imported: say so rather than call the other module's function."""
    top = target.split(".")[0]
    mine = [
        p for p in (os.path.join(working_directory, f"{top}.py"), os.path.join(working_directory, top, "__init__.py")) if os.path.exists(p)
    ]
    found = os.path.abspath(getattr(module, "__file__", None) or "")
    if mine and not found.startswith(os.path.join(working_directory, "")):
        raise RewardError(
            f"--reward-fn {spec!r}: {mine[0]} is shadowed by the module {top!r} already loaded from {found or 'the interpreter'};"
            f" rename your file, or name it by its path: {os.path.relpath(mine[0])}:{spec.rpartition(':')[2]}"
        )


def _check_signature(spec: str, fn: RewardFn) -> None:
    """The function must take verl's four arguments (by these names or positionally)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: called as it is
    try:  # verl passes the four by keyword
        signature.bind(data_source="source", solution_str="solution", ground_truth="truth", extra_info=None)
    except TypeError as e:
        raise RewardError(
            f"--reward-fn {spec!r}: {getattr(fn, '__name__', fn)}{signature} cannot be called as "
            f"compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...): {e}"
        ) from e


def as_score(result: Any, where: str, max_abs: float = DEFAULT_MAX_ABS_REWARD) -> Score:
    """A reward function's result as a Score: a finite number within +-`max_abs`, or a dict with such a numeric
    "score" (its other finite numeric entries kept as figures). Anything else is a RewardError naming `where`
    and the value: a reward out of range is refused, never clipped (clipped, a bug's 1e300 would still be trained on)."""
    if not isinstance(result, (Mapping, str, bytes)) and hasattr(result, "item") and callable(result.item):
        result = result.item()  # a numpy or torch scalar
    if isinstance(result, bool):
        return Score(float(result))
    if isinstance(result, (int, float)):
        reward = _as_float(result, where, max_abs)
        extra: dict[str, float] = {}
    elif isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError(f"{where}: the reward function returned a dict without a 'score': keys {sorted(result)[:8]}")
        score = result["score"]
        if not isinstance(score, (str, bytes)) and hasattr(score, "item") and callable(score.item):
            score = score.item()
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise RewardError(f"{where}: the reward function's 'score' is {type(score).__name__} {score!r}, not a number")
        reward = _as_float(score, where, max_abs)
        extra = {
            str(k): float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
        }
    else:
        raise RewardError(f"{where}: the reward function returned {type(result).__name__} {result!r:.80}, not a number or a dict")
    problem = reward_problem(reward, max_abs)
    if problem:
        raise RewardError(f"{where}: the reward function's score {problem}", reason=bound_reason(reward))
    return Score(reward, extra)


def _as_float(value: int | float, where: str, max_abs: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int no float holds (Python's ints have no bound): out of any range
        raise RewardError(
            f"{where}: the reward function returned an integer of {int(value).bit_length()} bits, outside the accepted range"
            f" [-{max_abs!r}, {max_abs!r}] (max_abs_reward)",
            reason="out_of_range",
        ) from None


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
