"""The `code-feedback` environment and task: the feedback a failing program gets for every test format the code task
reads (the first failing visible test, or the error's last traceback lines), hidden tests' values never shown, the
reward options, programs of different trajectories run at once, and SFT transcripts exactly as the environment
answers; all on the real sandbox (bubblewrap)."""

from __future__ import annotations

import itertools
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlkit.envs import get_env
from rlkit.errors import RlkitError
from rlkit.tasks import Example, get_task

from conftest import untrained_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not __import__("os").environ.get("RLKIT_REQUIRE_SANDBOX"),
                                reason="bubblewrap is not installed (apt-get install bubblewrap)")

HIDDEN = 30303 ** 2  # a hidden test's expected value: it must never reach the model


def _env(spec: str = "code-feedback"):
    return get_env(spec).make()


def _ex(tests) -> Example:
    return Example("p0", "Solve it.\n", tests if isinstance(tests, str) else json.dumps(tests), "train")


# each format: (tests, a program failing the first visible test, what the feedback shows, the right program)
FORMATS = {
    "apps stdio": ({"inputs": ["1 2\n", "5 5\n", "400000000 518271809\n"], "outputs": ["3\n", "10\n", f"{HIDDEN}\n"]},
                   "a, b = map(int, input().split())\nprint(a - b)\n",
                   "Failed test: input:\n1 2\nExpected output:\n3\nGot:\n-1\n",
                   "a, b = map(int, input().split())\nprint(a + b)\n"),
    "apps fn_name": ({"fn_name": "add", "inputs": [[1, 2], [5, 5], [400000000, 518271809]],
                      "outputs": [[3], [10], [HIDDEN]]},
                     "def add(a, b):\n    return a - b\n", "Failed test: add(1, 2)\nExpected: 3\nGot: -1\n",
                     "def add(a, b):\n    return a + b\n"),
    "stdin/stdout pairs": ([{"input": "2\n", "output": "4\n"}, {"input": "3\n", "output": "9\n"},
                            {"input": "30303\n", "output": f"{HIDDEN}\n"}],
                           "print(int(input()) * 2)\n", None, "print(int(input()) ** 2)\n"),
    "mbpp asserts": (["assert sq(2) == 4", "assert sq(3) == 9", f"assert sq(30303) == {HIDDEN}"],
                     "def sq(x):\n    return x * 2\n", "Failed test: sq(3)\nExpected: 9\nGot: 6\n",
                     "def sq(x):\n    return x * x\n"),
    "generic asserts": (["assert sq(2) > 3", "assert sq(3) in (9, 10)", f"assert sq(30303) in ({HIDDEN}, 0)"],
                        "def sq(x):\n    return x + 1\n", "Failed test: assert sq(2) > 3\nTraceback", None),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_test_format_shows_the_first_failing_visible_test_and_never_a_hidden_value(name):
    tests, wrong, shown, right = FORMATS[name]
    env = _env()
    assert env.reset(_ex(tests)) == "Solve it.\n"
    st = env.step(wrong)  # visible: the first two tests; the third is hidden
    assert not st.terminated and st.reward == 0.0 and st.observation.startswith("Failed test: ")
    if shown:
        assert st.observation.startswith(shown), st.observation
    if name == "stdin/stdout pairs":  # 2*2 == 4 passes; the second visible test is the first to fail
        assert st.observation == "Failed test: input:\n3\nExpected output:\n9\nGot:\n6\n"
    assert str(HIDDEN) not in st.observation and "30303" not in st.observation
    if right:
        end = env.step(right)
        assert end.terminated and end.observation is None and end.reward == 1.0 and env.turn == 2


def test_a_program_that_passes_the_visible_tests_ends_the_episode_and_the_hidden_ones_decide_the_reward():
    tests = {"fn_name": "add", "inputs": [[1, 2], [5, 5], [400000000, 518271809]], "outputs": [3, 10, HIDDEN]}
    env = _env()
    env.reset(_ex(tests))
    st = env.step("def add(a, b):\n    return 3 if a == 1 else 10\n")  # visible ones pass, the hidden one fails
    assert st.terminated and st.observation is None and st.reward == 0.0 and env.turn == 1
    long = {"inputs": ["300\n", "400\n", "5\n"], "outputs": ["\n".join(map(str, range(n))) for n in (300, 400, 6)]}
    env.reset(_ex(long))  # a long right output is judged whole (the feedback shows at most 200 characters)
    st = env.step("for i in range(int(input())):\n    print(i)\n")  # visible ones pass; the hidden test: 5 lines, not 6
    assert st.terminated and st.observation is None and st.reward == 0.0
    env.reset(_ex(long))
    st = env.step("for i in range(int(input())):\n    print(i + 1)\n")
    assert st.observation.startswith("Failed test: input:\n300\nExpected output:\n0\n1\n2\n")
    assert st.observation.count("...") == 2 and len(st.observation) < 500
    frac = _env("code-feedback:reward=fraction")
    frac.reset(_ex(tests))
    assert frac.step("def add(a, b):\n    return 3 if a == 1 else 10\n").reward == pytest.approx(2 / 3)


def test_errors_show_their_last_traceback_lines_and_limits_say_so():
    env = _env("code-feedback:attempts=5,timeout=1")
    env.reset(_ex(["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4"]))
    st = env.step("```python\ndef g(x):\n    return 1 // (x - 1)\n\ndef f(x):\n    return g(x) + x\n```")
    assert st.observation == ('\nFailed test: f(1)\nTraceback (most recent call last):\n  File "main.py", line 5, '
                              'in f\n    return g(x) + x\n  File "main.py", line 2, in g\n    return 1 // (x - 1)\n'
                              'ZeroDivisionError: integer division or modulo by zero\n'), st.observation
    st = env.step("def f(x):\n    return f(x)\n")  # a thousand frames: the last two shown
    assert st.observation == ('Failed test: f(1)\nTraceback (most recent call last):\n' + '  File "main.py", line 2, '
                              'in f\n    return f(x)\n' * 2 + 'RecursionError: maximum recursion depth exceeded\n')
    st = env.step("def f(x) return x + 1\n")
    assert "SyntaxError" in st.observation and 'File "main.py", line 1' in st.observation
    st = env.step("def f(x):\n    while True:\n        pass\n")
    assert st.observation == "Failed test: f(1)\nTimed out (1 s for all the tests)\n"
    last = env.step("import sys\nsys.exit(3)\n")  # attempt 5 of 5: the episode ends, reward from every test
    assert last.terminated and last.reward == 0.0
    stdio = _env()
    stdio.reset(_ex({"inputs": ["a\n", "b\n", "c\n"], "outputs": ["A\n", "B\n", "C\n"]}))
    st = stdio.step("s = input()\nprint(s.upper() + int(s))\n")
    assert st.observation == ('Failed test: input:\na\nTraceback (most recent call last):\n  File "main.py", line 2, '
                              "in <module>\n    print(s.upper() + int(s))\nValueError: invalid literal for int() with "
                              "base 10: 'a'\n")


def test_options_attempts_discount_messages_and_bad_ones_in_one_line():
    env = _env("code-feedback:attempts=2,discount=0.5,messages=1")
    ex = next(env.iter_examples("heldout", 0))
    assert env.reset(ex) == [{"role": "user", "content": ex.prompt}]
    st = env.step("def f(x): return 12345\n")
    assert st.observation[0]["role"] == "user" and st.observation[0]["content"].startswith("Failed test: f(0)\n")
    right = get_task("code").completion(ex)
    assert env.step(right).reward == 0.5  # right at attempt 2: 0.5 ** 1
    one = _env("code-feedback:attempts=1")
    one.reset(ex)
    assert one.step("def f(x): return 12345\n").terminated  # single-turn: no feedback, reward 0
    spec = get_env("code-feedback:attempts=4")
    assert spec.attribute("stop") == ("\n",) and spec.attribute("max_new_tokens") == 40 and spec.attribute("max_turns") == 4
    data = get_env("code-feedback:data=sample")
    assert not data.attribute("stop") and data.attribute("max_new_tokens") == 512
    assert len(list(data.make().iter_examples("heldout", 0))) >= 1
    lines = spec.factory.resources(spec.options, 64 * 8, 16)  # what `rlkit plan rollout --env code-feedback` says
    assert lines[0].startswith("up to 16 sandboxed programs at once") and "1,024 MB of address space" in lines[0]
    assert lines[1].startswith("up to 4 programs a trajectory")
    for bad, words in (("attempts=0", "attempts=0: expected 1 <= attempts <= 20"),
                       ("discount=2", "discount=2: expected 0 < discount <= 1"), ("ops=x", "ops='x'"),
                       ("reward=best", "reward=best: expected all or fraction")):
        with pytest.raises(RlkitError, match=words):
            get_env(f"code-feedback:{bad}")  # when the spec is read, before any model loads


def test_programs_of_different_trajectories_run_at_once():
    slow = "import time\ndef f(x):\n    time.sleep(0.5)\n    return 0\n"  # 2 visible tests: 1 s a run

    def attempt(_):
        env = _env()
        env.reset(_ex({"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [1, 2, 3]}))
        return env.step(slow)

    t0 = time.monotonic()
    attempt(0)
    one = time.monotonic() - t0
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        steps = list(ex.map(attempt, range(4)))
    four = time.monotonic() - t0
    assert all(s.observation.startswith("Failed test: f(1)") for s in steps)
    assert four < 2 * one, (one, four)  # one at a time: 4x


def test_sft_transcripts_are_the_environments_own_feedback_tokenised_as_a_rollout_appends_it():
    from rlkit.io.data import encode_sft_masked
    from rlkit.tiny import build_tokenizer

    task = get_task("code-feedback:fix=0.6")
    assert get_task(task.spec) == task and task.problems_spec == get_task("code").problems_spec
    examples = task.examples("train", 200, 0)
    assert [e.prompt for e in examples] == [e.prompt for e in get_task("code").examples("train", 200, 0)]
    targets = [task.completion(e) for e in examples]
    repairs = [(e, t) for e, t in zip(examples, targets, strict=True) if len(t.parts) == 3]
    assert 0.45 < len(repairs) / len(targets) < 0.75  # the fix share (a slip the visible tests miss: right at once)
    assert all(len(t.parts) == 1 and t.parts[0][0].endswith("\n") for t in targets if len(t.parts) != 3)
    env = _env()
    for ex, t in repairs[:6]:  # the feedback in the transcript is what the environment says to that program
        (wrong, m1), (note, m2), (right, m3) = t.parts
        assert (m1, m2, m3) == (True, False, True) and wrong != right
        env.reset(ex)
        assert env.step(wrong).observation == note
        assert env.step(right).reward == 1.0
    tok = build_tokenizer()
    ex, t = repairs[0]
    ids, _, _, masks = encode_sft_masked(tok, [tok(ex.prompt)["input_ids"]], [t], 256)
    text = tok.decode(ids[0][len(tok(ex.prompt)["input_ids"]):])
    assert text == str(t) + tok.eos_token
    masked = "".join(tok.decode([i]) for i, m in zip(ids[0][-len(masks[0]):], masks[0], strict=True) if m == 0)
    assert masked == t.parts[1][0]  # the feedback is context, not a target
    # single-turn, the task scores the first program: pass at attempt 1
    assert task.reward(t.parts[2][0], ex.answer) == 1.0 and task.reward(t.parts[0][0] + t.parts[2][0], ex.answer) == 0.0
    with pytest.raises(RlkitError, match="fix=2: expected 0 <= fix <= 1"):
        get_task("code-feedback:fix=2")


def test_sft_transcripts_are_the_same_in_every_process():
    """The transcripts at a seed do not depend on the process's string hashing (PYTHONHASHSEED): a recipe's SFT data,
    and so its figures, are the same on every run."""
    import os
    import subprocess
    import sys

    code = ("from rlkit.tasks import get_task\nt = get_task('code-feedback:fix=1')\n"
            "print(repr([str(t.completion(e)) for e in t.examples('train', 300, 0)]))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2", "3")}
    assert len(outs) == 1 and "Failed test" in outs.pop()


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """The tiny model untrained, saved as a checkpoint: its programs fail, so its trajectories use every attempt."""
    return untrained_checkpoint(tmp_path_factory.mktemp("codefb") / "pol")[2]


def _rollout(policy, spec: str, n: int = 2, episodes: bool = False):
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes

    eng = engines.create("hf", policy, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    env = get_env(spec)
    ex = list(itertools.islice(env.make().iter_examples("train", 0), 3))
    prompts = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex],
                      [tok(e.prompt)["input_ids"] for e in ex])
    s = Sampling(n=n, temperature=1.0, max_new_tokens=12, max_turns=env.attribute("max_turns"), env_workers=4)
    ep = run_episodes(eng, tok, env, prompts, s, seed=3)
    return ep if episodes else ep.columns


def test_credit_final_trains_only_the_final_programs_tokens(untrained):
    assert _env().credit == "all" and _env("code-feedback:credit=final").credit == "final"
    with pytest.raises(RlkitError, match="credit=last: expected all, final or turn"):
        get_env("code-feedback:credit=last")
    every = _rollout(untrained, "code-feedback:attempts=3")
    final = _rollout(untrained, "code-feedback:attempts=3,credit=final")
    assert final["completion_ids"] == every["completion_ids"] and final["reward/env"] == every["reward/env"]
    assert final["turns"] == every["turns"] and max(every["turns"]) == 3
    for mask, want, turns in zip(final["loss_mask"], every["loss_mask"], every["turns"], strict=True):
        runs = [(m, len(list(g))) for m, g in itertools.groupby(want)]  # sampled, feedback, sampled, ...
        assert [m for m, _ in runs][::2] == [1] * turns  # each turn's sampled tokens, then its feedback
        last = sum(k for _, k in runs[:2 * (turns - 1)])  # where the final program starts
        assert mask == [0] * last + want[last:] and sum(mask) == runs[2 * (turns - 1)][1] > 0
    one = _rollout(untrained, "code-feedback:attempts=1,credit=final")  # one program: it is the final one
    assert all(t == 1 and set(m) == {1} for t, m in zip(one["turns"], one["loss_mask"], strict=True))


PAID = """from dataclasses import replace

from rlkit.envs.code_feedback import CodeFeedbackEnv


class Paid(CodeFeedbackEnv):
    \"\"\"The code-feedback environment whose attempt k (from 1) is paid k / 10 more: a reward on every step.\"\"\"

    def __init__(self, credit="all"):
        super().__init__(attempts=3, credit=credit)

    def reset(self, example):
        self.k = 0
        return super().reset(example)

    def step(self, action):
        self.k += 1
        s = super().step(action)
        return replace(s, reward=s.reward + self.k / 10)
"""


def test_credit_turn_gives_each_program_a_row_with_its_own_reward(untrained, tmp_path):
    (tmp_path / "paid.py").write_text(PAID)
    every = _rollout(untrained, f"{tmp_path}/paid.py:Paid")
    ep = _rollout(untrained, f"{tmp_path}/paid.py:Paid:credit=turn", episodes=True)
    turn = ep.columns
    assert ep.rewards == every["reward/env"]  # each trajectory's whole reward, as eval reports it
    assert _env("code-feedback:credit=turn").credit == "turn" and max(every["turns"]) == 3
    rows = iter(range(len(turn["turns"])))
    for ids, mask, turns, total, why in zip(every["completion_ids"], every["loss_mask"], every["turns"],
                                            every["reward/env"], every["end_reason"], strict=True):
        assert total == pytest.approx(sum(k / 10 for k in range(1, turns + 1)))  # every program fails, untrained
        runs = [(m, len(list(g))) for m, g in itertools.groupby(mask)]  # sampled, feedback, sampled, ...
        start = 0
        for k in range(turns):  # row k: the conversation up to program k, only program k trained, paid its own
            i = next(rows)
            end = start + runs[2 * k][1]
            assert turn["completion_ids"][i] == ids[:end] and turn["loss_mask"][i] == [0] * start + mask[start:end]
            assert turn["reward/env"][i] == pytest.approx((k + 1) / 10) and turn["turns"][i] == 1
            assert sum(turn["token_rewards"][i]) == pytest.approx(turn["reward/env"][i])
            assert turn["end_reason"][i] == ("continued" if k < turns - 1 else why)
            start = end + (runs[2 * k + 1][1] if 2 * k + 1 < len(runs) else 0)
    assert next(rows, None) is None


def test_an_environments_credit_other_than_all_or_final_is_one_line(untrained, tmp_path):
    from rlkit.envs import EnvError

    mod = tmp_path / "lastenv.py"
    mod.write_text("from rlkit.envs.code_feedback import CodeFeedbackEnv\n\n\n"
                   "class Last(CodeFeedbackEnv):\n    credit = 'last'\n\n"
                   "    def __init__(self):\n        super().__init__(attempts=2)\n        self.credit = 'last'\n")
    with pytest.raises(EnvError, match=r"environment Last: credit='last' \(prompt .* sample 0\): expected 'all', "
                                       r"'final', 'turn'"):
        _rollout(untrained, f"{mod}:Last", n=1)


def test_repair_transcripts_are_demonstrations_to_the_verifier_check():
    from rlkit.tasks.trust import check_verifier

    task = get_task("code-feedback:fix=1")  # every target a wrong first program, its feedback and the fix
    assert task.targets_are_gold is False and get_task("code-feedback:fix=0").targets_are_gold is True
    out = check_verifier(task)  # sft refused these targets: the single-turn verifier scores the first program
    assert out.rejected == 0 and not out.paid and any("demonstrations" in n for n in out.notes)
    assert check_verifier(get_task("code-feedback:fix=0")).rejected == 0  # right at once: held to full marks
