import threading

import pytest

from appo_trl.rewards import REWARD_FUNCS, get_reward_func
from appo_trl.rewards.deep_research import compute_score, validate_format
from appo_trl.rewards.funcs import completion_text

GOOD = (
    "<think>plan</think><search>q</search><result>r</result><think>run</think>"
    "<python>print(1)</python><result>1</result><answer>The answer is \\boxed{Paris}</answer>"
)
NO_TOOLS = "<think>t</think><answer>\\boxed{Paris, France}</answer>"


def test_validate_format_cases():
    assert validate_format(GOOD) == (True, "ok")
    assert not validate_format("<answer>\\boxed{x}</answer>")[0]  # no think
    assert not validate_format("<think>a</think><think>b<answer>\\boxed{x}</answer>")[0]  # 2 open, 1 close
    assert not validate_format("<think>a</think><answer>\\boxed{x}</answer><answer>\\boxed{y}</answer>")[0]
    assert not validate_format("<think>a</think></answer>\\boxed{x}<answer>")[0]  # out of order
    assert not validate_format("<think>a</think><answer>Paris</answer>")[0]  # no boxed
    # search not followed by </search><result></result> in order
    assert not validate_format("<think>a</think><search>q</search><answer>\\boxed{x}</answer>")[0]
    assert not validate_format("<think>a</think><search>q<result>r</result></search><answer>\\boxed{x}</answer>")[0]
    assert not validate_format("<think>a</think><python>q</python><result>r<answer>\\boxed{x}</answer>")[0]


def test_compute_score():
    assert compute_score(GOOD, "Paris") == pytest.approx(1.1)  # F1 1 + 0.1 (both tools)
    # "paris france" vs "paris": P = 1/2, R = 1 -> F1 = 2/3, no tool bonus
    assert compute_score(NO_TOOLS, ["Paris"]) == pytest.approx(2 / 3)
    assert compute_score(NO_TOOLS, ["London"]) == 0.0
    assert compute_score("<think>t</think><answer>\\boxed{Paris</answer>", "Paris") == -1.0  # unbalanced brace
    # LaTeX answers under F1 (reference): 1/2 vs 0.5 scores 0; math_verify option for math rows scores 1
    latex = "<think>t</think><answer>\\boxed{\\frac{1}{2}}</answer>"
    assert compute_score(latex, "0.5") == 0.0
    assert compute_score(latex, "0.5", ability="math", math_verify_for_math=True) == 1.0
    assert compute_score(latex, "0.5", ability="qa", math_verify_for_math=True) == 0.0


def test_registry_functions_trl_signature():
    comps = [GOOD, NO_TOOLS, [{"role": "assistant", "content": NO_TOOLS}], "garbage"]
    golds = ["Paris", ["London", "Paris"], "Paris", "Paris"]
    r = get_reward_func("arpo_deep_research")(["p"] * 4, comps, answer=golds)
    assert r == pytest.approx([1.1, 2 / 3, 2 / 3, -1.0])
    assert get_reward_func("format")(["p"] * 4, comps) == [0.0, 0.0, 0.0, -1.0]
    assert get_reward_func("qa_em")(["p"] * 4, comps, ground_truth=golds) == [1.0, 0.0, 0.0, 0.0]
    assert get_reward_func("qa_f1")(["p"], ["<answer>\\boxed{the Paris}</answer>"], solution=["Paris"]) == [1.0]
    assert get_reward_func("qa_f1")(["p"], ["x"]) == [None]  # no gold -> None
    m = get_reward_func("math_verify")(["p"] * 2, ["<answer>\\boxed{1/2}</answer>", "\\boxed{3}"], answer=["0.5", "4"])
    assert m == [1.0, 0.0]
    mv = get_reward_func("arpo_deep_research_mathverify")(
        ["p"] * 2,
        ["<think>t</think><answer>\\boxed{0.5}</answer>"] * 2,
        answer=["\\frac{1}{2}"] * 2,
        ability=["math", "qa"],
    )
    assert mv == [1.0, 0.0]
    assert REWARD_FUNCS["format"].__name__ == "format"


def test_reward_from_worker_thread():
    out = []
    th = threading.Thread(
        target=lambda: out.extend(
            get_reward_func("arpo_deep_research_mathverify")(
                ["p"], ["<think>t</think><answer>\\boxed{\\frac{1}{2}}</answer>"], answer=["0.5"], ability=["math"]
            )
        )
    )
    th.start()
    th.join(30)
    assert out == [1.0]


def test_get_reward_func_errors_and_dotted():
    with pytest.raises(ValueError, match="qa_f1"):
        get_reward_func("qa_f2")
    assert get_reward_func("appo_trl.rewards.qa.f1_score").__name__ == "f1_score"
    assert get_reward_func("appo_trl.rewards.qa:exact_match").__name__ == "exact_match"
    with pytest.raises(ValueError):
        get_reward_func("appo_trl.rewards.qa.nope")


def test_completion_text():
    msgs = [
        {"role": "assistant", "content": "<search>q</search>"},
        {"role": "tool", "content": "<result>r</result>"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]
    assert completion_text(msgs) == "<search>q</search><result>r</result>done"
