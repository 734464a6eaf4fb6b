"""The `code` task: program extraction, the public data sets' test forms, the generated task, and rewards from
programs run against their tests in the real sandbox (bubblewrap)."""

from __future__ import annotations

import json
import shutil

import pytest

from rlkit.errors import RlkitError
from rlkit.tasks import get_task, verify
from rlkit.tasks.code import SAMPLE, chain_program, extract_program, parse_tests

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None and not __import__("os").environ.get("RLKIT_REQUIRE_SANDBOX"),
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")


def test_the_program_is_the_last_fenced_block_else_an_open_fence_else_everything():
    assert extract_program("x\n```python\na = 1\n```\ntext\n```\nb = 2\n```\nbye") == "b = 2\n"
    assert extract_program("Here:\n```py\nprint(1)\n") == "print(1)\n"  # cut at the token limit
    assert extract_program("def f(x): return x") == "def f(x): return x"
    assert extract_program("```python\n```") == ""


def test_the_public_test_forms_parse_and_expected_values_stay_outside_the_program():
    apps = parse_tests(json.dumps({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7"]]}))
    assert [(c.kind, c.input, c.expected) for c in apps.cases] == [("stdio", "1 2\n", "3\n"), ("stdio", "3\n4", "7")]
    fn = parse_tests(json.dumps({"fn_name": "add", "inputs": [[1, 2], [[1], [2]]], "outputs": [[3], [[1, 2]]]}))
    assert fn.fn_name == "add" and [(c.kind, c.input, c.expected) for c in fn.cases] == [
        ("call", [1, 2], [3]), ("call", [[1], [2]], [[1, 2]])]
    pairs = parse_tests(json.dumps([{"input": "5\n", "output": "25\n", "testtype": "stdin"}]))
    assert [(c.kind, c.input, c.expected) for c in pairs.cases] == [("stdio", "5\n", "25\n")]
    # MBPP: `assert EXPR == LITERAL` splits (the literal is compared outside); anything else runs whole inside
    mbpp = parse_tests(str(["assert f(3) == (7, 'a')", "assert abs(f(1) - 2.5) < 1e-9", "assert g([1,2]) == [2, 1]"]))
    assert [(c.kind, c.input, c.expected) for c in mbpp.cases] == [
        ("expr", "f(3)", [7, "a"]), ("assert", "assert abs(f(1) - 2.5) < 1e-9", None), ("expr", "g([1, 2])", [2, 1])]
    assert [c.kind for c in parse_tests("assert h(1) == 2\nassert h(2) == 4\n").cases] == ["expr", "expr"]
    for bad in ("", "42", json.dumps({"inputs": ["1"], "outputs": []}), json.dumps({"fn_name": "no pe", "inputs": [[1]],
                                                                                 "outputs": [1]}), "print(1)"):
        with pytest.raises(ValueError):
            parse_tests(bad)


def test_the_generated_task_its_programs_and_its_options():
    t = get_task("code")
    assert t.spec == "code:ops=2-3,max=9,heldout=0.1,reward=all,timeout=10,memory=1024" and get_task(t.spec) == t
    train, held = t.examples("train", 200, 0), t.examples("heldout", 50, 0)
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert t.examples("train", 5, 3) == t.examples("train", 5, 3) != t.examples("train", 5, 4)
    for ex in train[:50]:
        program = t.completion(ex)  # the SFT target computes exactly what the tests expect
        assert program.startswith("def f(x): return ")
        suite = parse_tests(ex.answer)
        scope: dict = {}
        exec(program, scope)  # our own program, not a model's
        assert [scope["f"](*c.input) for c in suite.cases] == [c.expected for c in suite.cases]
    assert chain_program([("+", 3), ("*", 2), ("-", 1)]) == "def f(x): return (x+3)*2-1"
    assert chain_program([("*", 2), ("+", 3), ("*", 4)]) == "def f(x): return (x*2+3)*4"
    for spec, words in (("code:reward=some", "reward=some"), ("code:ops=3-1", "ops=3-1"), ("code:timeout=x", "timeout"),
                        ("code:nope=1", "unknown option 'nope'"), ("code:data=-", "data=-")):
        with pytest.raises(RlkitError, match=words):
            get_task(spec)


def test_the_shipped_sample_reads_as_apps_layout_prompts_with_solutions():
    t = get_task("code:data=sample,heldout=0.3")
    assert t.fingerprint and "data=sample" in t.spec
    rows = t.examples("train", 100, 0, unique=True) + t.examples("heldout", 100, 0)
    assert len(rows) == sum(1 for _ in SAMPLE.open())
    stdio = next(e for e in rows if "standard input" in e.prompt)
    call = next(e for e in rows if "Write a Python 3 function `gcd`" in e.prompt)
    assert "```python\ndef gcd(a, b):" in call.prompt  # the starter code under the statement
    assert parse_tests(stdio.answer).cases[0].kind == "stdio"
    assert t.completion(call).startswith("```python\ndef gcd(a, b):\n") and t.completion(call).endswith("\n```")


def test_a_small_file_has_problems_on_both_sides_and_a_larger_one_the_hash_partition(tmp_path):
    """The shipped 20 problems all hash into train at heldout=0.1: the held-out split is then the 2 (10%, rounded)
    nearest the held-out side of the partition, the ones heldout=0.3 holds out first; a file the partition already
    splits is split as `is_heldout` says, and one whose share rounds to no problem keeps them all in train."""
    from rlkit.tasks import is_heldout

    t = get_task("code:data=sample")
    train = [e.prompt for e in t.examples("train", 100, 0, unique=True)]
    held = [e.prompt for e in t.examples("heldout", 100, 0)]
    assert len(held) == 2 and len(train) == 18 and not set(held) & set(train)
    assert set(held) < {e.prompt for e in get_task("code:data=sample,heldout=0.3").examples("heldout", 100, 0)}
    assert not any(is_heldout(" ".join(p.split()), 0.1) for p in train + held)  # what left the split empty
    f = tmp_path / "many.jsonl"
    f.write_text("".join(json.dumps({"question": f"Print {i}.", "tests": f'[{{"input": "", "output": "{i}"}}]'}) + "\n"
                         for i in range(200)))
    big = get_task(f"code:data={f}")
    held = [e.prompt for e in big.examples("heldout", 1000, 0)]
    want = [e.prompt for e in big.examples("train", 1000, 0, unique=True) + big.examples("heldout", 1000, 0)
            if is_heldout(" ".join(e.prompt.split()), 0.1)]
    assert 0 < len(held) < 200 and sorted(held) == sorted(want)
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"question": q, "tests": '[{"input": "", "output": "1"}]'}) + "\n"
                           for q in ("Print 1.", "Print one.")))
    assert len(get_task(f"code:data={two}").examples("train", 10, 0, unique=True)) == 2
    with pytest.raises(RlkitError, match=r"the heldout split is empty \(2 problems\)"):
        get_task(f"code:data={two}").examples("heldout", 10, 0)


