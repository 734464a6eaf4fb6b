"""LLM judges' pure parts (`rlkit.rubrics`, `rlkit.scorers.judge`): rubric files and their one-line refusals, the
rubric kinds' registry, the verdict math (the pair softmax, both orders of a pairwise question, a score parsed from
an answer) and the judge task's examples."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlkit.errors import RlkitError
from rlkit.scorers.judge import first_choice_prob, load_rubric, parse_judges, prefer
from rlkit.tasks import get_task

YES_NO = 'kind = "yes-no"\ntemplate = "{prompt}{response} ok? "\nchoices = ["Y", "N"]\n'
PAIRWISE = 'kind = "pairwise"\ntemplate = "{prompt} A:{response_a} B:{response_b} right? "\nchoices = ["A", "B"]\n'
SCORE = 'kind = "score"\ntemplate = "Q: {prompt}\\nA: {response}\\nScore 1-10: "\npattern = "(\\\\d+)"\nlow = 1\nhigh = 10\n'


def _rubric(tmp_path, text, name="r.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_rubrics_load_render_and_hash(tmp_path):
    r = load_rubric(_rubric(tmp_path, YES_NO))
    assert (r.kind, r.choices) == ("yes-no", ("Y", "N")) and r.sha256.startswith("sha256:")
    assert r.render(prompt="<1+2>=", response="3") == "<1+2>=3 ok? "
    p = load_rubric(_rubric(tmp_path, PAIRWISE, "p.toml"))
    assert p.render(prompt="q", response_a="1", response_b="2") == "q A:1 B:2 right? "
    s = load_rubric(_rubric(tmp_path, SCORE, "s.toml"))
    assert s.parse_score("Score: 10.") == (1.0, "parsed") and s.parse_score("7") == (pytest.approx(2 / 3), "parsed")
    assert s.parse_score("no idea") == (0.0, "unparseable") and s.parse_score("42") == (0.0, "out_of_range")
    assert load_rubric(_rubric(tmp_path, YES_NO + "# a comment\n", "c.toml")).sha256 != r.sha256


@pytest.mark.parametrize(("text", "says"), [
    ("kind = 'yes-no'\ntemplate = '{prompt}'\nchoices = ['Y', 'N']\n", "missing {response}"),
    ("kind = 'yes-no'\ntemplate = '{prompt}{response}{other}'\nchoices = ['Y', 'N']\n", "not {other}"),
    ("kind = 'maybe'\ntemplate = 'x'\n", "kind 'maybe' is not one of yes-no, pairwise, score"),
    ("kind = 'yes-no'\ntemplate = '{prompt}{response}'\nchoices = ['Y', 'Y']\n", "two distinct non-empty strings"),
    ("kind = 'yes-no'\ntemplate = '{prompt}{response}'\nchoices = ['Y']\n", "two distinct non-empty strings"),
    ("kind = 'score'\ntemplate = '{prompt}{response}'\npattern = 'Score'\n", "'pattern' `Score` has no group; its first "
                                                                             "group (in parentheses) is the score"),
    ("kind = 'score'\ntemplate = '{prompt}{response}'\npattern = '(\\d+'\n", "'pattern' `(\\d+` is not a regular "
                                                                            "expression (missing ), unterminated "
                                                                            "subpattern at position 0)"),
    ("kind = 'score'\ntemplate = '{prompt}{response}'\npattern = '(\\d)'\nlow = 5\nhigh = 1\n", "low < high"),
    ("kind = 'yes-no'\ntemplate = '{prompt}{response}'\nchoices = ['Y', 'N']\ncolour = 1\n", "unknown key 'colour'"),
    ("kind = 'yes-no\n", "not a valid TOML rubric"),
    ("kind = 'yes-no'\ntemplate = '{prompt}{response'\nchoices = ['Y', 'N']\n", "does not parse"),
])
def test_a_bad_rubric_is_one_line(tmp_path, text, says):
    with pytest.raises(RlkitError, match=None) as e:
        load_rubric(_rubric(tmp_path, text))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_missing_rubric_or_one_of_another_kind(tmp_path):
    with pytest.raises(RlkitError, match="no such rubric file"):
        load_rubric(tmp_path / "absent.toml")
    with pytest.raises(RlkitError, match="is a yes-no rubric; this takes pairwise"):
        load_rubric(_rubric(tmp_path, YES_NO), ("pairwise",))


def test_one_judge_spec_for_every_stage():
    """score-ref and build-prefs read --judge [NAME=]DIR[:rubric=FILE][,engine=...] and --rubric FILE alike: the
    rubric is rubric= when given, else --rubric, else DIR/rubric.toml; NAME is DIR's folder unless given."""
    one = [(s.name, s.path, s.rubric, s.engine) for s in parse_judges(["j=runs/judge:rubric=yn.toml"])]
    assert one == [("j", Path("runs/judge"), Path("yn.toml"), "hf")]
    other = [(s.name, s.path, s.rubric, s.engine) for s in parse_judges(["runs/judge"], Path("yn.toml"))]
    assert other == [("judge", Path("runs/judge"), Path("yn.toml"), "hf")]  # build-prefs' --judge DIR --rubric FILE
    assert parse_judges(["runs/judge"])[0].rubric == Path("runs/judge/rubric.toml")
    s = parse_judges(["runs/lr=1e-5/judge:rubric=s.toml,engine=vllm"])[0]  # a `/` before `=`: all of it is DIR
    assert (s.name, s.path, s.rubric, s.engine) == ("judge", Path("runs/lr=1e-5/judge"), Path("s.toml"), "vllm")
    # --rubric is the rubric of each judge that names none
    assert [x.rubric for x in parse_judges(["a=d1", "b=d2:rubric=own.toml"], Path("r.toml"))] == [
        Path("r.toml"), Path("own.toml")]
    for specs, rubric, says in (([], Path("r.toml"), "--rubric is --judge's"),
                                (["j=d:rubric=own.toml"], Path("r.toml"), "every --judge here names its own"),
                                (["j=d:colour=red"], None, "unknown option 'colour=red'"),
                                (["=d"], None, "expected [NAME=]DIR[:rubric=FILE][,engine=hf|vllm]"),
                                (["j=d", "j=e"], None, "which another reward component has"),
                                (["verifier=d"], None, "which another reward component has"),
                                (["rm=d"], None, "which another reward component has")):
        with pytest.raises(RlkitError) as e:
            parse_judges(specs, rubric, taken=["rm"])
        assert says in str(e.value) and "\n" not in str(e.value), (specs, str(e.value))


