"""`rlkit.sampling.env_calls`: environment calls off the main thread. Plain calls in a pool of threads (at most
`workers` at once, in submission order), async ones awaited on one event loop (any number at once), each under its
time limit: an overrunning Python loop is stopped in its thread, a hook registered with `on_cancel` runs (what kills a
sandboxed tool's worker), and sys.exit() in a call is its outcome, not the process's end. A sandboxed tool that hangs
is killed when the driver gives its call up (real bubblewrap, or the unisolated workers where bwrap cannot run)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from rlkit.envs.base import on_cancel
from rlkit.sampling.env_calls import EnvCalls, Overrun


class Peak:
    """How many calls run at once, at most (each call's body between enter and leave)."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.order: list[int] = []
        self.lock = threading.Lock()

    def enter(self, k: int) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.order.append(k)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def _all(calls: EnvCalls) -> list:
    done = []
    while calls.in_flight:
        done += calls.wait()
    return done


@pytest.mark.parametrize("workers", [1, 3])
def test_plain_calls_run_in_a_pool_of_threads_in_submission_order(workers):
    peak = Peak()
    main = threading.current_thread()
    threads = set()

    def call(k):
        peak.enter(k)
        threads.add(threading.current_thread())
        time.sleep(0.15)
        peak.leave()
        return k * 10

    calls = EnvCalls(workers)
    for size in (min(2, workers), 7):  # the second round finds threads idle, and starts more as it needs them
        peak.peak, peak.order = 0, []
        for k in range(size):
            calls.submit(k, "step", call, k)
        done = _all(calls)
        assert sorted((d.key, d.value, d.error) for d in done) == [(k, k * 10, None) for k in range(size)]
        assert peak.peak == min(size, workers) and main not in threads and len(threads) == min(size, workers)
        if workers == 1:
            assert peak.order == list(range(size))  # one at a time, in the order submitted
    calls.shutdown()


def test_async_methods_and_awaitables_run_on_the_event_loop_many_at_once():
    peak = Peak()

    async def call(k):
        peak.enter(k)
        await asyncio.sleep(0.2)
        peak.leave()
        return k

    async def tool(k):
        return -k

    def plain_returning_a_coroutine(k):  # a Tools step whose tool is async
        return tool(k)

    calls = EnvCalls(1)  # one thread: the async calls must not queue for it
    for k in range(8):
        calls.submit(k, "step", call, k)
    calls.submit(8, "step", plain_returning_a_coroutine, 8)
    done = {d.key: d for d in _all(calls)}
    calls.shutdown()
    assert peak.peak == 8 and [done[k].value for k in range(9)] == [*range(8), -8]
    assert all(d.error is None for d in done.values())


def test_a_call_past_its_limit_is_stopped_in_its_thread_and_the_pool_goes_on():
    spins = [0]
    hooked = threading.Event()

    def spin():
        with on_cancel(hooked.set):
            while True:
                spins[0] += 1

    calls = EnvCalls(1, limit=0.3)
    t0 = time.monotonic()
    calls.submit("hung", "step", spin)
    calls.submit("next", "step", lambda: "ok")  # queued behind the hung call, on a pool of one
    done = {d.key: d for d in _all(calls)}
    assert isinstance(done["hung"].error, Overrun) and done["hung"].seconds == 0.3
    assert done["next"].value == "ok" and time.monotonic() - t0 < 5
    assert hooked.is_set()  # what the call registered with on_cancel ran
    time.sleep(0.2)
    before = spins[0]
    time.sleep(0.3)
    assert spins[0] == before  # the Python loop was stopped, not left spinning
    calls.shutdown()


def test_an_async_call_past_its_limit_is_cancelled():
    cancelled = threading.Event()

    async def hang():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    calls = EnvCalls(4, limit=0.3)
    calls.submit(0, "reset", hang)
    (d,) = _all(calls)
    assert isinstance(d.error, Overrun) and cancelled.wait(5)
    calls.shutdown()


def test_sys_exit_in_a_call_is_its_outcome_not_the_end_of_the_process():
    calls = EnvCalls(2)
    calls.submit(0, "step", lambda: exit(3))
    (d,) = _all(calls)
    assert isinstance(d.error, SystemExit) and d.error.code == 3
    calls.shutdown()


def test_cancel_all_gives_running_calls_up_and_drops_queued_ones():
    started = threading.Event()
    ran = []

    def slow(k):
        started.set()
        ran.append(k)
        while True:
            time.sleep(0.01)

    calls = EnvCalls(1)  # no limit: only cancel_all stops them
    for k in range(3):
        calls.submit(k, "step", slow, k)
    assert started.wait(5)
    calls.cancel_all(grace=2)
    assert calls.in_flight == 0 and ran == [0]  # the queued calls never started
    calls.submit(9, "close", lambda: "closed")  # the pool still serves (a replacement thread)
    assert [d.value for d in _all(calls)] == ["closed"]
    calls.shutdown()


# -- a sandboxed tool that hangs -------------------------------------------------------------------------------------

TOOLS = '''
import os

from rlkit.envs import Tools


def hang(mark: str) -> str:
    """Runs a process named after `mark` that never ends."""
    os.execvp("sleep", ["sleep", mark])


def nap(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "rested"


class Box(Tools):
    tools = [hang, nap]
    timeout = 120.0  # the tool's own limit in the sandbox: far beyond the driver's
'''


def _running(mark: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", mark.encode()]:
                    return True
            except OSError:
                pass
    return False


def _sandbox_kind() -> str:
    from rlkit.sandbox import Sandbox, SandboxUnavailable

    try:
        Sandbox("bwrap").check()
        return "bwrap"
    except SandboxUnavailable:
        return "none"


def test_a_hung_sandboxed_tool_is_killed_when_its_call_is_given_up(tmp_path):
    from rlkit.envs import get_env
    from rlkit.tasks.base import Example

    (tmp_path / "box.py").write_text(TOOLS)
    env = get_env(f"{tmp_path / 'box.py'}:Box:sandbox={_sandbox_kind()}").make()
    env.reset(Example("p0", "x", None, "train"))
    mark = f"{os.getpid() % 1000}.{time.time_ns() % 10**6}"  # a process nobody else runs
    calls = EnvCalls(2, limit=3)
    calls.submit(0, "step", env.step, f"<call>hang({mark!r})</call>")
    deadline = time.monotonic() + 60
    while not _running(mark):  # the tool's process runs in its worker
        assert time.monotonic() < deadline and calls.in_flight
        time.sleep(0.05)
    (d,) = _all(calls)
    assert isinstance(d.error, Overrun)
    deadline = time.monotonic() + 5
    while _running(mark):  # killed with its worker, not left to the tool's own 120 s
        assert time.monotonic() < deadline, "the hung tool's process is still running"
        time.sleep(0.05)
    env.close()
    calls.shutdown()


def test_sandboxed_tools_of_different_trajectories_run_in_workers_of_their_own(tmp_path):
    """Concurrent calls each take a worker of the module's pool (up to the sandbox's workers, the CPU count), and the
    workers are kept for later calls until the last instance closes."""
    from rlkit.envs import get_env
    from rlkit.tasks.base import Example

    (tmp_path / "box.py").write_text(TOOLS)
    spec = get_env(f"{tmp_path / 'box.py'}:Box:sandbox={_sandbox_kind()}")
    envs = [spec.make() for _ in range(4)]
    for env in envs:
        env.reset(Example("p0", "x", None, "train"))
    calls = EnvCalls(4, limit=60)
    for k, env in enumerate(envs):
        calls.submit(k, "step", env.step, "<call>nap(0.5)</call>")
    done = _all(calls)
    assert [d.value.observation for d in done] == [[{"role": "tool", "content": "rested"}]] * 4
    (pool,) = envs[0]._pools
    assert len(pool.idle) == min(4, os.cpu_count() or 1)  # as many workers as calls ran at once, kept
    for env in envs:
        env.close()
    assert not pool.idle
    calls.shutdown()
