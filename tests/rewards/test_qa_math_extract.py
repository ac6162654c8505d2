import threading

import pytest

from appo_trl.rewards.extract import answer_block, extract_answer, last_boxed, strip_boxed
from appo_trl.rewards.math import math_equal
from appo_trl.rewards.qa import cover_exact_match, exact_match, f1_score, normalize_answer


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    assert normalize_answer("theory") == "theory"  # article removal is whole-word only


def test_exact_match_lists_and_articles():
    assert exact_match("the Beatles", "Beatles") == 1.0
    assert exact_match("Beatles!", ["Rolling Stones", "The Beatles"]) == 1.0
    assert exact_match("Beatle", ["Beatles"]) == 0.0


def test_f1_hand_computed():
    # pred "paris france" vs gold "paris": common 1, P = 1/2, R = 1/1 -> F1 = 2*0.5*1/1.5 = 2/3
    assert f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)
    # golds list: max(F1 vs "london" = 0, F1 vs "the city of paris" -> "city of paris": common 1, P=1/2, R=1/3
    # -> 2*(1/6)/(5/6) = 0.4)
    assert f1_score("Paris France", ["London", "the city of Paris"]) == pytest.approx(0.4)
    # repeated tokens use the multiset intersection: pred "a a b"->"b" ... use non-articles: "x x y" vs "x y y"
    # common = min(2,1) x + min(1,2) y = 2; P = 2/3, R = 2/3 -> F1 = 2/3
    assert f1_score("x x y", "x y y") == pytest.approx(2 / 3)


def test_f1_yes_no_mismatch_is_zero():
    assert f1_score("yes", "no") == 0.0
    assert f1_score("yes it is", "yes") == 0.0  # gold special, pred differs -> 0 (not 2/3)
    assert f1_score("Yes.", "yes") == 1.0
    assert f1_score("", "paris") == 0.0


def test_cover_exact_match():
    assert cover_exact_match("It was the Eiffel Tower in Paris", "eiffel tower") == 1.0
    assert cover_exact_match("Paris", ["Lyon", "Marseille"]) == 0.0
    assert cover_exact_match("anything", ["the"]) == 0.0  # empty normalised gold never covers


def test_last_boxed_nested_and_forms():
    assert last_boxed("x \\boxed{1} y \\boxed{\\frac{1}{2}}") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed("so \\boxed 42$ done") == "\\boxed 42"
    assert last_boxed("\\fbox{a{b}c}") == "\\fbox{a{b}c}"
    assert last_boxed("\\boxed{unclosed {") is None
    assert last_boxed("no box") is None
    assert strip_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert strip_boxed("\\boxed 42") == "42"
    assert strip_boxed("\\fbox{a{b}c}") == "a{b}c"
    assert strip_boxed(None) is None


def test_extract_answer_order():
    text = "<think>t</think><answer>first \\boxed{A}</answer><answer>\\boxed{B}</answer>"
    assert answer_block(text) == "first \\boxed{A}"
    assert extract_answer(text) == "A"  # first answer block wins
    assert extract_answer("<answer> plain </answer>") == "plain"
    assert extract_answer("no tags \\boxed{7}") == "7"
    assert extract_answer("nothing") is None


@pytest.mark.parametrize(
    "pred,gold,ok",
    [
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.5", True),
        ("<answer>\\boxed{\\frac{3}{4}}</answer>", "0.75", True),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", True),
        ("3", "4", False),
        ("", "4", False),
    ],
)
def test_math_equal(pred, gold, ok):
    assert math_equal(pred, gold) is ok


def test_math_equal_from_worker_thread():
    out = {}

    def work():
        out["eq"] = math_equal("1/2", "0.5")
        out["ne"] = math_equal("1/3", "0.5")

    th = threading.Thread(target=work)
    th.start()
    th.join(30)
    assert out == {"eq": True, "ne": False}


def test_math_equal_timeout_is_false(monkeypatch):
    import time

    import appo_trl.rewards.math as m

    monkeypatch.setattr(m, "_verify", lambda p, g: time.sleep(0.5) or True)
    assert m.math_equal("1", "1", timeout=0.05) is False
    assert m.math_equal("1", "1", timeout=5) is True
