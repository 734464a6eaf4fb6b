"""Tasks and rewards from the user's code: `--task FILE.py:CLASS`, `package.module:CLASS`, `rlkit.tasks`
entry points, and `--reward-fn NAME=FILE.py:FUNC`, loaded from real files, run in the real stages."""

import json
import math
import os
import shutil

import pytest

from rlkit.errors import RlkitError
from rlkit.io import fingerprints, manifests, streams
from rlkit.scorers import reward_fns
from rlkit.tasks import UserTask, get_task, task_inputs

from conftest import fast_rlkit_cmd, one_error_line, run_cli, run_cli_inproc

TASK = '''
import random
from rlkit.tasks import Example, is_heldout


class Countdown:
    """Subtraction: '<9-4>=' -> '5'; held out by a stable hash of the prompt, as the built-in tasks are."""

    def __init__(self, max: int = 9, heldout: float = 0.2, strict: bool = False):
        self.max, self.heldout, self.strict = max, heldout, strict

    def iter_examples(self, split, seed):
        rng = random.Random(f"{split}|{seed}")
        i = 0
        while True:
            a = rng.randint(0, self.max)
            b = rng.randint(0, a)
            p = f"<{a}-{b}>="
            if is_heldout(p, self.heldout) == (split == "heldout"):
                yield Example(f"{split}-{seed}-{i}", p, str(a - b), split)
                i += 1

    def reward(self, response, answer):
        return float(response.strip() == answer)


class FromOptions(Countdown):
    name = "countdown-x"

    @classmethod
    def from_options(cls, opts):
        return cls(max=int(opts.pop("top", 5)), **opts)

    def completion(self, ex):
        return f"= {ex.answer}"

    def reward(self, response, answer):  # reads the answer the way completion() writes it
        return float(response.strip().removeprefix("=").strip() == answer)


class NoReward:
    def iter_examples(self, split, seed):
        yield Example("a", "<1-1>=", "0", split)


class BadReward(Countdown):
    def reward(self, response):
        return 0.0


class Wrong(Countdown):
    def __init__(self, what="str", **kw):
        super().__init__(**kw)
        self.what = what

    def iter_examples(self, split, seed):
        if self.what == "item":
            yield ("<1-1>=", "0")
        yield from super().iter_examples(split, seed)

    def reward(self, response, answer):
        if self.what == "raise":
            raise ZeroDivisionError("division by zero")
        return "yes" if self.what == "str" else math.inf


import math
'''

