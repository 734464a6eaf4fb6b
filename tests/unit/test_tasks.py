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


def test_too_many_unique_prompts_is_a_clear_error_and_a_smaller_heldout_split_is_whole():
    t = get_task("arithmetic:terms=1-1,max=9,heldout=0.5")
    with pytest.raises(RlkitError, match="ran out of distinct train prompts"):
        t.examples("train", 50, 0, unique=True)
    held = t.examples("heldout", 50, 0)  # asked for more than the split holds: all of it
    assert 0 < len(held) < 10 and len({e.prompt for e in held}) == len(held)


def test_each_task_carries_its_generation_length_and_a_flag_wins(tmp_path):
    from rlkit.tasks import DEFAULT_MAX_NEW_TOKENS, generation_length

    # arithmetic keeps 16 (the recipes that rely on the default compute what they did); math and code the
    # lengths their recipes pass (96, 40) on the shipped data, longer on the user's data
    for spec, want in (("arithmetic", 16), ("arithmetic:terms=2-5,prose=0.5", 16), ("math", 96),
                       ("math:data=gsm8k.jsonl", 256), ("code", 40), ("code:data=sample", 512)):
        assert generation_length(get_task(spec), None) == want, spec
        assert generation_length(get_task(spec), 7) == 7  # --max-new-tokens, when given, wins
    (tmp_path / "mine.py").write_text('''
from rlkit.tasks import Example

class Plain:
    def iter_examples(self, split, seed):
        yield Example(f"{split}-0", "q", "a", split)

    def reward(self, response, answer):
        return 1.0

class Long(Plain):
    max_new_tokens = 300

class Bad(Plain):
    def __init__(self, n: str = "0"):
        self.max_new_tokens = {"0": 0, "str": "300", "bool": True, "float": 2.5}[n]
''')
    assert generation_length(get_task(f"{tmp_path}/mine.py:Plain"), None) == DEFAULT_MAX_NEW_TOKENS == 16
    assert generation_length(get_task(f"{tmp_path}/mine.py:Long"), None) == 300
    for n in ("0", "str", "bool", "float"):
        with pytest.raises(RlkitError, match=r"max_new_tokens is .*expected an integer >= 1") as e:
            get_task(f"{tmp_path}/mine.py:Bad:n={n}")
        assert "\n" not in str(e.value)


def test_a_response_cut_at_max_new_tokens_has_the_verdict_truncated_and_keeps_its_reward(tmp_path):
    from rlkit.tasks import Scores, truncation_warning, verify

    (tmp_path / "judged.py").write_text('''
from rlkit.tasks import Example, Scores

class Judged:
    def iter_examples(self, split, seed):
        yield Example(f"{split}-0", "q", "a", split)

    def reward(self, response, answer):
        raise AssertionError("score_batch is used")

    def score_batch(self, responses, answers, sandbox):
        return Scores([1.0 if r == a else 0.25 for r, a in zip(responses, answers)],
                      ["passed" if r == a else "wrong_answer" for r, a in zip(responses, answers)])
''')
    t = get_task(f"{tmp_path}/judged.py:Judged")
    responses, answers = ["a", "b", "b", "a"], ["a"] * 4
    plain = verify(t, responses, answers)
    assert plain == Scores([1.0, 0.25, 0.25, 1.0], ["passed", "wrong_answer", "wrong_answer", "passed"])
    # cut rows: `truncated` in place of the verifier's reason, unless they passed; the rewards do not change
    cut = verify(t, responses, answers, finish_reasons=["eos", "length", "eos", "length"])
    assert cut == Scores([1.0, 0.25, 0.25, 1.0], ["passed", "truncated", "wrong_answer", "passed"])
    # a verifier without reasons gives no verdicts, cut or not
    assert verify(get_task("arithmetic"), ["1", "2"], ["1", "1"], finish_reasons=["length", "eos"]) == Scores([1.0, 0.0])
    # the warning: more than half cut names the flag, the value in force and the task's own length
    line = truncation_warning("eval", 3, 4, 16, get_task("code"))
    assert line == ("eval: 3 of 4 responses (75%) hit --max-new-tokens 16 (or the model's context) before they "
                    "ended, so their rewards score cut-off text; task code's own length is 40; raise --max-new-tokens")
    assert truncation_warning("eval", 2, 4, 16, get_task("code")) is None and truncation_warning("eval", 0, 0, 16) is None


@pytest.mark.parametrize("spec,line", [
    ("arithmetic:max=x", "--task arithmetic: max='x' is not a number"),
    ("arithmetic:terms=2-x", "--task arithmetic: terms='2-x' is not a number"),
    ("arithmetic:heldout=half", "--task arithmetic: heldout='half' is not a number"),
])
def test_an_option_that_is_not_a_number_is_one_line(spec, line):
    with pytest.raises(RlkitError) as e:
        get_task(spec)
    assert str(e.value) == line


TOY = '''
import random
from dataclasses import dataclass

from rlkit.tasks import TaskBase, check


@dataclass(frozen=True)
class Toy(TaskBase):
    name = "toy"

    top: int = 50
    heldout_fraction: float = 0.2
    OPTIONS = {"top": ("top", int, "N"), "heldout": ("heldout_fraction", float, "F")}

    def checked(self):
        check("--task toy", (self.top >= 2, f"top={self.top}", "top >= 2"))
        return self

    @property
    def spec(self):
        return f"toy:top={self.top},heldout={self.heldout_fraction}"

    def problem(self, rng):
        x = rng.randint(1, self.top)
        return f"double {x}:", str(2 * x)

    def problem_space(self):
        return self.top

    def completion(self, ex):
        return ex.answer

    def reward(self, response, answer):
        return float(response.strip() == answer)
'''


def test_a_builtin_task_is_a_taskbase_class_and_one_registry_line(tmp_path, monkeypatch):
    """A new built-in is a file (its problems and reward; TaskBase brings examples, the split and the options) and
    one line of the registry."""
    from rlkit.tasks import TASKS

    (tmp_path / "toytask.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(TASKS, "toy", "toytask:Toy")
    t = get_task("toy:top=40")
    assert t.spec == "toy:top=40,heldout=0.2" and get_task(t.spec) == t and t.name == "toy"
    train, held = t.examples("train", 300, 1), t.examples("heldout", 5, 1)
    assert train == t.examples("train", 300, 1) and [e.prompt_id for e in held] == [f"heldout-1-{i}" for i in range(5)]
    assert len({e.prompt for e in held}) == 5 and not {e.prompt for e in held} & {e.prompt for e in train}
    assert all(t.reward(t.completion(e), e.answer) == 1.0 and int(e.answer) == 2 * int(e.prompt[7:-1]) for e in train)
    for spec, line in (("toy:top=x", "--task toy: top='x' is not a number"), ("toy:top=1", "--task toy: top=1: expected top >= 2"),
                       ("toy:size=3", "unknown option 'size' for task toy; expected top=N, heldout=F")):
        with pytest.raises(RlkitError) as e:
            get_task(spec)
        assert str(e.value) == line
    with pytest.raises(RlkitError, match=r"ran out of distinct train prompts after \d+ \(problem space 40\); ask for fewer or widen the task"):
        t.examples("train", 40, 0, unique=True)
