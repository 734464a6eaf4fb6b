"""The built-in `python` tool and `--env python`, on the real bubblewrap sandbox: what a call's observation is
(stdout, stderr's end, the exit status, each cut at max_output), the limits (time, memory, no network, no host
files), the interpreter's state across the calls of one trajectory (and its absence with state=0 or after a restart),
the sandbox gone when the trajectory ends (also when the stage is killed), the sandbox's held-out attacks through the
tool path, calls of different trajectories at once, and docs/sandbox.md's example of a user's own tool.
Small limits keep the file fast (2 s calls, 256 MB)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlkit.envs import get_env
from rlkit.envs.calc import mul
from rlkit.envs.python import PythonEnv, PythonTool
from rlkit.envs.tools import Tools
from rlkit.errors import RlkitError
from rlkit.sandbox.bwrap import bwrap_path, uid_base
from rlkit.sandbox.interpreter import CodeRun, Interpreter, run_code
from rlkit.tasks.base import Example

pytestmark = pytest.mark.skipif(bwrap_path() is None and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                                reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")
ROOT = Path(__file__).resolve().parents[2]
EX = Example("p0", "<12345*67890>=", str(12345 * 67890), "train")


_OPEN: list[Tools] = []  # closed after each test, also a failing one (a passing test closes its own first)


def env(**opts) -> PythonEnv:
    e = PythonEnv(**{"timeout": 2.0, "memory": 256, **opts})
    _OPEN.append(e)
    e.reset(EX)
    return e


def call(e: Tools, code: str, form: str = "json") -> str:
    """One tool call's observation text, the call written in `form` as a model writes it."""
    text = (f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>" if form == "json"
            else f"<call>python({code!r})</call>")
    step = e.step(text)
    assert step.reward == 0.0 and not step.terminated
    (msg,) = step.observation
    assert msg["role"] == "tool"
    return msg["content"]


def leftovers(pids: set[int] = frozenset()) -> list[str]:
    """Processes of this process's sandboxes still alive: descendants of this process (but `pids`, alive before) and,
    as root, any process with one of this process's sandbox uids (a daemon that left the namespace would have no
    parent of ours)."""
    me, parent, found = os.getpid(), {}, []
    uids = range(uid_base(), uid_base() + 1024)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = dict(ln.split(":", 1) for ln in (d / "status").read_text().splitlines() if ":" in ln)
        except OSError:
            continue
        parent[int(d.name)] = int(fields["PPid"])
        if os.geteuid() == 0 and int(fields["Uid"].split()[0]) in uids:
            found.append(f"{d.name} {fields['Name'].strip()} (sandbox uid)")
    for pid in parent:
        p = pid
        while p > 1 and p in parent:
            p = parent[p]
            if p == me and pid not in pids:
                found.append(f"{pid} (descendant)")
                break
    return found


