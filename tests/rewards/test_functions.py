"""Reward functions: the built-ins against hand-written cases, verl's signature, loading by name, results checked."""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest

from rewards.functions import (
    RewardError,
    Score,
    as_score,
    builtin_for,
    default_compute_score,
    exact_match_score,
    final_answer,
    last_boxed,
    load_reward_fn,
    math_score,
    parse_number,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so x = 3 and \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{ 2 }", "2"),  # the last box
        ("nested \\boxed{\\sqrt{4}}.", "\\sqrt{4}"),  # braces balanced
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),  # GSM8K's marker
        ("I think 5, no wait, it is 7.", "7"),  # the last number
        ("no answer here", None),
        ("unclosed \\boxed{12", "12"),  # an unclosed box is no box: the last number
    ],
)
def test_final_answer(text, answer) -> None:
    assert final_answer(text) == answer


def test_last_boxed_and_parse_number() -> None:
    assert last_boxed("\\fbox{3}") == "3" and last_boxed("none") is None
    cases = {
        "1,234": Fraction(1234),
        "-3.5": Fraction(-7, 2),
        "3/4": Fraction(3, 4),
        "\\frac{3}{4}": Fraction(3, 4),
        "-\\dfrac{1}{2}": Fraction(-1, 2),
        "$12": Fraction(12),
        "45\\%": Fraction(45),
        "7 apples": Fraction(7),
        ".5": Fraction(1, 2),
        "1.5e-3": Fraction(3, 2000),
        "-\\frac{-1}{2}": Fraction(1, 2),
        "\\frac{1}{-2}": Fraction(-1, 2),
        "\\frac12": Fraction(1, 2),
        "\u22123": Fraction(-3),  # the minus sign
        "$1,000.50": Fraction(2001, 2),
        "5 \\text{cm}": Fraction(5),
        "x = 5": Fraction(5),
        "3.14.": Fraction(157, 50),  # a sentence's full stop
    }
    for text, value in cases.items():
        assert parse_number(text) == value, text
    # Not one number: an expression, a list, separators in the wrong places. None, so never a false 1.0.
    for text in ("x", "1/0", "\\sqrt{2}", "2^{10}", "\\frac{1}{2}\\pi", "1,2,3", "1,23", "3 + 4"):
        assert parse_number(text) is None, text
    assert math_score("m", "\\boxed{\\sqrt{2}}", "2") == 0.0 and math_score("m", "\\boxed{2^{10}}", "2") == 0.0
    assert math_score("m", "so 0.6666667", "2/3") == 1.0  # within the relative tolerance


@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("The answer is \\boxed{72}", "72", 1.0),
        ("The answer is \\boxed{72}", 72, 1.0),  # a number as ground truth
        ("#### 1,000", "1000", 1.0),
        ("so 0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.3333333333}", "1/3", 1.0),  # 1e-10 relative: inside the default tolerance of 1e-6
        ("\\boxed{71}", "72", 0.0),
        ("I don't know", "72", 0.0),
        ("\\boxed{72} and then 5", "72", 1.0),  # the box wins over a later number
    ],
)
def test_math_score(response, truth, reward) -> None:
    assert math_score("gsm8k", response, truth) == reward


def test_the_tolerance_is_relative_and_can_be_set() -> None:
    assert math_score("gsm8k", "\\boxed{0.333}", "1/3") == 0.0  # 1e-3 relative: outside the default
    assert math_score("gsm8k", "\\boxed{0.333}", "1/3", {"rel_tol": 0.01}) == 1.0


def test_a_ground_truth_that_is_not_a_number_is_the_datasets_fault() -> None:
    with pytest.raises(RewardError, match="ground truth 'seven' is not a number"):
        math_score("gsm8k", "\\boxed{7}", "seven")
    with pytest.raises(RewardError, match="no ground truth"):
        math_score("gsm8k", "\\boxed{7}", None)
    with pytest.raises(RewardError, match="no ground truth"):
        exact_match_score("qa", "7", None)


def test_exact_match_and_the_choice_by_data_source() -> None:
    assert exact_match_score("qa", "  Paris ", "Paris") == 1.0
    assert exact_match_score("qa", "paris", "Paris") == 0.0
    assert exact_match_score("qa", "paris", "Paris", {"ignore_case": True}) == 1.0
    assert exact_match_score("qa", "Lyon", ["Paris", "Lyon"]) == 1.0
    assert exact_match_score("qa", "New  York", "New York") == 1.0  # inner whitespace runs collapse
    assert [builtin_for(s) for s in ("openai/gsm8k", "lighteval/MATH", "arithmetic", "trivia_qa")] == [
        "math",
        "math",
        "math",
        "exact_match",
    ]
    assert default_compute_score("openai/gsm8k", "#### 4", "4") == 1.0
    assert default_compute_score("trivia_qa", "4.0", "4") == 0.0  # exact match: the text differs