REWARDS = '''
def brevity(completion):
    return -0.01 * len(completion)


def has_digit(completions, **kwargs):
    assert "group_id" in kwargs and len(kwargs["group_id"]) == len(completions)
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def exact(prompt, completion, answer, row):
    assert row["prompt"] == prompt and row["completion"] == completion
    return float(answer is not None and completion.strip() == answer)


def boom(completion):
    raise ValueError("no reward for you")


def nan(completion):
    return float("nan")


def words(completion):
    return "high"


def short_batch(completions):
    return [1.0]


def two_args(x, y):
    return 0.0


def mixed(completion, prompts):
    return 0.0


def spin(completion):
    while True:
        pass


def sleepy(completions):
    import time

    time.sleep(1000)


def stubborn(completion):  # catches Exception in its loop: the time limit must still end it
    import time

    while True:
        try:
            time.sleep(1000)
        except Exception:
            pass


def probe(completion, row):  # what model code a verifier runs could do: write beside this file (1.0 if it could)
    import os

    try:
        with open(os.path.join(os.path.dirname(__file__), f"probe-{row['prompt_id']}-{row['sample_idx']}"), "w") as f:
            f.write(completion)
    except OSError:
        return 0.0
    return 1.0


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def code(tmp_path):
    (tmp_path / "my_tasks.py").write_text(TASK)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path


def _error(spec: str) -> str:
    with pytest.raises(RlkitError) as e:
        get_task(spec).examples("train", 3, 0)
    return str(e.value)


def test_a_task_class_from_a_file(code):
    t = get_task(f"{code}/my_tasks.py:Countdown:max=20")
    assert isinstance(t, UserTask) and t.name == "Countdown" and t.spec == f"{code}/my_tasks.py:Countdown:max=20"
    assert get_task(t.spec) == t  # the spec rebuilds the task, like a built-in's
    train, held = t.examples("train", 300, 0), t.examples("heldout", 50, 0)
    assert len(train) == 300 and len(held) == 50 and len({e.prompt for e in held}) == 50  # held-out: unique
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert all(int(e.prompt[1:-2].split("-")[0]) <= 20 for e in train)
    assert t.examples("train", 5, 0) == train[:5] and t.examples("train", 5, 1) != train[:5]
    e = train[0]
    assert t.completion(e) == e.answer  # no completion(): the SFT target is the answer
    assert t.reward(e.answer, e.answer) == 1.0 and t.reward("nope", e.answer) == 0.0
    assert task_inputs(t)["task"] == fingerprints.fingerprint(code / "my_tasks.py")
    assert task_inputs(get_task("arithmetic")) == {}


def test_options_are_typed_or_go_through_from_options(code):
    t = get_task(f"{code}/my_tasks.py:Countdown:max=3,heldout=0.5,strict=yes")
    assert (t.impl.max, t.impl.heldout, t.impl.strict) == (3, 0.5, True)
    f = get_task(f"{code}/my_tasks.py:FromOptions:top=4")
    assert f.name == "countdown-x" and f.impl.max == 4
    e = f.examples("train", 1, 0)[0]
    assert f.completion(e) == f"= {e.answer}"
    assert "unknown option 'colour'" in _error(f"{code}/my_tasks.py:Countdown:colour=red")
    assert "takes max=..., heldout=..., strict=..." in _error(f"{code}/my_tasks.py:Countdown:colour=red")
    assert "option max='many' is not a valid int" in _error(f"{code}/my_tasks.py:Countdown:max=many")
    assert "strict='maybe'" in _error(f"{code}/my_tasks.py:Countdown:strict=maybe")
    assert "bad task option 'max'" in _error(f"{code}/my_tasks.py:Countdown:max")


def test_a_module_and_an_entry_point(code, monkeypatch):
    pkg = code / "userpkg_a"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks.py").write_text(TASK)
    dist = code / "rlkit_countdown-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlkit-countdown\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlkit.tasks]\ncountdown = userpkg_a.tasks:Countdown\n"
                                          "arithmetic = userpkg_a.tasks:Countdown\n")
    assert "unknown task 'countdown'" in _error("countdown")
    monkeypatch.syspath_prepend(str(code))
    m = get_task("userpkg_a.tasks:Countdown:max=5")
    assert m.spec == "userpkg_a.tasks:Countdown:max=5" and len(m.examples("train", 4, 0)) == 4
    ep = get_task("countdown:max=5")  # a package's registered name, options as for a built-in
    assert ep.spec == "countdown:max=5" and ep.examples("train", 4, 0) == m.examples("train", 4, 0)
    assert task_inputs(ep) == task_inputs(m) == {"task": fingerprints.fingerprint(pkg / "tasks.py")}
    assert get_task("arithmetic").name == "arithmetic"  # a built-in name is never taken over
    known = _error("chess").split("known tasks: ")[1].split(";")[0].split(", ")  # built-ins, then packages'
    assert known[:4] == ["arithmetic", "math", "code", "calc"] and known[-1] == "countdown"
    assert "no module named 'nosuchpkg'" in _error("nosuchpkg.tasks:Countdown")


def test_what_a_task_class_lacks_is_said_in_one_line(code):
    f = f"{code}/my_tasks.py"
    msg = _error(f"{f}:NoReward")
    assert "lacks reward(response, answer)" in msg and "\n" not in msg
    assert "reward(response) cannot be called as reward(response, answer)" in _error(f"{f}:BadReward")
    assert "has no task class named 'Nope' (it defines " in _error(f"{f}:Nope")
    assert "no such file" in _error(f"{code}/missing.py:Countdown")
    (code / "broken.py").write_text("def oops(:\n")
    assert "importing it raised SyntaxError" in _error(f"{code}/broken.py:Countdown")
    assert "not a class" in _error(f"{f}:math")  # a module attribute that is not callable


def test_what_a_user_task_returns_is_checked(code):
    f = f"{code}/my_tasks.py"
    with pytest.raises(RlkitError, match=r"reward\(\) returned 'yes' for response '5'.*expected a finite number"):
        get_task(f"{f}:Wrong:what=str").reward("5", "5")
    with pytest.raises(RlkitError, match="returned inf"):
        get_task(f"{f}:Wrong:what=inf").reward("5", "5")
    with pytest.raises(RlkitError, match=r"reward\('5', '5'\) raised ZeroDivisionError: division by zero"):
        get_task(f"{f}:Wrong:what=raise").reward("5", "5")
    with pytest.raises(RlkitError, match="yielded a tuple; expected rlkit.tasks.Example"):
        get_task(f"{f}:Wrong:what=item").examples("train", 2, 0)


def test_the_task_identity_follows_its_file(code):
    f = code / "my_tasks.py"
    before = task_inputs(get_task(f"{f}:Countdown"))
    f.write_text(TASK.replace("a - b", "b - a"))
    t = get_task(f"{f}:Countdown")
    assert task_inputs(t) != before
    e = t.examples("train", 20, 0)
    assert any(x.answer.startswith("-") for x in e)  # the edited code runs in the same process too


def _cols(n=3):
    return {"prompt_id": [f"p{i}" for i in range(n)], "sample_idx": list(range(n)), "group_id": [0] * n,
            "prompt": ["<1+1>="] * n, "completion": ["2", "two", "22"][:n], "answer": ["2"] * n}


def test_reward_fn_conventions(code):
    r = code / "my_rewards.py"
    one = reward_fns.load(f"len={r}:brevity")
    assert (one.name, one.batched, one.takes) == ("len", False, ("completion",))
    assert one.score(_cols()) == pytest.approx([-0.01, -0.03, -0.02])
    batch = reward_fns.load(f"{r}:has_digit")  # no NAME=: named after the function
    assert (batch.name, batch.batched, batch.takes_kwargs) == ("has_digit", True, True)
    assert batch.score(_cols()) == [1.0, 0.0, 1.0]
    row = reward_fns.load(f"exact={r}:exact")
    assert row.needs_all_columns and row.score(_cols()) == [1.0, 0.0, 0.0]
    assert reward_fns.fingerprints([one]) == {"reward_fn:len": fingerprints.fingerprint(r)}
    with pytest.raises(RlkitError, match="already a reward component named 'verifier'"):
        reward_fns.load_all([f"verifier={r}:brevity"], taken=["verifier"])
    with pytest.raises(RlkitError, match="already a reward component named 'len'"):
        reward_fns.load_all([f"len={r}:brevity", f"len={r}:has_digit"])


@pytest.mark.parametrize(("fn", "msg"), [
    # found when loading, before any sampling
    ("two_args", "rlkit cannot fill its parameter 'x' (signature (x, y))"),
    ("mixed", "its parameters mix one row (completion) and a batch (prompts)"),
    ("NOT_A_FUNCTION", "is a int, not a function"),
    ("nothing", "has no function named 'nothing'"),
    # found when scoring: the row is named (here the batch's rows start at row 7 of the table)
    ("boom", "raised ValueError: no reward for you on row 7 (prompt_id 'p0', sample_idx 0)"),
    ("nan", "returned nan for row 7 (prompt_id 'p0', sample_idx 0); expected a finite number"),
    ("words", "returned 'high' for row 7"),
    ("short_batch", "returned 1 values for the batch of rows 7-9; a batched reward function returns one number per row (3)"),
])
def test_bad_reward_fns_are_one_line_naming_file_function_and_row(code, fn, msg):
    with pytest.raises(RlkitError) as e:
        reward_fns.load(f"x={code}/my_rewards.py:{fn}").score(_cols(), row0=7)
    assert msg in str(e.value) and f"{code}/my_rewards.py" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("fn", "where"), [
    ("spin", "row 7 (prompt_id 'p0', sample_idx 0)"),  # busy in Python
    ("sleepy", "the batch of rows 7-9 (prompt_id 'p0' to 'p2')"),  # asleep
    ("stubborn", "row 7 (prompt_id 'p0', sample_idx 0)"),  # swallowing Exception
])
def test_a_reward_fn_that_never_returns_is_stopped(code, fn, where):
    """--reward-timeout: a call that does not return in time is one error line naming the function and the
    row; the SIGALRM handler in place before is back after, and no timer is left armed."""
    import signal
    import time

    def mine(signum, frame):
        raise AssertionError("the previous SIGALRM handler ran")

    before = signal.signal(signal.SIGALRM, mine)
    try:
        t0 = time.monotonic()
        with pytest.raises(RlkitError) as e:
            reward_fns.load_all([f"x={code}/my_rewards.py:{fn}"], timeout=0.3)[0].score(_cols(), row0=7)
        assert time.monotonic() - t0 < 10
        assert str(e.value) == (f"--reward-fn x ({code}/my_rewards.py:{fn}) did not return within 0.3 s on {where}; "
                                "raise --reward-timeout (0: no limit) or fix the function")
        assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        # a function that returns in time is not disturbed, and 0 is no limit
        assert reward_fns.load(f"{code}/my_rewards.py:brevity", timeout=0.3).score(_cols()) == pytest.approx(
            [-0.01, -0.03, -0.02])
        assert reward_fns.load(f"{code}/my_rewards.py:brevity", timeout=0).score(_cols())
        assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, before)
    with pytest.raises(RlkitError, match="--reward-timeout -1 must be a number of seconds >= 0"):
        reward_fns.load_all([], timeout=-1)


def test_numbers_of_every_kind_are_rewards():
    import numpy as np
    import torch

    from rlkit.plugins.user_code import as_number

    assert [as_number(v) for v in (True, 2, 0.5, np.float32(0.25), np.int64(3), torch.tensor(1.5), np.array([2.0]))] \
        == [1.0, 2.0, 0.5, 0.25, 3.0, 1.5, 2.0]
    assert [as_number(v) for v in ("1", None, math.nan, -math.inf, [1.0], torch.ones(2))] == [None] * 6


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                    reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")
def test_a_user_task_and_reward_fns_through_the_pipe(sft_dir, code):
    """rollout --task FILE:CLASS --reward-fn --sandbox bwrap | score-ref --reward-fn | update: every component
    is summed (or weighed with --reward) and logged; the manifests carry the code's fingerprints. rollout's
    functions run in bubblewrap (the same rewards; a write beside their file fails there), score-ref's in
    the stage."""
    import subprocess

    task, r = f"{code}/my_tasks.py:Countdown:max=20", code / "my_rewards.py"
    roll = code / "r.arrow"
    p1 = subprocess.Popen([*fast_rlkit_cmd(), "rollout", "--policy", str(sft_dir), "--task", task, "--num-prompts", "8",
                           "--n", "4", "--reward-fn", f"len={r}:brevity", "--reward-fn", f"{r}:probe", "--sandbox",
                           "bwrap", "--sandbox-workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p2 = subprocess.Popen([*fast_rlkit_cmd(), "score-ref", "--reward-fn", f"{r}:has_digit", "--reward-fn",
                           f"exact={r}:exact", "--out", str(roll)], stdin=p1.stdout, stderr=subprocess.PIPE)
    p1.stdout.close()
    assert p1.wait() == 0 and p2.wait() == 0, (p1.stderr.read(), p2.stderr.read())
    t, _ = streams.read_table(roll, ["rollouts"])
    rows = t.to_pylist()
    assert len(rows) == 32 and all(x["prompt"].startswith("<") and "-" in x["prompt"] for x in rows)
    assert [x["reward/probe"] for x in rows] == [0.0] * 32 and not list(code.glob("probe-*"))
    for x in rows:
        assert x["reward/len"] == pytest.approx(-0.01 * len(x["completion"]))
        assert x["reward/has_digit"] == float(any(c.isdigit() for c in x["completion"]))
        assert x["reward/exact"] == x["reward/verifier"] == float(x["completion"].strip() == x["answer"])
    m = manifests.read_manifest(roll)
    assert m["reward_fns"] == {"has_digit": f"{r}:has_digit", "exact": f"{r}:exact"}
    assert m["inputs"]["reward_fn:exact"] == fingerprints.fingerprint(r)
    assert m["rollout"]["task"] == task and m["rollout"]["reward_fn"] == [f"len={r}:brevity", f"{r}:probe"]
    assert m["rollout"]["sandbox"] == "bwrap"

    metrics = code / "m.jsonl"
    u = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(code / "u"), "--beta", "0",
                "--epochs", "1", "--metrics", str(metrics), "--reward", "len=2", "--reward", "has_digit=0.5")
    assert u.returncode == 0, u.stderr
    assert b"reward = 2*len + 0.5*has_digit" in u.stderr
    row = json.loads(metrics.read_text())
    comps = {k: sum(x[f"reward/{k}"] for x in rows) / len(rows) for k in ("len", "has_digit", "exact", "verifier")}
    for k, v in comps.items():
        assert row[f"reward/{k}"] == pytest.approx(v)
    assert row["reward_mean"] == pytest.approx(2 * comps["len"] + 0.5 * comps["has_digit"], abs=1e-6)


def _rollouts(path, n=4):
    """A small real 'rollouts' table (what `rollout` writes, without sampling), for score-ref."""
    import pyarrow as pa

    cols = {"prompt_id": [f"train-0-{i // 2}" for i in range(n)], "group_id": [i // 2 for i in range(n)],
            "sample_idx": [i % 2 for i in range(n)], "prompt": ["<3+4>="] * n, "completion": ["7", "8", "x7", "17"][:n],
            "prompt_ids": [[1, 30, 22, 15, 23, 32, 31]] * n, "completion_ids": [[2]] * n, "old_logprobs": [[-0.5]] * n,
            "finish_reason": ["eos"] * n, "policy_fingerprint": ["sha256:0"] * n, "policy_step": [0] * n,
            "answer": ["7"] * n, "reward/verifier": [1.0, 0.0, 1.0, 0.0][:n]}
    m = manifests.make_manifest("rollouts", "rollout", {"temperature": 1.0}, {})
    with streams.write_table("rollouts", path, m, [pa.field("reward/verifier", pa.float64())]) as w:
        w.write(cols)
    return path


@pytest.mark.slow
def test_bad_user_code_is_one_line_and_writes_nothing(sft_dir, code):
    """Each failure: one line naming file and function (and the row), non-zero exit, nothing at --out, an
    existing --out untouched. Signatures are checked before the model loads."""
    r, out = code / "my_rewards.py", _rollouts(code / "r.arrow")
    before = out.read_bytes()
    base = ("rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--out", str(out), "--force")
    line = one_error_line(run_cli(*base, "--reward-fn", f"x={r}:two_args"))
    assert "rlkit cannot fill its parameter 'x'" in line and f"{r}:two_args" in line
    line = one_error_line(run_cli_inproc(*base, "--reward-fn", f"x={code}/nope.py:f"))
    assert f"{code}/nope.py: no such file" in line
    line = one_error_line(run_cli_inproc(*base, "--reward-fn", "x=nosuchpkg.rewards:f"))
    assert "no module named 'nosuchpkg'" in line
    line = one_error_line(run_cli_inproc(*base, "--reward-fn", f"verifier={r}:brevity"))
    assert "already a reward component named 'verifier'" in line
    line = one_error_line(run_cli_inproc(*base, "--task", f"{code}/my_tasks.py:NoReward"))
    assert "lacks reward(response, answer)" in line
    # raised inside, during sampling: after the engine started, still one line and nothing written
    err = run_cli_inproc(*base, "--reward-fn", f"x={r}:boom").stderr.decode()
    assert err.strip().splitlines()[-1].startswith(f"rlkit: error: --reward-fn x ({r}:boom) raised ValueError: "
                                                   "no reward for you on row 0 (prompt_id 'train-0-0', sample_idx 0)")
    assert "Traceback" not in err
    assert out.read_bytes() == before and [p.name for p in code.iterdir() if p.name.startswith(".")] == []
    for fn, says in (("nan", "returned nan for row 0"), ("words", "returned 'high' for row 0"),
                     ("has_digit", "already has reward component 'verifier'")):
        name = "verifier" if fn == "has_digit" else "x"
        line = one_error_line(run_cli_inproc("score-ref", "--in", str(out), "--out", str(code / "s.arrow"),
                                             "--reward-fn", f"{name}={r}:{fn}"))
        assert says in line, line
    assert not (code / "s.arrow").exists()
    r2 = run_cli("score-ref", "--in", str(out), "--out", str(code / "s.arrow"), "--reward-fn", f"x={r}:boom", "--debug")
    assert r2.returncode != 0 and b"Traceback" in r2.stderr and b"no reward for you" in r2.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["spin", "sleepy"])
def test_a_hung_reward_fn_stops_the_stage_in_one_line(sft_dir, code, fn):
    """`--reward-timeout 1` on a function stuck in a Python loop or a sleep: rollout and score-ref exit
    non-zero with one error line naming the function and the row, no traceback, nothing at --out and no
    temporary file left beside it."""
    import time

    r, out = code / "my_rewards.py", code / "out" / "T.arrow"
    out.parent.mkdir()
    rows = "row 0 (prompt_id 'train-0-0', sample_idx 0)" if fn == "spin" else "the batch of rows 0-3"
    t0 = time.monotonic()
    res = run_cli("rollout", "--policy", str(sft_dir), "--engine", "hf", "--num-prompts", "2", "--n", "2",
                  "--max-new-tokens", "2", "--reward-fn", f"x={r}:{fn}", "--reward-timeout", "1", "--out", str(out),
                  timeout=120)
    err = res.stderr.decode()
    assert res.returncode != 0 and time.monotonic() - t0 < 120
    errors = [x for x in err.splitlines() if x.startswith("rlkit: error:")]
    assert errors == [err.strip().splitlines()[-1]] and "Traceback" not in err, err
    assert errors[0].startswith(f"rlkit: error: --reward-fn x ({r}:{fn}) did not return within 1 s on {rows}")
    assert errors[0].endswith("raise --reward-timeout (0: no limit) or fix the function")
    assert not out.exists() and list(out.parent.iterdir()) == []

    line = one_error_line(run_cli("score-ref", "--in", str(_rollouts(code / "r.arrow")), "--out", str(out),
                                  "--reward-fn", f"x={r}:{fn}", "--reward-timeout", "1", timeout=120))
    assert f"--reward-fn x ({r}:{fn}) did not return within 1 s on {rows}" in line
    assert not out.exists() and list(out.parent.iterdir()) == []


@pytest.mark.slow
def test_editing_user_code_reruns_the_stage(code):
    """The rerun rule sees the task's and the reward function's files: edited, the stage runs again."""
    t, r = code / "my_tasks.py", code / "my_rewards.py"
    p = ("prompts", "--task", f"{t}:Countdown", "--num-prompts", "20", "--out", str(code / "p.arrow"))
    assert run_cli(*p).returncode == 0
    assert b"up to date" in run_cli(*p).stderr
    t.write_text(TASK + "\n# edited\n")
    again = run_cli(*p)
    assert again.returncode == 0 and b"up to date" not in again.stderr

    roll = _rollouts(code / "r.arrow")
    s = ("score-ref", "--in", str(roll), "--out", str(code / "s.arrow"), "--reward-fn", f"len={r}:brevity")
    assert run_cli(*s).returncode == 0
    assert b"up to date" in run_cli(*s).stderr
    r.write_text(REWARDS.replace("-0.01 *", "-0.02 *"))
    again = run_cli(*s)
    assert again.returncode == 0 and b"up to date" not in again.stderr
    rows = streams.read_table(code / "s.arrow", ["rollouts"])[0].to_pylist()
    assert all(x["reward/len"] == pytest.approx(-0.02 * len(x["completion"])) for x in rows)


@pytest.mark.slow
def test_sft_and_eval_on_a_user_task(code, tmp_path):
    task = f"{code}/my_tasks.py:FromOptions:top=9"
    out = tmp_path / "sft"
    r = run_cli("sft", "--task", task, "--num-examples", "100", "--eval-num", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "rlkit.json").read_text())
    assert m["config"]["task"] == task and m["inputs"]["task"] == fingerprints.fingerprint(code / "my_tasks.py")
    assert m["metrics"]["heldout_n"] == 8
    r = run_cli("eval", "--policy", str(out), "--task", task, "--num-prompts", "8", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["task"] == task and res["n"] == 8 and res["accuracy"] == m["metrics"]["heldout_accuracy"]