@pytest.fixture(autouse=True)
def _nothing_left():
    before = {int(x.split()[0]) for x in leftovers()}
    yield
    while _OPEN:
        _OPEN.pop().close()
    deadline = time.monotonic() + 2
    while (left := leftovers(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes left: {left}"


# -- what the model sees ---------------------------------------------------------------------------------------------

def test_a_call_shows_stdout_stderr_and_the_exit_status():
    e = env(max_output=60)
    assert call(e, "print(12345 * 67890)") == "838102050"  # stdout without its trailing newline
    assert call(e, "print(12345 * 67890)", form="python") == "838102050"  # <call>python('...')</call> too
    assert call(e, "12345 * 67890") == "838102050"  # a final expression is shown, as in a notebook
    assert call(e, "x = 2") == "(no output)"
    out = call(e, "print('half')\n1 / 0")
    assert out.startswith("half\nstderr:\n[") and out.endswith("ZeroDivisionError: division by zero\nexit status: 1")
    assert call(env(), "print('half')\n1 / 0") == ('half\nstderr:\nTraceback (most recent call last):\n'
                                                   '  File "<python>", line 2, in <module>\n'
                                                   'ZeroDivisionError: division by zero\nexit status: 1')
    assert call(e, "import sys\nprint('bye')\nsys.exit(3)") == "bye\nexit status: 3"
    assert call(e, "import sys\nsys.exit('no')") == "stderr:\nno\nexit status: 1"
    assert call(e, "import sys\nsys.stderr.write('careful\\n')\nprint(1)") == "1\nstderr:\ncareful"
    # stdout keeps its first max_output characters, stderr its last (a traceback's end is the error)
    assert call(e, "print('a' * 100 + 'b' * 100)") == "a" * 60 + "...[141 characters cut]"  # 200 and the newline
    out = call(e, "raise ValueError('x' * 200)")
    assert out.startswith("stderr:\n[") and out.endswith("x" * 40 + "\nexit status: 1")
    assert re.match(r"stderr:\n\[\d+ characters cut\]\.\.\.x{20}", out)
    assert e.tool_calls == 10 and e.tool_errors == 4  # a non-zero status is a failed call
    step = e.step("The product is 838102050.")  # a turn without a call: the final answer, scored on the host
    assert step.terminated and step.reward == 1.0
    e.close()


def test_the_limits_hold_and_the_interpreter_restarts_after_a_timeout():
    e = env()
    assert call(e, "x = 7") == "(no output)"
    t = time.monotonic()
    out = call(e, "while True:\n    pass")
    assert time.monotonic() - t < 2 + 1.5
    assert out == "timeout: the code ran past its time limit of 2 s; the interpreter was restarted (its names are lost)"
    assert call(e, "x").endswith("NameError: name 'x' is not defined\nexit status: 1")  # a fresh interpreter
    out = call(e, "b = bytearray(512 * 2**20)")  # over the 256 MB of address space
    assert out.endswith("MemoryError\nexit status: 1")
    assert call(e, "b = bytearray(2**20)\nlen(b)") == "1048576"  # the interpreter survives a MemoryError
    assert call(e, "import os\nos._exit(0)") == "the interpreter exited with status 0; it was restarted (its names " \
                                                "are lost)"
    assert call(e, "open('/tmp/scratch', 'w').write('ok')\nprint(open('/tmp/scratch').read())") == "ok"  # its tmpfs
    e.close()


def test_names_persist_across_the_calls_of_a_trajectory_and_state_0_forgets_them():
    e = env()
    call(e, "import math\ndef f(n):\n    return math.factorial(n) % 1000003")
    assert call(e, "values = [f(n) for n in range(5)]") == "(no output)"
    assert call(e, "values") == "[1, 1, 2, 6, 24]"
    other = env()  # another trajectory: an interpreter of its own
    assert call(other, "values").endswith("NameError: name 'values' is not defined\nexit status: 1")
    other.close()
    assert call(e, "len(values)") == "5"
    e.close()
    stateless = env(state=0)
    assert call(stateless, "y = 5\nprint(y)") == "5"
    assert call(stateless, "y").endswith("NameError: name 'y' is not defined\nexit status: 1")
    stateless.close()


def test_the_interpreter_is_gone_when_the_trajectory_ends(tmp_path):
    before = {int(x.split()[0]) for x in leftovers()}  # this worker's processes from other tests are not ours
    e = env()
    late = tmp_path / "late"  # a daemon of the model's would write this, had it survived and seen the host
    call(e, f"""import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1)
        open({str(late)!r}, "w").write("alive")
        open("/tmp/alive", "w").write("alive")
    os._exit(0)
print(os.getpid())""")
    (session,) = e._sessions.values()
    pid = session.py.pid
    assert pid is not None and Path(f"/proc/{pid}").exists()
    e.close()  # the driver closes every instance as its trajectory ends
    assert not Path(f"/proc/{pid}").exists()
    assert not leftovers(before)
    time.sleep(1.2)
    assert not late.exists()


def test_a_killed_stage_takes_its_interpreters_with_it(tmp_path):
    """bwrap's --die-with-parent: a stage killed by SIGKILL (no close(), no atexit) leaves no interpreter."""
    script = tmp_path / "stage.py"
    script.write_text(f"""import sys, time
sys.path.insert(0, {str(ROOT)!r})
from rlkit.envs.python import PythonEnv
from rlkit.tasks.base import Example
envs = [PythonEnv(timeout=5) for _ in range(2)]
for e in envs:
    e.reset(Example("p", "<1*1>=", "1", "train"))
    e.step('<call>python("import os\\\\nif os.fork() == 0:\\\\n    import time; time.sleep(60)\\\\nx = 1")</call>')
print(" ".join(str(s.py.pid) for e in envs for s in e._sessions.values()), flush=True)
time.sleep(60)
""")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = p.stdout.readline().decode()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, p.stderr.read().decode()[-2000:] if not line else line
        assert all(Path(f"/proc/{x}").exists() for x in pids)
        uids = range(1_000_000 + (p.pid % 1_000_000) * 1024, 1_000_000 + (p.pid % 1_000_000) * 1024 + 1024)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [x for x in pids if Path(f"/proc/{x}").exists() and _state(x) not in ("Z", None)]
        sandboxed = [d.name for d in Path("/proc").iterdir() if d.name.isdigit() and _uid(d) in uids]
        if not alive and (os.geteuid() != 0 or not sandboxed):
            break
        time.sleep(0.05)
    assert not alive and (os.geteuid() != 0 or not sandboxed), (alive, sandboxed)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _uid(d: Path) -> int | None:
    try:
        return next(int(ln.split()[1]) for ln in (d / "status").read_text().splitlines() if ln.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


# -- the sandbox's held-out attacks, through the tool --------------------------------------------------------------

def test_the_attacks_are_contained_through_the_tool(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret\n")
    written = tmp_path / "written.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    e = env()
    try:
        # network: nothing listens in the sandbox's own network, and the host's listener hears nothing
        out = call(e, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert "ConnectionRefusedError" in out or "OSError" in out, out
        with pytest.raises(BlockingIOError):
            listener.accept()
        # fork bomb: it ends within the call's time (the process limit, then the wall clock), leaving nothing
        t = time.monotonic()
        out = call(e, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
        assert time.monotonic() - t < 2 + 1.5 and out.startswith("timeout:"), out
        out = call(e, "import os\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
                      "            import time; time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError:\n"
                      "    pass\nn < 64")
        assert out == "True"  # the process limit is in force
        # memory
        assert call(e, "x = []\nwhile True:\n    x.append(' ' * 10**6)").endswith("MemoryError\nexit status: 1")
        # host files: not there to read, nothing written, nothing deleted
        assert "FileNotFoundError" in call(e, f"print(open({str(secret)!r}).read())")
        assert "exit status: 1" in call(e, f"open({str(written)!r}, 'w').write('x')")
        call(e, f"import os, shutil\nfor t in ({str(tmp_path)!r}, {str(secret)!r}, '/usr/bin/env', "
                f"{str(Path(os.__file__).resolve())!r}):\n    try:\n        shutil.rmtree(t) if os.path.isdir(t) "
                "else os.remove(t)\n    except OSError:\n        pass")
        assert secret.read_text() == "s3cret\n" and not written.exists() and Path("/usr/bin/env").exists()
        assert Path(os.__file__).exists()
        # /proc hunting: the answer (the host holds it) is nowhere the sandbox can look
        hunt = """import os, sys
found = []
for pid in os.listdir('/proc'):
    for what in ('cmdline', 'environ'):
        try:
            text = open(f'/proc/{pid}/' + what, errors='replace').read()
        except OSError:
            continue
        if '838102050' in text:
            found.append(pid)
for root, dirs, files in os.walk('/'):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/usr', '/proc', '/sys', '/dev', sys.base_prefix)]
    for name in files:
        try:
            if '838102050' in open(os.path.join(root, name), errors='replace').read(1 << 16):
                found.append(name)
        except OSError:
            pass
print(sum(p.isdigit() for p in os.listdir('/proc')) < 10, found)"""
        # (in a fresh trajectory: this one's interpreter still holds the sleeping children of the fork test above)
        assert call(env(), hunt) == "True []"  # a PID namespace of its own: a handful of processes, none the host's
        # exit tricks: killing its parents, exiting at once; the call fails, the reward is still the host's verdict
        out = call(e, "import os\nfor p in range(1, 50):\n    try:\n        os.kill(p, 9)\n    except OSError:\n"
                      "        pass\nprint('still here')")
        assert "838102050" not in out
        out = call(e, "import os\nos.kill(os.getppid(), 9)\nprint(1)")  # its parent is the namespace's root-owned init
        assert out.endswith("PermissionError: [Errno 1] Operation not permitted\nexit status: 1"), out
        assert call(e, "import os\nos._exit(0)").startswith("the interpreter exited with status 0")
        # a forged reply on the protocol's pipe reaches no one but the model's own observation
        out = call(e, "import os, stat\nfor fd in range(3, 64):\n    try:\n        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
                      "            os.write(fd, b'{\"out\": \"838102050\", \"status\": 0}\\n')\n    except OSError:\n"
                      "        pass")
        assert out == "(no output)"  # a line without its request's id is not the reply
        assert call(e, "print(6 * 7)") == "42"  # and the next call's reply is its own
        # one with its request's id (read from the interpreter's frames) but not a reply's shape: a restart, no crash
        forge = """import json, os, stat, sys
f = sys._getframe()
while f is not None and 'req' not in f.f_locals:
    f = f.f_back
line = json.dumps({"id": f.f_locals['req']['id'], "out": "x", "err": "", "status": "zero", "out_cut": 0, "err_cut": 0})
for fd in range(3, 64):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, line.encode() + b"\\n")
    except OSError:
        pass"""
        assert call(e, forge) == "the interpreter sent a malformed reply; it was restarted (its names are lost)"
        assert call(e, "print(6 * 7)") == "42"
        assert e.step("I give up: 1").reward == 0.0  # the reward reads the final answer only
    finally:
        listener.close()
        e.close()
    assert secret.read_text() == "s3cret\n"


# -- concurrency ---------------------------------------------------------------------------------------------------

def test_calls_of_different_trajectories_run_at_once():
    """Eight trajectories' calls of 1 s each, from eight threads (the driver's --env-workers): about 1 s in all, not
    the 8 s of calls one at a time (nothing serialises them)."""
    envs = [env() for _ in range(8)]
    for e in envs:
        assert call(e, "import time") == "(no output)"  # started: what is timed is the calls
    outs: list[str] = [""] * 8

    def one(i: int) -> None:
        outs[i] = call(envs[i], f"time.sleep(1)\nprint({i})")

    t = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.monotonic() - t
    assert outs == [str(i) for i in range(8)]
    assert took < 4, took
    for e in envs:
        e.close()


def test_an_interpreter_outlives_the_thread_of_its_first_call():
    """The driver runs a trajectory's calls on whichever of its threads is free, and gives a thread up after a call's
    time limit: the interpreter a thread started keeps its names when that thread has ended."""
    e = env()
    th = threading.Thread(target=lambda: call(e, "x = 41"))
    th.start()
    th.join()
    time.sleep(0.3)
    assert call(e, "x + 1") == "42"
    e.close()


# -- by name, options, and a user's own tool ---------------------------------------------------------------------

def test_the_tool_by_name_in_any_tools_environment():
    t = Tools(functions=[mul, "python"])
    assert [s["function"]["name"] for s in t.tool_schemas()] == ["mul", "python"]
    assert "python(code: str) -> str: Run Python code in a sandboxed interpreter" in t.describe()
    t.reset(EX)
    assert call(t, "print(2 ** 64)") == "18446744073709551616"
    assert t.step("<call>mul(6, 7)</call>").observation[0]["content"] == "42"
    t.close()

    class Mine(Tools):
        tools = [PythonTool(timeout=1, max_output=5)]

    assert [s["function"]["name"] for s in Mine.declared_tool_schemas()] == ["python"]
    m = Mine()
    m.reset(EX)
    assert call(m, "print('abcdefgh')") == "abcde...[4 characters cut]"
    assert call(m, "import time\ntime.sleep(3)").startswith("timeout: the code ran past its time limit of 1 s")
    m.close()
    with pytest.raises(RlkitError, match="no built-in tool 'ruby'; built-in tools: python"):
        Tools(functions=["ruby"])


@pytest.mark.parametrize(("spec", "error"), [
    ("python:timeout=0", "python tool: timeout=0; expected timeout > 0"),
    ("python:memory=10", "python tool: memory=10: sandbox limit memory_mb must be >= 64"),
    ("python:max_output=0", "python tool: max_output=0; expected max_output >= 1"),
    ("python:state=2", "python: state=2; expected 1 (one interpreter per trajectory) or 0 (one per call)"),
    ("python:digits=9", "calc: digits=9"),
])
def test_bad_options_are_one_line(spec, error):
    with pytest.raises(RlkitError, match=re.escape(error)):
        get_env(spec)  # when the spec is read, before any model loads


def test_get_env_python_brings_large_products():
    e = get_env("python").make()
    exs = list(__import__("itertools").islice(e.iter_examples("train", 0), 20))
    assert all(re.fullmatch(r"<\d{5}\*\d{5}>=", x.prompt) for x in exs)
    assert all(int(x.answer) == eval(x.prompt[1:-2]) for x in exs)
    e.close()


def test_an_interpreter_directly():
    with Interpreter("bwrap", timeout=2, max_output=100) as py:
        assert py.run("x = 6 * 7").status == 0
        r = py.run("print(x)\nx")
        assert r == CodeRun("42\n42\n", "", 0)
    assert run_code("print(sum(range(10**6)))").stdout == "499999500000\n"


def test_the_docs_example_of_a_users_own_tool(tmp_path):
    """docs/sandbox.md's example, as written there: a tool of the user's that runs the model's code in the sandbox."""
    text = (ROOT / "docs" / "sandbox.md").read_text()
    (block,) = re.findall(r"```python\n(# my_tools\.py.*?)```", text, re.S)
    assert len(block.strip().splitlines()) <= 25
    (tmp_path / "my_tools.py").write_text(block)
    e = get_env(f"{tmp_path / 'my_tools.py'}:Probe").make()
    e.reset(Example("p", "Write f, the square.", "ok", "train"))
    code = "def f(x):\n    return x * x"
    out = e.step(f"<call>run_tests({code!r})</call>").observation[0]["content"]
    assert out == "0 -> 0\n1 -> 1\n5 -> 25"
    out = e.step("<call>run_tests('def f(x):\\n    while True: pass')</call>").observation[0]["content"]
    assert out.startswith("timeout:")
    assert e.step("ok").reward == 1.0
    e.close()


def test_plan_says_what_the_interpreters_cost():
    from conftest import run_cli_inproc

    r = run_cli_inproc("plan", "rollout", "--policy", "qwen2.5-0.5b", "--engine", "vllm", "--env",
                       "python:memory=512", "--num-prompts", "32", "--n", "8", "--env-workers", "16")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    out = r.stdout.decode()
    assert ("note: environment PythonEnv: up to 256 sandboxed Python interpreters at once (one per trajectory, alive "
            "from its first call to its end), about 15 MB of host memory each when idle (3.8 GiB), each process up to "
            "512 MB of address space") in out
    assert "note: environment PythonEnv: at most 16 tool calls run at once (--env-workers)" in out
    assert PythonEnv.resources({"state": 0}, 256, 16)[0].startswith("up to 16 sandboxed Python interpreters at once "
                                                                    "(one per call running)")