def test_a_judge_without_a_rubric_names_the_default_and_the_flags(tmp_path):
    (spec,) = parse_judges([str(tmp_path / "judge")])
    with pytest.raises(RlkitError) as e:
        spec.load(("pairwise",))
    assert str(e.value) == (f"--judge judge: no such rubric file {tmp_path / 'judge' / 'rubric.toml'} (a judge's "
                            "rubric defaults to DIR/rubric.toml); pass one with --rubric FILE or --judge "
                            "DIR:rubric=FILE (docs/tasks-rewards.md#naming-a-judge)")


def test_a_rubric_kind_is_one_registry_entry(tmp_path, monkeypatch):
    """A toy kind added to `rlkit.rubrics.KINDS` alone: rubric files of it load with its placeholders and choices,
    the stages it names take it (and the others refuse it in one line), and its verdict reads a judged value."""
    from rlkit import rubrics

    assert rubrics.taken_by("score-ref") == ("yes-no", "score") and rubrics.taken_by("build-prefs") == ("pairwise",)
    assert rubrics.taken_by("task judge") == ("yes-no", "pairwise")
    toy = rubrics.RubricKind(frozenset({"response"}), ("score-ref",), "[pass, fail]",
                             lambda r, p: (1.0 if p > 0.9 else 0.0, "pass" if p > 0.9 else "fail"))
    monkeypatch.setitem(rubrics.KINDS, "pass-fail", toy)
    r = load_rubric(_rubric(tmp_path, 'kind = "pass-fail"\ntemplate = "{response}?"\nchoices = ["P", "F"]\n'),
                    rubrics.taken_by("score-ref"))
    assert (r.kind, r.choices, r.render(prompt="q", response="7")) == ("pass-fail", ("P", "F"), "7?")
    assert r.spec.verdict(r, 0.95) == (1.0, "pass") and r.spec.verdict(r, 0.5) == (0.0, "fail")
    with pytest.raises(RlkitError, match="is a pass-fail rubric; this takes pairwise"):
        load_rubric(r.path, rubrics.taken_by("build-prefs"))
    with pytest.raises(RlkitError, match=r"two distinct non-empty strings \[pass, fail\]"):
        load_rubric(_rubric(tmp_path, 'kind = "pass-fail"\ntemplate = "{response}"\nchoices = ["P"]\n', "b.toml"))


def test_the_pair_softmax_by_hand():
    la, lb = torch.tensor([2.0, -1.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    want = [math.exp(a) / (math.exp(a) + math.exp(b)) for a, b in zip(la.tolist(), lb.tolist(), strict=True)]
    assert first_choice_prob(la, lb).tolist() == pytest.approx(want)


def test_both_orders_cancel_position_bias():
    assert prefer(0.9, 0.2) == 0 and prefer(0.3, 0.8) == 1
    assert prefer(0.9, 0.9) is None  # always the first shown: a tie, whichever response it is
    assert prefer(0.1, 0.1) is None and prefer(0.5, 0.5) is None


def test_the_judge_task_makes_judgments_of_arithmetic(tmp_path):
    yn, pw = _rubric(tmp_path, YES_NO, "yn.toml"), _rubric(tmp_path, PAIRWISE, "pw.toml")
    task = get_task(f"judge:task=arithmetic,rubric={pw}|{yn}")
    ex = task.examples("train", 200, 0)
    base = {e.prompt: int(e.answer) for e in get_task("arithmetic").examples("train", 200, 0)}
    kinds = {"A": 0, "B": 0, "Y": 0, "N": 0}
    for i, e in enumerate(ex):
        kinds[e.answer] += 1
        problem = e.prompt.split(" ")[0] if i % 2 == 0 else e.prompt[: e.prompt.index("=") + 1]
        gold = base[problem]
        if i % 2 == 0:  # pairwise: the named response is the gold one
            a, b = e.prompt.split(" A:")[1].split(" right?")[0].split(" B:")
            assert int(a if e.answer == "A" else b) == gold and int(b if e.answer == "A" else a) != gold
        else:  # yes-no: Y exactly when the proposed answer is the gold one
            proposed = int(e.prompt[len(problem):].split(" ok?")[0])
            assert (e.answer == "Y") == (proposed == gold)
        assert task.reward(task.completion(e), e.answer) == 1.0
    assert all(v > 20 for v in kinds.values())  # both rubrics, both verdicts
    held = task.examples("heldout", 50, 0)
    assert not {e.prompt for e in held} & {e.prompt for e in ex}
    assert task.reward("N", "Y") == 0.0 and get_task(task.spec).spec == task.spec
    with pytest.raises(RlkitError, match="needs rubric=FILE"):
        get_task("judge:task=arithmetic")
    with pytest.raises(RlkitError, match="takes yes-no or pairwise"):
        get_task(f"judge:rubric={_rubric(tmp_path, SCORE, 's.toml')}")
