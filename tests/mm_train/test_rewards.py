"""GRPO's reward functions (mm_train.rewards): the built-in accuracy and format rewards, a user's
trl / open-r1-style function by "module:function", the weighted total with unscored completions,
and bad functions stopped with their name and the sample."""

import numpy as np
import pytest

from mm_train.rewards import Rewards, accuracy, format_reward

THINK = "<think>the shape is filled with one colour</think> <answer>{}</answer>"


@pytest.mark.parametrize("completion, solution, expected", [
    (THINK.format(" Red. "), "red", 1.0), (THINK.format("blue"), "red", 0.0), ("Red", "red", 1.0),
    (THINK.format("1,000"), "1000.0", 1.0), (THINK.format("3.140"), "3.14", 1.0), ("50%", "50", 1.0),
    (THINK.format("\\boxed{42}"), "42", 1.0), (THINK.format("41.9"), "42", 0.0), ("'dark  green'", "Dark Green", 1.0),
    ("<answer>red</answer> no, <answer>green</answer>", "green", 1.0), ("the answer is red", "red", 0.0),
])
def test_accuracy_compares_the_answer_normalised_and_numbers_as_numbers(completion, solution, expected):
    assert accuracy([completion], [solution]) == [expected]


def test_accuracy_does_not_score_a_sample_without_a_solution():
    assert accuracy(["red"], [None]) == [None]


def test_format_rewards_the_think_answer_layout_or_a_given_pattern():
    fmt = format_reward()
    assert fmt([THINK.format("red"), "red", "<think>a</think>", "<answer>red</answer><think>a</think>"]) == \
        [1.0, 0.0, 0.0, 0.0]
    assert format_reward(r"\w+")(["red", "red!"]) == [1.0, 0.0]


def test_a_user_function_runs_as_trl_calls_it_and_rewards_are_weighted(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(completions, solution, completion_ids, **kwargs):\n"
        "    return [None if s is None else float(len(ids)) for c, s, ids in\n"
        "            zip([c[0]['content'] for c in completions], solution, completion_ids)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = Rewards.from_recipe({"accuracy": 1.0, "format": 0.5, "my_rewards:length": 0.1})
    total, parts = rewards.score([[{"role": "user", "content": "?"}]] * 3, [THINK.format("red"), "blue", "red"],
                                 ["red", "red", None], [[5, 6, 7], [8], [9, 9]], ["a.json:0", "a.json:1", "a.json:2"])
    np.testing.assert_allclose(parts["accuracy"], [1.0, 0.0, np.nan])
    np.testing.assert_allclose(parts["format"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(parts["my_rewards:length"], [3.0, 1.0, np.nan])
    np.testing.assert_allclose(total, [1.0 + 0.5 + 0.3, 0.1, 0.0])


def test_a_completion_no_function_scores_has_no_reward():
    total, _ = Rewards.from_recipe({"accuracy": 1.0}).score([None], ["red"], [None], [[1]], ["s:0"])
    assert np.isnan(total[0])


@pytest.mark.parametrize("body, message", [
    ("    raise KeyError('solution')", "'bad:fn' raised KeyError.*a.json:0"),
    ("    return ['high'] * len(completions)", "'bad:fn' returned 'high' for a completion of a.json:0"),
    ("    return [float('nan')] * len(completions)", "returned nan"),
    ("    return [1.0]", "returned list of 1 values for 2 completions"),
    ("    return 1.0", "returned float"),
])
def test_a_bad_reward_function_is_named_with_the_sample(tmp_path, monkeypatch, body, message):
    module = f"bad_{abs(hash(body))}"  # a module of its own per case (imports are cached)
    (tmp_path / f"{module}.py").write_text("def fn(completions, **kwargs):\n" + body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=message.replace("bad:fn", f"{module}:fn")):
        Rewards.from_recipe({f"{module}:fn": 1.0}).score([None, None], ["a", "b"], [None, None], [[1], [2]],
                                                   ["a.json:0", "a.json:1"])


@pytest.mark.parametrize("weights, message", [({}, "names no reward"), ({"speed": 1.0}, "not a reward function"),
                                              ({"no_such_module:fn": 1.0}, "cannot load")])
def test_unknown_reward_functions_are_refused_with_what_to_change(weights, message):
    with pytest.raises(ValueError, match=message):
        Rewards.from_recipe(weights)
