"""Environment calls off the main thread: what lets the turn loop (`rlkit.sampling.driver`) run the `reset`, `step`,
tool and `close` calls of different trajectories at the same time, each under its time limit.

`EnvCalls(workers, limit)`. `submit(key, method, fn, *args)` runs `fn(*args)`:
  - a plain function in a pool of `workers` threads, in submission order (workers=1: one at a time, in that order);
  - an `async def` (or a plain call that returns an awaitable: a `Tools` step whose tool is async) on one event
    loop, in a thread of its own: any number at once, none holding a pool thread while it awaits.
Its outcome comes back, in the order the calls end, from `wait()`/`poll()` as a `Done` (the value, or the exception
it raised: SystemExit included, so an environment that calls sys.exit() cannot end the stage).

The time limit (`limit` seconds per call, 0: none) counts from the call's start, not from its wait for a thread, and a
watchdog thread enforces it, whatever the main thread is doing (sampling a batch, say). A call past it is given up:
  - the hooks it registered with `rlkit.envs.base.on_cancel` run: a sandboxed tool's worker process is killed;
  - a plain call has `Overrun` raised in its thread (a Python loop stops there at once; a call blocked in C, a sleep or
    a socket read, when that returns) and its pool thread is replaced, so the pool keeps its size; an async call is
    cancelled (CancelledError at its `await`);
  - its `Done` says `Overrun` at once; whatever the call returns later is dropped.
`cancel_all()` gives every running call up the same way (the stage is failing) and drops the calls not started.
Nothing here knows about trajectories: the driver owns them, one call at a time per trajectory.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rlkit.envs.base import cancel_scope

GROW_AFTER = 0.002  # seconds a running call takes before the calls queued behind it get threads of their own


class Overrun(BaseException):  # noqa: N818 (raised into a thread; a BaseException: `except Exception` cannot keep it)
    """Raised into a plain call's thread, and reported as its outcome, when it runs past its time limit."""


@dataclass
class Done:
    """A call's outcome: `value`, or `error` (the exception it raised; `Overrun` past its limit)."""

    key: Any
    method: str
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0  # from its start to its end (its limit, for an overrun)


class _Call:
    __slots__ = ("key", "method", "fn", "args", "hooks", "started", "deadline", "thread", "future", "reported")

    def __init__(self, key, method: str, fn, args: tuple) -> None:
        self.key, self.method, self.fn, self.args = key, method, fn, args
        self.hooks: list = []  # what `on_cancel` registered while it runs
        self.started = 0.0
        self.deadline: float | None = None
        self.thread: _Thread | None = None  # the pool thread running it (a plain call)
        self.future = None  # the event loop's future (an async call)
        self.reported = False


class _Thread:
    __slots__ = ("thread", "call", "abandoned")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.call: _Call | None = None  # the plain call it runs now (None between calls)
        self.abandoned = False  # its call overran: it ends once that call returns, a new thread has its place


