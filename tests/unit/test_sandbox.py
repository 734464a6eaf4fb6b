"""The code sandbox against the attacks of a model-written program, on the real bubblewrap.

Every attack runs in a real sandbox (bwrap here; CI installs it and sets RLKIT_REQUIRE_SANDBOX=1 so these fail
rather than skip where it is missing). After each call: the outcome is a failure (or the honest pass), the call
returned within its wall clock, nothing on the host changed, and no process of any sandbox is left.
Small limits keep the file fast: a 2.5 s wall clock, 256 MB of address space, 32 processes.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from rlkit.errors import SandboxUnavailable
from rlkit.sandbox import Limits, Sandbox, kill, spawn
from rlkit.sandbox.bwrap import bwrap_path, uid_base
from rlkit.sandbox.programs import (
    Outcome,
    TestCase,
    TestSuite,
    run_program,
    run_programs,
    stdio_equal,
    value_equal,
)

HAVE_BWRAP = bwrap_path() is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                                 reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")

LIMITS = Limits(wall_s=2.5, cpu_s=2, memory_mb=256, processes=32, file_mb=4, output_bytes=1 << 20)
SB = Sandbox("bwrap", workers=4, limits=LIMITS)

STDIO = TestSuite((TestCase("stdio", "3\n", "9\n"), TestCase("stdio", "12\n", "144")))
FN = TestSuite((TestCase("call", [3], 7), TestCase("expr", "f(4)", 9), TestCase("call", [0], 1)), fn_name="f")


_BEFORE: set[int] = set()  # this process's descendants when the test started (another test's engine, say)


@pytest.fixture(autouse=True)
def _descendants_before():
    """Under xdist a worker may hold children of other tests (the vLLM tests' engine): they are not ours."""
    _BEFORE.clear()
    _BEFORE.update(int(x.split()[0]) for x in sandbox_processes() if x.endswith("(descendant)"))


def sandbox_processes() -> list[str]:
    """Processes of this test's sandboxes still alive: this process's descendants (but those alive before the
    test began), and (as root) any process whose uid is one of the sandbox uids (a daemon that escaped the
    namespace would have no parent of ours)."""
    me, kids, uids = os.getpid(), {}, range(uid_base(), uid_base() + 1024)
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        kids[int(d.name)] = int(fields["PPid"])
        if os.geteuid() == 0 and int(fields["Uid"].split()[0]) in uids:
            found.append(f"{d.name} {fields['Name'].strip()} (sandbox uid)")
    for pid in kids:
        p = pid
        while p > 1 and p in kids:
            p = kids[p]
            if p == me:
                if pid not in _BEFORE:
                    found.append(f"{pid} (descendant)")
                break
    return found


def timed(jobs, sb=SB):
    t = time.monotonic()
    out = run_programs(sb, jobs)
    return out, time.monotonic() - t


def assert_clean():
    left = sandbox_processes()
    assert not left, f"sandbox processes left: {left}"


@needs_bwrap
def test_honest_programs_pass_every_test_form():
    jobs = [
        ("n = int(input())\nprint(n * n)   \n\n", STDIO),
        ("def f(x):\n    return 2 * x + 1\n", FN),
        ("class Solution:\n    def f(self, x):\n        return 2 * x + 1\n",  # LeetCode style
         TestSuite((TestCase("call", [3], 7), TestCase("call", [0], 1), TestCase("call", [1], 3)), fn_name="f")),
        ("def f(x):\n    return (x, [x * 0.5])\n",
         TestSuite((TestCase("call", [2], [2, [1.0000000001]]), TestCase("expr", "f(1)", (1, [0.5])),
                    TestCase("assert", "assert f(3)[0] == 3")), fn_name="f")),
        ("print(input()[::-1])", TestSuite((TestCase("stdio", "abc", "cba"), TestCase("stdio", "xy", "yz")))),
        ("def f(x):\n    return x +", FN),
        ("print(0.1 + 0.2)", TestSuite((TestCase("stdio", "", "0.3"),))),
    ]
    out, took = timed(jobs)
    assert out == [Outcome(2, 2, "passed"), Outcome(3, 3, "passed"), Outcome(3, 3, "passed"),
                   Outcome(3, 3, "passed"), Outcome(1, 2, "wrong_answer"), Outcome(0, 3, "syntax_error"),
                   Outcome(1, 1, "passed")]
    assert took < 10
    assert_clean()


@needs_bwrap
def test_concurrent_runs_keep_job_order():
    # Later jobs finish first (shorter sleeps); odd jobs expect the wrong number.
    jobs = [(f"import time\ntime.sleep({0.03 * (8 - k)})\nprint({k})",
             TestSuite((TestCase("stdio", "", str(k + k % 2)),))) for k in range(8)]
    out, _ = timed(jobs)
    assert [o.reason for o in out] == ["passed", "wrong_answer"] * 4
    assert_clean()


@needs_bwrap
def test_resource_attacks_end_in_time(tmp_path):
    late = tmp_path / "daemon-was-here"
    daemon = f"""import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(2)
        open({str(late)!r}, "w").write("alive")
        open("/tmp/alive", "w").write("alive")
    os._exit(0)
print(9)
"""
    nproc = """import os, time
def f():
    n = 0
    try:
        while n < 1000:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
    except OSError:
        pass
    return n
"""
    jobs = [
        ("while True:\n    pass", STDIO),  # 0: loop forever
        ("x = []\nwhile True:\n    x.append(' ' * 10**6)", STDIO),  # 1: allocate without end
        ("import os\nwhile True:\n    os.fork()", STDIO),  # 2: fork bomb
        (nproc, TestSuite((TestCase("expr", "f() < 32", True),))),  # 3: the process limit is in force
        ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", STDIO),  # 4: print without end (1 GB)
        ("import sys\nsys.stdout.write('x' * (1 << 30))", STDIO),  # 5: one 1 GB string
        (daemon, TestSuite((TestCase("stdio", "", "9"),))),  # 6: double-forking daemon; honest output
        ("def f(x):\n    while True:\n        pass", FN),  # 7: a call that never returns
    ]
    out, took = timed(jobs)
    reasons = [o.reason for o in out]
    assert reasons[0] == "timeout"
    assert reasons[1] == "memory"
    assert reasons[2] in ("runtime_error", "timeout") and out[2].passed == 0
    assert reasons[3] == "passed"  # fewer than 32 forks succeeded
    assert reasons[4] == "wrong_answer"  # killed at output_bytes
    assert reasons[5] in ("memory", "wrong_answer") and out[5].passed == 0
    assert out[6] == Outcome(1, 1, "passed")  # it passes honestly; its daemon dies with its sandbox
    assert reasons[7] == "timeout" and out[7].passed == 0
    assert took < 2 * (LIMITS.wall_s + 1.5)  # two rounds of 4 workers at most
    assert_clean()
    # The daemon started over 2 s ago (the loops above ran their full wall clock after it): it would have
    # written by now, had it survived and had it seen the host's file system.
    assert took > 2.0
    assert not late.exists()


@needs_bwrap
def test_network_is_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    prog = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'leak')\nprint('connected')")
    udp = (f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
           f"s.sendto(b'leak', ('127.0.0.1', {port}))\nprint('sent')")
    heard = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    heard.bind(("127.0.0.1", port))
    heard.setblocking(False)
    try:
        out, _ = timed([(prog, TestSuite((TestCase("stdio", "", "connected"),))),
                        (udp, TestSuite((TestCase("stdio", "", "sent"),)))])
        assert out[0] == Outcome(0, 1, "runtime_error")  # nothing listens in the sandbox's own network
        # (the datagram may well be sent: to the sandbox's own loopback, where nothing hears it)
        with pytest.raises(BlockingIOError):
            listener.accept()
        with pytest.raises(BlockingIOError):
            heard.recv(16)
    finally:
        listener.close()
        heard.close()
    assert_clean()


