"""The `math` task: answers in GSM8K's and MATH's formats, the math-verify verifier (equivalent forms,
garbage, pathological input, threads), the shipped sample, column mapping and the train/held-out split.
The recipe runs end to end in tests/e2e/test_recipes.py (recipes/math.sh)."""

import json
import threading
import time

import pytest

from rlkit.errors import RlkitError
from rlkit.io import fingerprints, streams
from rlkit.tasks import get_task, task_inputs
from rlkit.tasks.math import (
    SAMPLE,
    Math,
    extract_answer,
    last_integer_reward,
    math_verify_reward,
    solution_text,
)

from conftest import run_cli


def test_gold_answers_in_every_common_format():
    assert extract_answer("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_answer("so #### 1,234,567") == "1234567"  # thousands separators dropped
    assert extract_answer("Thus $\\boxed{\\frac{3}{4}}$.") == "\\frac{3}{4}"  # nested braces kept whole
    assert extract_answer("first \\boxed{1}, then \\boxed{\\sqrt{2}}") == "\\sqrt{2}"  # the last one
    assert extract_answer("  42 ") == "42"
    assert extract_answer("\\boxed{unbalanced") == "\\boxed{unbalanced"  # no answer inside: the text itself
    assert solution_text("48/2 = <<48/2=24>>24 clips.\n#### 72") == "48/2 = 24 clips.\n#### 72"


@pytest.mark.parametrize(("response", "gold", "want"), [
    ("Natalia sold 48/2 = 24 clips in May, 48+24 = 72 in all.\n#### 72", "...\n#### 72", 1.0),
    ("#### 72", "72", 1.0),
    ("The answer is 0.75", "\\frac{3}{4}", 1.0),
    ("#### 3/4", "The answer is $\\boxed{\\frac{3}{4}}$.", 1.0),
    ("so the side is $\\boxed{\\sqrt{2}}$", "\\sqrt{2}", 1.0),
    ("#### \\sqrt{50}", "5\\sqrt{2}", 1.0),  # an equivalent form
    ("#### 1,000", "1000", 1.0),
    ("24 in May, so the answer is 71", "72", 0.0),
    ("#### 72.5", "72", 0.0),
    ("\\boxed{9\\pi}", "9\\pi", 1.0),
])
def test_math_verify_accepts_equivalent_forms_only(response, gold, want):
    assert math_verify_reward(response, gold) == want


def test_math_verify_gives_garbage_zero_and_never_raises_or_hangs():
    garbage = ["", "}}}{{", "\\boxed{", "\\frac{", "$$$$", "\\\\", "#### ", "x" * 100_000, "\x00\ufffd",
               "\\boxed{" + "(" * 400 + "1" + ")" * 400 + "}", "$9^{9^{9^{9}}}$", "#### 10^{10^{10^{10}}}!"]
    t0 = time.monotonic()
    assert [math_verify_reward(g, "72") for g in garbage] == [0.0] * len(garbage)
    assert math_verify_reward("72", "") == 0.0 and math_verify_reward("72", "\\boxed{") == 0.0
    assert time.monotonic() - t0 < 30  # math-verify's timeout (1 s per parse and comparison) bounds each


def test_math_verify_off_the_main_thread():
    """math-verify's timeout is a SIGALRM, which only the main thread may set: elsewhere it runs without."""
    got = []
    t = threading.Thread(target=lambda: got.extend([math_verify_reward("#### 3/4", "\\frac{3}{4}"),
                                                    math_verify_reward("garbage", "1")]))
    t.start()
    t.join(60)
    assert got == [1.0, 0.0]


def test_last_integer_is_the_cheap_alternative():
    assert last_integer_reward("48+24 = 72 clips\n#### 72", "... #### 72") == 1.0
    assert last_integer_reward("#### 1,000", "1000") == 1.0
    assert last_integer_reward("#### 71", "72") == 0.0
    t = get_task("math:verifier=last-integer")
    assert t.reward("so 72", "#### 72") == 1.0 and t.verifier == "last-integer"


def test_the_shipped_sample():
    """~50 grade-school problems in GSM8K's format, a few MATH-style; every gold solution verifies."""
    rows = [json.loads(x) for x in SAMPLE.read_text().splitlines()]
    assert 45 <= len(rows) <= 60 and all(set(r) == {"question", "answer"} for r in rows)
    assert sum("\\boxed{" in r["answer"] for r in rows) >= 4 and sum("####" in r["answer"] for r in rows) >= 40
    t = get_task("math")
    assert isinstance(t, Math) and get_task(t.spec) == t
    train, held = t.examples("train", 1000, 0, unique=True), t.examples("heldout", 1000, 0)
    assert len(train) + len(held) == len(rows) and held and not {e.prompt for e in train} & {e.prompt for e in held}
    other = t.examples("heldout", 1000, 1)  # another seed: the same held-out questions, in another order
    assert other != held and sorted(e.prompt for e in other) == sorted(e.prompt for e in held)
    for e in train + held:
        assert e.prompt.startswith("Question: ") and e.prompt.endswith("\nAnswer:")
        target = t.completion(e)
        assert target.startswith(" ") and "<<" not in target  # the solution, calculator notes removed
        assert t.reward(target, e.answer) == 1.0, (e.prompt, target, e.answer)  # a model that writes it scores 1
        assert t.reward(" #### 12345", e.answer) == 0.0
    more = t.examples("train", 3 * len(train), 5)  # not unique: pass after pass, each reshuffled
    assert len(more) == 3 * len(train) and more[: len(train)] != more[len(train): 2 * len(train)]
    assert task_inputs(t) == {"task": fingerprints.fingerprint(SAMPLE)}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_columns_solutions_and_a_test_file(tmp_path):
    rows = [{"problem": f"What is {a} times {b}?", "sol": f"{a}*{b}={a * b}. The answer is $\\boxed{{{a * b}}}$.",
             "final": a * b} for a in range(2, 12) for b in range(2, 12)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    spec = f"math:data={data},question=problem,answer=final,solution=sol,heldout=0.25"
    t = get_task(spec)
    assert t.spec == f"math:data={data},question=problem,answer=final,solution=sol,verifier=math-verify,heldout=0.25"
    e = t.examples("train", 1, 0)[0]
    assert e.answer.isdigit() and t.completion(e).endswith(f"$\\boxed{{{e.answer}}}$.")  # int answers read as text
    assert 10 <= len(t.examples("heldout", 1000, 0)) <= 40
    test = _jsonl(tmp_path / "test.jsonl", rows[:7])
    tt = get_task(f"math:data={data},test={test},question=problem,answer=final")
    held = tt.examples("heldout", 1000, 0)
    assert len(held) == 7 and len(tt.examples("train", 1000, 0, unique=True)) == len(rows) - 7  # never trained on
    assert task_inputs(tt)["task"] == f"{fingerprints.fingerprint(data)}+{fingerprints.fingerprint(test)}"


@pytest.mark.parametrize(("spec", "msg"), [
    ("math:colour=red", "unknown option 'colour' for task math"),
    ("math:verifier=sympy", "unknown verifier 'sympy'"),
    ("math:heldout=2", "must be a fraction between 0 and 1"),
    ("math:heldout=lots", "must be a fraction between 0 and 1"),
    ("math:data=-", "not stdin"),
    ("math:data=missing.jsonl", "missing.jsonl: no such file"),
    ("math:question=q", "no column 'q'"),
    ("math:answer=solution", "no column 'solution'"),
    ("math:solution=worked", "no column 'worked'"),
])
def test_bad_math_options_are_one_clear_error(spec, msg):
    with pytest.raises(RlkitError, match=msg):
        get_task(spec).examples("train", 1, 0)


def test_rows_without_an_answer_are_left_out_and_an_empty_split_is_an_error(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "What is 1+1?", "answer": "#### 2"},
                                        {"question": "What is 2+2?", "answer": ""}, {"question": "", "answer": "3"}])
    test = _jsonl(tmp_path / "t.jsonl", [{"question": "What is 3+3?", "answer": "6"}])
    t = get_task(f"math:data={data},test={test}")
    assert [e.answer for e in t.examples("train", 5, 0, unique=True)] == ["2"]
    assert [e.answer for e in t.examples("heldout", 5, 0)] == ["6"]
    with pytest.raises(RlkitError, match="the heldout split is empty"):  # 1+1 falls in train at heldout=0.1
        get_task(f"math:data={data}").examples("heldout", 5, 0)


@pytest.mark.slow
def test_a_stage_reruns_after_the_data_file_changes(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [json.loads(x) for x in SAMPLE.read_text().splitlines()])
    cmd = ("prompts", "--task", f"math:data={data}", "--split", "heldout", "--num-prompts", "500", "--out", str(tmp_path / "p.arrow"))
    r = run_cli(*cmd)
    assert r.returncode == 0, r.stderr
    t, _ = streams.read_table(tmp_path / "p.arrow", ["prompts"])
    assert 1 <= t.num_rows < 20 and all(t.column("answer").to_pylist())  # the held-out questions, each once
    assert b"up to date" in run_cli(*cmd).stderr
    data.write_text(data.read_text().replace("Tom has 3 bags", "Tom has 3 big bags"))
    r = run_cli(*cmd)
    assert r.returncode == 0 and b"up to date" not in r.stderr
