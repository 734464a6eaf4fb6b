"""`--reward-fn` in sandboxed workers (`reward_fns.load_all(..., sandbox=...)`, rlkit.sandbox.workers) on the real
bubblewrap: a verifier that executes the model's output changes nothing on the host; honest functions give the
same rewards as in the stage; errors are the stage's own lines; no worker outlives `close_all`.

CI installs bubblewrap and sets RLKIT_REQUIRE_SANDBOX=1, so these fail rather than skip where it is missing.
Small limits and two workers keep the file fast.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from rlkit.errors import RlkitError
from rlkit.sandbox import Limits, Sandbox
from rlkit.sandbox.bwrap import bwrap_path
from rlkit.scorers import reward_fns

needs_bwrap = pytest.mark.skipif(bwrap_path() is None and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                                 reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")
pytestmark = needs_bwrap

SB = Sandbox("bwrap", workers=2, limits=Limits(cpu_s=2, memory_mb=512, processes=32, file_mb=4))

REWARDS = '''
import os
import random
import time


def run_it(completion):
    """A verifier that executes the model's output: 0 when it raises, else its `score` (1 by default)."""
    g = {}
    try:
        exec(completion, g)
    except Exception:
        return 0.0
    return float(g.get("score", 1.0))


def pid(completion):
    return float(os.getpid())


def brevity(completion):
    time.sleep(random.random() * 0.02)  # rows finish out of order over the workers
    return -0.01 * len(completion)


def has_digit(completions, **kwargs):
    assert "group_id" in kwargs and len(kwargs["group_id"]) == len(completions)
    return [float(any(ch.isdigit() for ch in c)) + kwargs["group_id"][i] / 3 for i, c in enumerate(completions)]


def exact(prompt, completion, answer, row):
    assert row["prompt"] == prompt and row["completion"] == completion and row["prompt_ids"] == [1, 2]
    return float(answer is not None and completion.strip() == answer) / 7


def boom(completion):
    if completion == "two":
        raise ValueError("no reward for you")
    return 1.0


def nan(completion):
    return float("nan") if completion == "22" else 0.0


def words(completion):
    return "high"


def short_batch(completions):
    return [1.0]


def spin(completion):
    while completion == "two":
        pass
    return 1.0


def first_fails(completion):
    if completion == "2":
        raise ValueError("first")
    while True:
        pass


def exits(completion):
    os._exit(3)


def kills_its_worker(completion):
    import signal

    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(10)