def test_load_by_module_by_file_and_by_builtin_name(tmp_path) -> None:
    assert load_reward_fn("math") is math_score and load_reward_fn("default") is default_compute_score
    assert load_reward_fn("rewards.functions:exact_match_score") is exact_match_score
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(len(solution_str) <= 5), 'length': len(solution_str)}\n"
        "def two_args(a, b):\n    return 0.0\n"
    )
    fn = load_reward_fn(f"{path}:compute_score")
    assert as_score(fn("src", "short", None), "record 1") == Score(1.0, {"length": 5.0})
    with pytest.raises(RewardError, match="cannot be called as compute_score"):
        load_reward_fn(f"{path}:two_args")
    with pytest.raises(RewardError, match="has no function 'missing'"):
        load_reward_fn(f"{path}:missing")
    with pytest.raises(RewardError, match="no file"):
        load_reward_fn(f"{tmp_path}/absent.py:f")
    with pytest.raises(RewardError, match="cannot import 'no_such_module_xyz'"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="expected module:function"):
        load_reward_fn("just_a_name")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="importing .* failed: RuntimeError: boom"):
        load_reward_fn(f"{broken}:f")


def test_results_that_are_not_rewards_are_named_never_a_silent_zero() -> None:
    assert as_score(1, "r") == Score(1.0) and as_score(True, "r") == Score(1.0)
    assert as_score({"score": 0.5, "acc": 1, "note": "x", "bad": math.nan}, "r") == Score(0.5, {"acc": 1.0})
    for result, words in [
        (None, "NoneType None, not a number"),
        ("1.0", "str '1.0'"),
        ({"reward": 1.0}, "without a 'score'"),
        ({"score": "high"}, "'score' is str"),
        (math.nan, "score nan is not a finite number"),
        ({"score": math.inf}, "score inf is not a finite number"),
    ]:
        with pytest.raises(RewardError, match=words):
            as_score(result, "train.jsonl line 3")


@pytest.mark.parametrize(
    "result, reason, words",
    [
        (
            1e300,
            "out_of_range",
            r"train.jsonl line 3: the reward function's score 1e\+300 is outside the accepted range \[-1000000.0, 1000000.0\]",
        ),
        (-1e300, "out_of_range", r"score -1e\+300 is outside the accepted range"),
        ({"score": 1e300, "acc": 1.0}, "out_of_range", r"score 1e\+300 is outside"),
        (1e6 + 1, "out_of_range", r"is outside the accepted range \[-1000000.0, 1000000.0\] \(max_abs_reward\)"),
        (10**400, "out_of_range", r"an integer of 1329 bits, outside the accepted range"),  # no float holds it
        (math.nan, "not_finite", "score nan is not a finite number"),
        (-math.inf, "not_finite", "score -inf is not a finite number"),
    ],
)
def test_a_score_out_of_range_is_refused_never_clipped(result, reason, words) -> None:
    with pytest.raises(RewardError, match=words) as refused:
        as_score(result, "train.jsonl line 3")
    assert refused.value.reason == reason


def test_the_bound_itself_is_a_reward_and_a_smaller_bound_is_held() -> None:
    assert as_score(1e6, "r") == Score(1e6) and as_score({"score": -1e6}, "r") == Score(-1e6)
    assert as_score(10, "r", max_abs=10) == Score(10.0)
    with pytest.raises(RewardError, match=r"score 10.5 is outside the accepted range \[-10, 10\]"):
        as_score(10.5, "r", max_abs=10)


def test_a_reward_file_named_like_a_loaded_module_is_named_as_shadowed(tmp_path, monkeypatch) -> None:
    """A user's rewards.py beside them is never imported as `rewards:...` (PPOZ's own package of that name is loaded):
    the error says so and how to name the file instead of calling PPOZ's module's function."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader puts the working directory on it
    (tmp_path / "rewards.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"rewards\.py is shadowed by the module 'rewards'.*rewards\.py:compute_score"):
        load_reward_fn("rewards:compute_score")
    assert load_reward_fn("rewards.py:compute_score")("s", "x", "y") == 1.0  # by its path, as the message says
    (tmp_path / "my_scores.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    assert load_reward_fn("my_scores:compute_score")("s", "x", "y") == 0.5  # a name of its own imports from here
