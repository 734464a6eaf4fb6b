import pytest

from rlkit.errors import RlkitError
from rlkit.tasks import Arithmetic, get_task, last_integer


def test_last_integer_takes_the_final_number():
    assert last_integer("12", "12") == 1.0
    assert last_integer("3+4=7, so 5+7=12", "12") == 1.0  # chain of thought before the answer
    assert last_integer("12 or maybe 13", "12") == 0.0  # the last number decides
    assert last_integer("-5", "-5") == 1.0
    assert last_integer("no number", "12") == 0.0
    assert last_integer("", "12") == 0.0
    assert last_integer("#### 72", "The answer is #### 72") == 1.0


def test_examples_are_deterministic_in_seed():
    t = get_task("arithmetic")
    a, b, c = t.examples("train", 200, 1), t.examples("train", 200, 1), t.examples("train", 200, 2)
    assert a == b
    assert [e.prompt for e in a] != [e.prompt for e in c]


def test_train_and_heldout_never_overlap_across_seeds():
    t = get_task("arithmetic")
    held = {e.prompt for s in range(3) for e in t.examples("heldout", 300, s)}
    train = {e.prompt for s in range(3) for e in t.examples("train", 3000, s)}
    assert held and train and not (held & train)


def test_heldout_is_unique_and_answers_are_right():
    ex = get_task("arithmetic:terms=3-3,max=20").examples("heldout", 100, 0)
    assert len({e.prompt for e in ex}) == 100
    for e in ex:
        terms = e.prompt.strip("<>=").split("+")
        assert len(terms) == 3 and all(0 <= int(x) <= 20 for x in terms)
        assert int(e.answer) == sum(map(int, terms))
        assert e.prompt.startswith("<") and e.prompt.endswith(">=")


def test_spec_round_trips_and_bad_specs_fail():
    t = get_task("arithmetic:terms=2-5,max=20")
    assert isinstance(t, Arithmetic) and (t.min_terms, t.max_terms, t.max_operand) == (2, 5, 20)
    assert get_task(t.spec) == t
    for bad in ("nosuchtask", "arithmetic:colour=red", "arithmetic:terms", "arithmetic:terms=5-2"):
        with pytest.raises(RlkitError):
            get_task(bad)


def test_too_many_unique_prompts_is_a_clear_error():
    with pytest.raises(RlkitError, match="ran out of distinct heldout prompts"):
        get_task("arithmetic:terms=1-1,max=9").examples("heldout", 50, 0)