'''


@pytest.fixture
def code(tmp_path):
    (tmp_path / "fns").mkdir(mode=0o700)  # as root, closed to the sandbox's uid: the source still gets there
    (tmp_path / "fns" / "my_rewards.py").write_text(REWARDS)
    return tmp_path


def _cols(completions=("2", "two", "22"), answer="2"):
    n = len(completions)
    return {"prompt_id": [f"p{i}" for i in range(n)], "sample_idx": list(range(n)), "group_id": [i % 3 for i in range(n)],
            "prompt": ["<1+1>="] * n, "completion": list(completions), "answer": [answer] * n,
            "prompt_ids": [[1, 2]] * n, "reward/verifier": [0.5] * n}


_BEFORE: set[int] = set()  # this process's descendants when the test started (another test's engine, say)


@pytest.fixture(autouse=True)
def _descendants_before():
    """Under xdist a worker may hold children of other tests (the vLLM tests' engine): they are not ours."""
    _BEFORE.clear()
    _BEFORE.update(int(x.split()[0]) for x in _descendants())


def _descendants() -> list[str]:
    """This process's descendants that are still alive (a worker, a sandbox, anything they started), but those
    alive before the test began."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = dict(x.split(":", 1) for x in (d / "status").read_text().splitlines() if ":" in x)
                parent[int(d.name)] = (int(fields["PPid"]), fields["Name"].strip())
            except (OSError, KeyError, ValueError):
                continue
    out = []
    for pid, (_, name) in parent.items():
        p = pid
        while p in parent and p > 1:
            p = parent[p][0]
            if p == os.getpid():
                if pid not in _BEFORE:
                    out.append(f"{pid} {name}")
                break
    return out


def test_model_code_run_by_a_verifier_changes_nothing_on_the_host(code):
    """The attacks of a model's completion that the user's verifier exec()s: write a file beside the test and
    in the function's own folder, open a socket to a listener on 127.0.0.1, leave a daemon behind. In the
    sandbox each fails inside the function (reward 0, what the function returns), a write to the sandbox's
    own /tmp succeeds (reward 1) and stays there; the listener receives nothing and no process survives."""
    host = code / "host"
    host.mkdir()
    (host / "keep.txt").write_text("mine")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    mark = f"rlkit-test-{os.getpid()}-{time.monotonic_ns()}"
    attacks = [
        f"open({str(host / 'pwned')!r}, 'w').write('x')",
        f"import os; os.remove({str(host / 'keep.txt')!r})",
        f"open({str(code / 'fns' / 'pwned.py')!r}, 'w').write('x')",
        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')",
        f"open('/tmp/{mark}', 'w').write('x'); score = 1",  # the sandbox's private tmpfs: allowed, not the host's
        "import os\nif os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(30)\nscore = 0.5",  # a daemon
        "score = 0.25",  # honest
    ]
    with reward_fns.closing(reward_fns.load_all([f"x={code}/fns/my_rewards.py:run_it"], sandbox=SB)) as fns:
        assert fns[0].score(_cols(attacks)) == [0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.25]
    assert sorted(p.name for p in host.iterdir()) == ["keep.txt"] and (host / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (code / "fns").iterdir()) == ["my_rewards.py"]
    assert not Path(f"/tmp/{mark}").exists()
    with pytest.raises(BlockingIOError):
        srv.accept()
    srv.close()
    assert _descendants() == []


def test_the_default_is_the_stage_itself(code):
    """Without a sandbox (the default) the function runs in the stage's own process, as it always did; with one
    it runs elsewhere (a worker's pid)."""
    f = reward_fns.load_all([f"{code}/fns/my_rewards.py:pid"])[0]
    assert f.workers is None and f.score(_cols()) == [float(os.getpid())] * 3
    with reward_fns.closing(reward_fns.load_all([f"{code}/fns/my_rewards.py:pid"], sandbox=SB)) as fns:
        assert fns[0].workers is not None and float(os.getpid()) not in fns[0].score(_cols())


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_honest_functions_give_the_stages_rewards(code, tmp_path, monkeypatch, kind):
    """Row, batch with **kwargs, and row-dict functions, from a file and from a package.module: the same floats
    as in the stage, in row order (7 rows finishing out of order over 2 workers, then a second chunk); in
    bubblewrap and in `--sandbox none`'s plain worker processes."""
    r = code / "fns" / "my_rewards.py"
    pkg = tmp_path / "proj" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text("from mypkg.helpers import ten\n\ndef tens(completion, answer):\n"
                                    "    return ten() * len(completion) + (answer is None)\n")
    (pkg / "helpers.py").write_text("def ten():\n    return 10.0\n")
    monkeypatch.chdir(tmp_path / "proj")  # `rlkit` imports package.module references from the current directory
    monkeypatch.setattr(sys, "path", list(sys.path))
    for m in ("mypkg", "mypkg.rewards", "mypkg.helpers"):
        monkeypatch.delitem(sys.modules, m, raising=False)  # this test's imports are undone after it
    specs = [f"a={r}:brevity", f"b={r}:has_digit", f"c={r}:exact", "d=mypkg.rewards:tens"]
    chunks = [_cols(["2", "two", "22", "x", "", "7 7", "lorem ipsum"]), _cols(["1", "22"], answer=None)]
    plain = reward_fns.load_all(specs)
    with reward_fns.closing(reward_fns.load_all(specs, sandbox=Sandbox(kind, SB.workers, SB.limits))) as boxed:
        for cols in chunks:
            for f, g in zip(plain, boxed, strict=True):
                assert g.score(cols, row0=3) == f.score(cols, row0=3), f.name
        assert len(boxed[0].workers.live) == 2  # kept across chunks
    assert _descendants() == []


@pytest.mark.parametrize("fn", ["boom", "nan", "words", "short_batch", "spin"])
def test_errors_are_the_stages_own_lines(code, fn):
    """An exception, a value that is not a finite number, a wrong-length batch and a call past --reward-timeout:
    the very line the stage gives without a sandbox (the first failing row's)."""
    spec = [f"x={code}/fns/my_rewards.py:{fn}"]
    cols = _cols(["2", "two", "22", "2", "two"])
    with pytest.raises(RlkitError) as plain:
        reward_fns.load_all(spec, timeout=0.5)[0].score(cols, row0=7)
    t0 = time.monotonic()
    with reward_fns.closing(reward_fns.load_all(spec, timeout=0.5, sandbox=SB)) as fns, \
            pytest.raises(RlkitError) as boxed:
        fns[0].score(cols, row0=7)
    assert str(boxed.value) == str(plain.value) and "\n" not in str(boxed.value)
    assert time.monotonic() - t0 < 10
    assert _descendants() == []


def test_the_first_failure_does_not_wait_for_later_rows(code):
    """Row 0 raises while rows 1 and 2 never return: the error comes at once (their workers are killed)."""
    t0 = time.monotonic()
    with reward_fns.closing(reward_fns.load_all([f"x={code}/fns/my_rewards.py:first_fails"], timeout=30,
                                                sandbox=SB)) as fns, pytest.raises(RlkitError, match="raised ValueError: first on row 0"):
        fns[0].score(_cols())
    assert time.monotonic() - t0 < 10 and _descendants() == []


@pytest.mark.parametrize(("fn", "says"), [
    ("exits", "its call exited with status 3 without a result on row 7 (prompt_id 'p0', sample_idx 0)"),
    ("kills_its_worker", "its sandboxed worker was killed by SIGKILL on row 7 (prompt_id 'p0', sample_idx 0)"),
])
def test_a_call_or_worker_that_dies_is_one_line(code, fn, says):
    with reward_fns.closing(reward_fns.load_all([f"x={code}/fns/my_rewards.py:{fn}"], sandbox=SB)) as fns, \
            pytest.raises(RlkitError) as e:
        fns[0].score(_cols(), row0=7)
    assert str(e.value) == f"--reward-fn x ({code}/fns/my_rewards.py:{fn}): {says}"
    assert _descendants() == []


def test_what_the_sandbox_cannot_import_is_one_line_before_any_scoring(code, monkeypatch):
    """The sandbox shows the function's folder, Python and the venv: a function whose file imports from a
    folder outside them fails when the stage starts, in one line."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "helper_mod", raising=False)
    (code / "elsewhere").mkdir()
    (code / "elsewhere" / "helper_mod.py").write_text("X = 1\n")
    (code / "fns" / "uses.py").write_text(f"import sys\nsys.path.append({str(code / 'elsewhere')!r})\n"
                                          "import helper_mod\n\ndef f(completion):\n    return 1.0\n")
    assert reward_fns.load_all([f"{code}/fns/uses.py:f"])[0].score(_cols()) == [1.0] * 3  # in the stage it imports
    with pytest.raises(RlkitError) as e:
        reward_fns.load_all([f"{code}/fns/uses.py:f"], sandbox=SB)
    assert str(e.value).startswith(f"--reward-fn f ({code}/fns/uses.py:f): importing it in the sandbox raised "
                                   "ModuleNotFoundError: No module named 'helper_mod'")
    assert _descendants() == []