@needs_bwrap
def test_host_files_cannot_be_read_written_or_deleted(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret\n")
    written = tmp_path / "written.txt"
    base_os = Path(os.__file__).resolve()  # the base interpreter's stdlib: visible, read-only
    venv_marker = Path(sys.prefix) / "pyvenv.cfg"
    read = f"print(open({str(secret)!r}).read())"
    write = (f"open({str(written)!r}, 'w').write('x')\nprint('done')")
    wipe = f"""import os, shutil
os.chdir('/')
for target in ({str(tmp_path)!r}, {str(secret)!r}, {str(base_os)!r}, {str(venv_marker)!r}, '/usr/bin/env',
               {str(Path(__file__).resolve())!r}):
    try:
        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    except OSError:
        pass
for name in os.listdir('/'):
    if name not in ('usr', 'proc', 'dev'):
        shutil.rmtree('/' + name, ignore_errors=True)
for root, dirs, files in os.walk(os.path.dirname({str(base_os)!r})):
    for f in files:
        try:
            os.remove(os.path.join(root, f))
        except OSError:
            pass
print('wiped')
"""
    out, _ = timed([(read, TestSuite((TestCase("stdio", "", "s3cret"),))),
                    (write, TestSuite((TestCase("stdio", "", "done"),))),
                    (wipe, TestSuite((TestCase("stdio", "", "wiped"),)))])
    assert out[0] == Outcome(0, 1, "runtime_error")  # the file does not exist in the sandbox
    assert out[1] == Outcome(0, 1, "runtime_error") and not written.exists()
    assert out[2].passed in (0, 1)  # it may well print 'wiped': what matters is the host
    assert secret.read_text() == "s3cret\n" and base_os.exists() and venv_marker.exists()
    assert Path("/usr/bin/env").exists() and Path(__file__).exists()
    assert_clean()


@needs_bwrap
def test_killing_the_parent_and_exiting_early_fail_the_tests():
    kill_parent = "import os\nos.kill(os.getppid(), 9)\nprint(9)"
    exit0 = "import sys\nsys.exit(0)\ndef f(x):\n    return 2 * x + 1"
    os_exit0 = "import os\nos._exit(0)\ndef f(x):\n    return 2 * x + 1"
    exit_in_call = "import os\ndef f(x):\n    os._exit(0)"
    out, _ = timed([
        (kill_parent, STDIO),
        ("import os\nos.kill(os.getppid(), 9)\ndef f(x):\n    return 2 * x + 1", FN),
        ("import os, signal\nfor p in range(1, 50):\n    try:\n        os.kill(p, 9)\n    except OSError:\n"
         "        pass\nprint(9)", STDIO),
        (exit0, FN), (os_exit0, FN), (exit_in_call, FN),
        ("import sys\nsys.exit(0)", TestSuite((TestCase("stdio", "", "5"),))),
        ("import os\nos._exit(0)", TestSuite((TestCase("stdio", "", "5"),))),
    ])
    assert [o.passed for o in out] == [0] * 8
    assert [o.reason for o in out[:6]] == ["runtime_error"] * 6
    assert [o.reason for o in out[6:]] == ["wrong_answer"] * 2  # exited 0 having printed nothing
    assert_clean()


@needs_bwrap
def test_reward_hacks_get_no_reward(tmp_path):
    (tmp_path / "expected.json").write_text('{"expected": "SECRET-OUTPUT-123"}')
    always_eq = ("class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                 "def f(x):\n    return Any()\n")
    str_eq = "class S(str):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return S('no')\n"
    builtins_hack = ("import builtins\nbuiltins.len = lambda x: 3\nbuiltins.sorted = lambda x: [1, 2, 3]\n"
                     "__builtins__['abs'] = lambda x: 9\ndef f(x):\n    return []\n")
    fake_results = "print('{\"i\": 0, \"value\": 7}')\ndef f(x):\n    return 0\n"
    hunt = f"""import gc, os, sys
found = ''
for root, dirs, files in os.walk('/'):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/usr', '/proc', '/sys', '/dev', sys.base_prefix)]
    for name in files:
        try:
            text = open(os.path.join(root, name), errors='replace').read(1 << 16)
        except OSError:
            continue
        if 'SECRET' in text:
            found = text
for pid in os.listdir('/proc'):
    for what in ('cmdline', 'environ'):
        try:
            text = open(f'/proc/{{pid}}/{{what}}', errors='replace').read()
        except OSError:
            continue
        if 'SECRET' in text:
            found = text
for o in gc.get_objects():
    if isinstance(o, dict) and 'SECRET' in repr(o)[:10000]:
        found = repr(o)
try:
    found = found or open({str(tmp_path / "expected.json")!r}).read()
except OSError:
    pass
print(found.split('"')[-2] if '"' in found else 'SECRET-OUTPUT-123?')
"""
    frames = ("import sys, gc\ndef f(x):\n    for o in gc.get_objects():\n        if isinstance(o, dict) and "
              "'expected' in o:\n            return o['expected']\n    fr = sys._getframe(1)\n    while fr:\n"
              "        if 'expected' in fr.f_locals:\n            return fr.f_locals['expected']\n"
              "        fr = fr.f_back\n    return None\n")
    out, _ = timed([
        (always_eq, FN),
        (str_eq, TestSuite((TestCase("call", [1], "yes"), TestCase("expr", "f(2)", "yes")), fn_name="f")),
        (builtins_hack, TestSuite((TestCase("expr", "len(f(1))", 3), TestCase("expr", "sorted(f(1))", [1, 2, 3]),
                                   TestCase("expr", "abs(-1)", 1), TestCase("assert", "assert len(f(1)) == 3")),
                                  fn_name="f")),
        (fake_results, FN),
        (hunt, TestSuite((TestCase("stdio", "", "SECRET-OUTPUT-123"),))),
        (frames, TestSuite((TestCase("call", [1], 424242),), fn_name="f")),
    ])
    assert out[0] == Outcome(0, 3, "wrong_answer")  # not plain JSON data: never equal to anything
    assert out[1] == Outcome(0, 2, "wrong_answer")  # a str subclass leaves as its text, 'no'
    # The tests' expressions see the builtins as they were; abs(-1) == 1 passes honestly.
    assert out[2] == Outcome(1, 4, "wrong_answer")
    assert out[3] == Outcome(0, 3, "wrong_answer")  # what it prints never reaches the results
    assert out[4].passed == 0 and out[5].passed == 0
    assert_clean()


@needs_bwrap
def test_spawn_runs_a_command_with_read_only_binds(tmp_path):
    (tmp_path / "data.txt").write_text("visible\n")
    tmp_path.chmod(0o755)  # as root, the sandbox runs as another uid: what it is to read must be readable
    sb = Sandbox("bwrap", limits=LIMITS)
    p = spawn(sb, ["/bin/sh", "-c", f"cat {tmp_path}/data.txt; echo $GREETING; echo x > {tmp_path}/w"],
              ro_binds=[tmp_path], env={"GREETING": "hi"})
    out, err = p.communicate(timeout=10)
    kill(p)
    assert out.decode().split() == ["visible", "hi"] and err
    assert not (tmp_path / "w").exists()
    p = spawn(sb, ["/bin/sh", "-c", f"cat {tmp_path}/data.txt"])
    out, _ = p.communicate(timeout=10)
    kill(p)
    assert p.returncode != 0 and out == b""
    p = spawn(sb, ["/bin/sh", "-c", "(sleep 60 &) ; sleep 60"])
    t = time.monotonic()
    kill(p)
    assert time.monotonic() - t < 3
    assert_clean()


@needs_bwrap
def test_a_sandbox_outlives_the_thread_that_started_it():
    """bwrap's --die-with-parent follows the thread that started it: a sandbox started from a thread that then ends
    (an environment call's thread the driver gave up, a tool worker shared by trajectories) must live on until it is
    killed; it dies with the process (every sandbox is started from one thread that lives as long as it)."""
    import threading

    sb = Sandbox("bwrap", limits=LIMITS)
    box = []

    def start() -> None:  # the thread starts the sandbox, sees it up, and ends
        p = spawn(sb, ["/bin/sh", "-c", "echo up; read line; echo got $line"])
        box.append((p, p.stdout.readline()))

    th = threading.Thread(target=start)
    th.start()
    th.join()
    ((p, up),) = box
    time.sleep(0.3)
    out, _ = p.communicate(b"it\n", timeout=10)
    kill(p)
    assert up == b"up\n" and out == b"got it\n" and p.returncode == 0
    assert_clean()


def test_kind_none_has_the_limits_and_timeout():
    sb = Sandbox("none", workers=2, limits=Limits(wall_s=1.5, cpu_s=1, memory_mb=256))
    out = run_programs(sb, [("n = int(input())\nprint(n * n)", STDIO), ("while True:\n    pass", STDIO),
                            ("x = ' ' * (1 << 30)", STDIO)])
    assert [o.reason for o in out] == ["passed", "timeout", "memory"]
    assert_clean()


def test_check_refuses_without_bwrap(tmp_path, monkeypatch):
    monkeypatch.delenv("RLKIT_BWRAP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox().check()
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 69
    assert "bwrap (bubblewrap) not found" in msg and "apt-get install bubblewrap" in msg
    assert "docs/install.md" in msg and "--sandbox none" in msg
    with pytest.raises(SandboxUnavailable):
        run_program(Sandbox(), "print(1)", STDIO)
    Sandbox("none").check()  # never refused


def test_check_names_what_bwrap_said(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\n"
                    "echo 'second line' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("RLKIT_BWRAP", str(fake))
    with pytest.raises(SandboxUnavailable, match="bwrap failed: bwrap: Creating new namespace failed: "
                                                 "Operation not permitted") as e:
        Sandbox().check()
    assert "second line" not in str(e.value)


def test_comparison_rules():
    assert stdio_equal("1 2\n3  \n\n", "1 2\n3")
    assert stdio_equal("0.30000000000000004\n", "0.3")
    assert not stdio_equal("1 2 3", "1 2") and not stdio_equal("nan", "nan 1")
    assert not stdio_equal("abc", "abd")
    assert value_equal([1, [2.0000000001]], (1, (2,)))
    assert value_equal(5, [5])  # APPS-style [v]
    assert not value_equal(5.1, 5) and not value_equal("5", 5) and not value_equal(None, 0)
    assert value_equal({"1": 2}, {1: 2})


def test_limits_are_checked():
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=8)
    with pytest.raises(ValueError, match="kind"):
        Sandbox("docker")