class EnvCalls:
    """A pool of `workers` threads and an event loop for environment calls, each limited to `limit` seconds
    (see the module docstring). Submit from one thread (the driver's); the results come back to it."""

    def __init__(self, workers: int, limit: float = 0.0) -> None:
        self.workers, self.limit = max(1, int(workers)), float(limit or 0)
        self.in_flight = 0  # submitted and not yet returned by wait()/poll()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a plain call to run, or closing
        self._watch = threading.Condition(self._lock)  # a new deadline, or closing
        self._todo: deque[_Call] = deque()
        self._threads: list[_Thread] = []
        self._idle = 0
        self._running: set[_Call] = set()  # started and not yet reported
        self._out: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: threading.Thread | None = None
        self._closed = False

    # -- submitting ---------------------------------------------------------------------------------------------------
    def submit(self, key, method: str, fn, *args) -> None:
        """Run `fn(*args)` (see the module docstring); its `Done` carries `key` and `method`."""
        call = _Call(key, method, fn, args)
        self.in_flight += 1
        if inspect.iscoroutinefunction(fn):
            self._start_async(call, None)
            return
        with self._lock:
            self._todo.append(call)
            if not self._alive():
                self._spawn()
            elif self._idle:
                self._work.notify()
            if len(self._todo) > self._idle:  # more calls than idle threads: the watchdog may add threads
                self._watching().notify()

    def _alive(self) -> int:  # with the lock
        return sum(not t.abandoned for t in self._threads)

    def _watching(self) -> threading.Condition:  # with the lock: the watchdog started
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._guard, name="rlkit-env-watchdog", daemon=True)
            self._watchdog.start()
        return self._watch

    def _spawn(self) -> None:  # with the lock
        t = _Thread()
        self._threads.append(t)
        t.thread = _runner(lambda: self._serve(t))

    def _begin(self, call: _Call) -> None:  # with the lock
        call.started = time.monotonic()
        self._running.add(call)
        if self.limit:
            call.deadline = call.started + self.limit
            self._watching().notify()

    # -- a pool thread -------------------------------------------------------------------------------------------------
    def _serve(self, me: _Thread) -> bool:
        """A pool thread's loop; True when it ends clean (closing: its thread may serve another pool)."""
        try:
            while True:
                with self._lock:
                    while not self._todo and not self._closed and not me.abandoned:
                        self._idle += 1
                        self._work.wait()
                        self._idle -= 1
                    if not self._todo or me.abandoned:
                        return not me.abandoned
                    call = self._todo.popleft()
                    call.thread, me.call = me, call
                    self._begin(call)
                self._run(call, me)
                if me.abandoned:
                    return False
        except Overrun:  # raised into it as its call ended: the thread was given up anyway
            return False
        finally:
            with self._lock:
                me.call = None
                if me in self._threads:
                    self._threads.remove(me)

    def _run(self, call: _Call, me: _Thread) -> None:
        try:
            try:
                with cancel_scope(call.hooks):
                    value, error = call.fn(*call.args), None
            finally:
                with self._lock:
                    me.call = None  # from here on no Overrun is raised into this thread
        except BaseException as e:  # noqa: BLE001 (every outcome goes back to the driver: SystemExit too)
            value, error = None, e
        if error is None and inspect.isawaitable(value):
            self._start_async(call, value)  # a Tools step whose tool is async: awaited on the loop, same deadline
            return
        self._finish(call, value, error)

    def _finish(self, call: _Call, value, error: BaseException | None) -> None:
        with self._lock:
            if call.reported:
                return  # given up already
            call.reported = True
            self._running.discard(call)
        self._out.put(Done(call.key, call.method, value, error, time.monotonic() - call.started))

    # -- the event loop ------------------------------------------------------------------------------------------------
    def _start_async(self, call: _Call, awaitable) -> None:
        loop = self._event_loop()

        async def run():
            with cancel_scope(call.hooks):
                return await (awaitable if awaitable is not None else call.fn(*call.args))

        with self._lock:
            if awaitable is None:
                self._begin(call)
            call.future = asyncio.run_coroutine_threadsafe(run(), loop)
        call.future.add_done_callback(lambda f: self._finish(call, *_outcome(f)))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = self._loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="rlkit-env-loop", daemon=True).start()
            return self._loop

    # -- the watchdog: time limits, and threads added for slow calls --------------------------------------------------
    def _guard(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                due = [c for c in self._running if c.deadline is not None and c.deadline <= now]
                if due:
                    self._lock.release()
                    try:
                        for c in due:
                            self._give_up(c)
                    finally:
                        self._lock.acquire()
                    continue
                wake = [c.deadline for c in self._running if c.deadline is not None]
                grow = self._grow(now)
                if grow is not None:
                    wake.append(grow)
                self._watch.wait(max(0.0, min(wake) - now) if wake else None)

    def _grow(self, now: float) -> float | None:  # with the lock
        """More threads when calls queue behind a call that has run GROW_AFTER seconds: a slow environment gets up to
        `workers`, an instant one keeps the few it needs (starting a thread costs more than its calls). -> when to
        look again, or None."""
        backlog, room = len(self._todo) - self._idle, self.workers - self._alive()
        if backlog <= 0 or room <= 0:
            return None
        started = [c.started for c in self._running if c.thread is not None and c.thread.call is c]
        if not started or now - min(started) < GROW_AFTER:
            return (min(started) if started else now) + GROW_AFTER
        for _ in range(min(backlog, room)):
            self._spawn()
        return None

    def _give_up(self, call: _Call) -> None:
        """The call overran (or the stage is failing): report it, stop it as far as it can be stopped."""
        with self._lock:
            if call.reported:
                return
            call.reported = True
            self._running.discard(call)
            me = call.thread
            if me is not None and me.call is call:  # a plain call still running: its thread is written off
                me.abandoned = True
                if self._todo and not self._closed:
                    self._spawn()
                _raise_in(me.thread, Overrun)
        for hook in list(call.hooks):  # a sandboxed tool's worker process: killed
            try:
                hook()
            except Exception:  # noqa: BLE001 (best effort: the call is given up either way)
                pass
        if call.future is not None:
            call.future.cancel()
        self._out.put(Done(call.key, call.method, None, Overrun(), self.limit))

    # -- the driver's side ---------------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> list[Done]:
        """The calls that ended: at least one (blocking up to `timeout` seconds; None: until one ends), and every
        other that has ended by then."""
        if not self.in_flight:
            return []
        try:
            first = [self._out.get(timeout=timeout)]
        except queue.Empty:
            return []
        return self._taken(first)

    def poll(self) -> list[Done]:
        """The calls that have ended, without waiting."""
        return self._taken([]) if self.in_flight else []

    def _taken(self, got: list[Done]) -> list[Done]:
        while True:
            try:
                got.append(self._out.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(got)
        return got

    def cancel_all(self, grace: float = 1.0) -> None:
        """Drop the calls not started and give the running ones up (as past their limit), then wait up to `grace`
        seconds for them to let go (a plain call's thread to leave it, an async call to end); nothing is in flight
        after it."""
        with self._lock:
            self._todo.clear()
            running = list(self._running)
        for call in running:
            self._give_up(call)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            with self._lock:
                busy = any(t.call is not None for t in self._threads) or any(
                    c.future is not None and not c.future.done() for c in running)
            if not busy:
                break
            time.sleep(0.01)
        self.in_flight = 0
        self._out = queue.SimpleQueue()

    def shutdown(self) -> None:
        """Idle threads end, the event loop stops; a call still running is left to finish on its own (daemon threads)."""
        with self._lock:
            self._closed = True
            self._work.notify_all()
            self._watch.notify_all()
            loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


class _Runner:
    """A daemon thread running the jobs it is handed, one at a time; between pools it waits in `_SPARE` (starting a
    thread costs more than an instant environment's call: a stage's batches reuse them)."""

    def __init__(self) -> None:
        self.ready = threading.Condition(threading.Lock())
        self.job = None
        self.thread = threading.Thread(target=self._loop, name="rlkit-env", daemon=True)
        self.thread.start()

    def give(self, job) -> None:
        with self.ready:
            self.job = job
            self.ready.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self.ready:
                    while self.job is None:
                        self.ready.wait()
                    job, self.job = self.job, None
                if not job():  # its call was given up: the thread is not reused
                    return
                with _SPARE_LOCK:
                    _SPARE.append(self)
        except Overrun:
            return


_SPARE: list[_Runner] = []
_SPARE_LOCK = threading.Lock()


def _runner(job) -> threading.Thread:
    """A thread (a spare one, or a new one) running `job()`."""
    with _SPARE_LOCK:
        r = _SPARE.pop() if _SPARE else None
    if r is None:
        r = _Runner()
    r.give(job)
    return r.thread


def _outcome(f) -> tuple[Any, BaseException | None]:
    if f.cancelled():
        return None, Overrun()
    e = f.exception()
    return (None, e) if e is not None else (f.result(), None)


def _raise_in(thread: threading.Thread | None, exc: type[BaseException]) -> None:
    """Raise `exc` in `thread` at its next Python instruction (CPython's PyThreadState_SetAsyncExc)."""
    if thread is None or thread.ident is None:
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))