def test_eval_on_the_shipped_sample_as_the_docs_show_it(sft_dir):
    """`rlkit eval --task code:data=sample`: the held-out problems, each scored in the sandbox."""
    from tests.conftest import run_cli_inproc

    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", "code:data=sample", "--max-new-tokens", "8",
                       "--sandbox", "bwrap" if shutil.which("bwrap") else "none", "--json")
    assert r.returncode == 0, r.stderr.decode()[-800:]
    ev = json.loads(r.stdout)
    assert ev["n"] == 2 and sum(ev["verdicts"].values()) == 2, ev


def test_a_data_file_in_mbpp_layout_with_a_list_column(tmp_path):
    f = tmp_path / "mbpp.jsonl"
    rows = [{"text": "Add one.", "test_list": ["assert add_one(1) == 2"], "code": "def add_one(x):\n    return x + 1"},
            {"text": "", "test_list": ["assert z() == 0"], "code": ""},  # no statement: left out with a warning
            {"text": "Double.", "test_list": ["assert dbl(2) == 4", "assert dbl(0) == 0"], "code": "def dbl(x): return 2*x"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = get_task(f"code:data={f},question=text,tests=test_list,solution=code,heldout=0.01")
    ex = t.examples("train", 10, 0, unique=True)
    assert len(ex) == 2 and all("passes the tests" in e.prompt for e in ex)
    with pytest.raises(RlkitError, match="no column 'answer_x'"):
        get_task(f"code:data={f},question=text,tests=answer_x").examples("train", 1, 0)


@needs_bwrap
def test_rewards_and_reasons_from_programs_run_in_the_sandbox():
    t = get_task("code:data=sample,heldout=0.3,timeout=2")
    rows = t.examples("train", 100, 0, unique=True) + t.examples("heldout", 100, 0)
    # every shipped reference solution passes its own tests, in the sandbox
    good = verify(t, [t.completion(e) for e in rows], [e.answer for e in rows])
    assert good.values == [1.0] * len(rows) and set(good.reasons) == {"passed"}
    call = next(e for e in rows if parse_tests(e.answer).fn_name == "triangle")
    stdio = next(e for e in rows if "reversed" in e.prompt)
    responses = [
        "```python\ndef triangle(n):\n    return n * n\n```",        # wrong for n > 1
        "```python\ndef triangle(n)\n    return 1\n```",             # does not compile
        "```python\ndef triangle(n):\n    raise ValueError(n)\n```",  # raises
        "```python\nwhile True:\n    pass\n```",                      # never ends
        "```python\nprint(input()[::-1])\n```",                       # right
    ]
    got = verify(t, responses, [call.answer] * 4 + [stdio.answer])
    assert got.values == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert got.reasons == ["wrong_answer", "syntax_error", "runtime_error", "timeout", "passed"]
    frac = get_task("code:data=sample,heldout=0.3,reward=fraction,timeout=3")
    assert frac.reward("```python\ndef triangle(n):\n    return n * n\n```", call.answer) == pytest.approx(1 / 3)


def test_without_bubblewrap_the_stages_refuse_model_code_in_one_line_and_write_nothing(sft_dir, tmp_path):
    from tests.conftest import one_error_line, run_cli, run_cli_inproc

    gone = {"RLKIT_BWRAP": str(tmp_path / "no-bwrap")}
    out = tmp_path / "r.arrow"
    # a real process: one line, exit 69, nothing at --out
    r = run_cli("rollout", "--policy", str(sft_dir), "--task", "code", "--num-prompts", "2", "--out", str(out), env=gone)
    line = one_error_line(r)
    assert r.returncode == 69 and "apt-get install bubblewrap" in line and "--sandbox none" in line
    assert not out.exists()
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", "code", "--sandbox", "docker", env=gone)
    assert r.returncode == 2 and "--sandbox 'docker': expected one of bwrap, none" in one_error_line(r)
    # --sandbox none runs them unsandboxed, said on stderr; arithmetic never needs a sandbox
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", "code", "--num-prompts", "3", "--max-new-tokens", "4",
                       "--sandbox", "none", "--json", env=gone)
    assert r.returncode == 0, r.stderr.decode()[-800:]
    assert "--sandbox none" in r.stderr.decode() and json.loads(r.stdout)["verdicts"]
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--num-prompts", "2", "--max-new-tokens", "2", env=gone)
    assert r.returncode == 0, r.stderr.decode()[-800:]


@needs_bwrap
def test_a_user_task_that_runs_code_gets_the_stages_sandbox(tmp_path):
    from rlkit.sandbox import Sandbox
    from rlkit.tasks import Scores, task_sandbox

    (tmp_path / "squares.py").write_text('''
from rlkit.sandbox.programs import TestCase, TestSuite, run_programs
from rlkit.tasks import Example, Scores

class Squares:
    runs_code = True  # its verifier runs the model's program: the stage hands it a checked sandbox

    def iter_examples(self, split, seed):
        for n in range(2, 50):
            yield Example(f"{split}-{n}", f"square {n}", str(n * n), split)

    def reward(self, response, answer):
        raise AssertionError("score_batch is used")

    def score_batch(self, responses, answers, sandbox):
        suites = [TestSuite((TestCase("stdio", "", a + "\\n"),)) for a in answers]
        out = run_programs(sandbox, list(zip(responses, suites)))
        return Scores([float(o.reason == "passed") for o in out], [o.reason for o in out])
''')
    t = get_task(f"{tmp_path}/squares.py:Squares")
    sb = task_sandbox(t, None, 2)
    assert isinstance(sb, Sandbox) and sb.kind == "bwrap" and sb.workers == 2
    got = verify(t, ["print(4)", "print(5)", "open('/etc/passwd-x', 'w')"], ["4", "4", "4"], sb)
    assert got == Scores([1.0, 0.0, 0.0], ["passed", "wrong_answer", "runtime_error"])
    assert task_sandbox(get_task("arithmetic"), None) is None  # a task that runs no code gets none


def test_eval_and_rollout_sample_up_to_the_tasks_length_and_a_cut_response_is_truncated(sft_dir, tmp_path):
    from rlkit.io import manifests, streams
    from tests.conftest import run_cli_inproc

    # no --max-new-tokens: the code task's own 40 tokens (what recipes/code.sh passes), recorded in the result
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", "code", "--num-prompts", "4", "--sandbox", "none",
                       "--json")
    assert r.returncode == 0, r.stderr.decode()[-800:]
    ev = json.loads(r.stdout)
    assert ev["max_new_tokens"] == 40 and ev["truncated_fraction"] == 0.0 and "truncated" not in ev["verdicts"]
    # cut at one token: most responses never end; each is `truncated` (not wrong_answer) and one line says so
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", "code", "--num-prompts", "6", "--max-new-tokens", "1",
                       "--sandbox", "none", "--json")
    assert r.returncode == 0, r.stderr.decode()[-800:]
    ev = json.loads(r.stdout)
    cut = round(ev["truncated_fraction"] * ev["n"])
    assert ev["max_new_tokens"] == 1 and cut > 3 and ev["verdicts"]["truncated"] == cut
    assert sum(ev["verdicts"].values()) == ev["n_scored"] == 6
    warnings = [x for x in r.stderr.decode().splitlines() if "hit --max-new-tokens" in x]
    assert warnings == [f"warning: eval: {cut} of 6 responses ({cut / 6:.0%}) hit --max-new-tokens 1 (or the model's "
                        "context) before they ended, so their rewards score cut-off text; task code's own length is 40; raise --max-new-tokens"]
    # rollout: the verdict/verifier column (what update's verdict fractions count) says truncated for every cut row
    # that did not pass; the manifest records the length in force
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--task", "code", "--num-prompts", "3", "--n", "2",
                       "--max-new-tokens", "1", "--sandbox", "none", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-800:]
    rows = streams.read_table(out, ["rollouts"])[0].to_pylist()
    assert any(x["finish_reason"] == "length" for x in rows)
    for x in rows:
        assert (x["verdict/verifier"] == "truncated") == (x["finish_reason"] == "length"), x
    assert manifests.read_manifest(out)["config"]["max_new_tokens"] == 1
    assert "hit --max-new-tokens 1 (or the model's context) before they ended" in r.stderr.decode()
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--task", "code", "--num-prompts", "1", "--n", "1",
                       "--sandbox", "none", "--out", str(tmp_path / "d.arrow"))
    assert r.returncode == 0 and manifests.read_manifest(tmp_path / "d.arrow")["config"]["max_new_tokens"] == 40
