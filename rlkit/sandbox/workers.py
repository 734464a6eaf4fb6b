"""Sandboxed `--reward-fn` workers: with `--sandbox bwrap` (`load_all(..., sandbox=)`; a Sandbox of kind "none"
runs the same workers unisolated) a user's reward function runs in worker processes started through
`rlkit.sandbox.spawn`, not in the stage, so a verifier may execute the model's
output without trusting it (the function itself is the user's own, trusted code).

Each worker runs `rlkit/sandbox/reward_worker.py` (standard library only; its text is passed with
`python -I -c`, so the sandbox needs no view of rlkit or the project) with the base interpreter. The
sandbox shows it, read-only: the Python installation and the venv (`venv=True`: the function may import
the venv's packages), and the function's own folder (a `FILE.py:FUNC` reference) or its top-level package
(a `package.module:FUNC` reference found outside the venv). The worker imports the function once, then
runs each call in a process forked for that call (see reward_worker.py: rows cannot reach one another).

Host side, all in the stage's main thread: one-row functions get their rows spread over the workers
(`Sandbox.workers`, started as needed and kept for the stage's later chunks), one row per request,
results in row order; a batched function gets each batch in one worker. Requests and replies are JSON
lines (no pickle). `--reward-timeout` is enforced here, per call: a call that overruns has its worker's
sandbox killed (its whole process group: nothing survives) and is reported as the unsandboxed timeout is.
After a failure no later row is sent; the rows before it still finish, so the error reported is the first
failing row's, as in the unsandboxed stage. `close()` kills every worker (the stage's end); a worker left
over at interpreter exit is killed then too, and bwrap's --die-with-parent covers a killed stage.

Limits: the sandbox's rlimits apply to the workers and every call (memory, processes, file size, open
files); the CPU time limit counts per call (`max(Limits.cpu_s, --reward-timeout + 1)` seconds), the wall
clock per call is `--reward-timeout`.
"""

from __future__ import annotations

import base64
import json
import math
import os
import select
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path

from rlkit.errors import RlkitError

START_S = 60.0  # seconds a worker may take to import the function (or --reward-timeout, if longer)
WORKER_CPU_S = 1 << 30  # the worker's own RLIMIT_CPU (each call sets its own, see reward_worker.py)
STDERR_CAP = 1 << 20  # bytes of the function's stderr/prints passed on to the stage's stderr
REPLY_CAP = 64 << 20  # bytes of one reply line


def worker_source() -> str:
    return (Path(__file__).with_name("reward_worker.py")).read_text()


def where_from(ref) -> tuple[dict, list[Path]]:
    """(the worker's CONFIG, the host paths the sandbox shows read-only) for the function that `ref` (an
    `rlkit.plugins.user_code.Ref`, already imported on the host) names."""
    import site

    prefixes = [Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()]

    def outside(p: Path) -> bool:
        return not any(p == q or q in p.parents for q in prefixes)

    site_dirs = [d for d in site.getsitepackages() if not outside(Path(d).resolve())] if sys.prefix != sys.base_prefix \
        else []
    if ref.is_file:
        path = Path(ref.source).resolve()
        data = base64.b64encode(path.read_bytes()).decode()
        return {"is_file": True, "source": str(path), "data": data, "name": ref.name, "site_dirs": site_dirs}, [path.parent]
    top = sys.modules.get(ref.source.split(".")[0])
    places = list(getattr(top, "__path__", None) or []) or ([top.__file__] if getattr(top, "__file__", None) else [])
    binds = [Path(p).resolve() for p in places]
    binds = [p for p in binds if outside(p)]
    return ({"is_file": False, "source": ref.source, "name": ref.name, "site_dirs": site_dirs,
             "paths": sorted({str(p.parent) for p in binds})}, binds)


class _Worker:
    """One worker process and its pipes (non-blocking), with what is half read or half written."""

    def __init__(self, proc, deadline: float | None, sandbox):
        self.proc, self.sandbox = proc, sandbox
        self.deadline = deadline  # starting: the start-up limit; busy: the call's
        self.ready = False
        self.row: int | None = None  # the request in flight
        self.inbuf = bytearray()
        self.outbuf = b""
        self.tail = b""  # the end of its stderr, for a message when it dies
        self.err_open = True
        for f in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)

    def send(self, data: bytes, deadline: float | None, row: int) -> None:
        self.outbuf, self.deadline, self.row = data, deadline, row
        self.flush()

    def flush(self) -> bool:
        """Write what the pipe takes now; False when the worker no longer reads (it died)."""
        try:
            while self.outbuf:
                self.outbuf = self.outbuf[os.write(self.proc.stdin.fileno(), self.outbuf):]
        except BlockingIOError:
            pass
        except OSError:  # BrokenPipeError: it is gone
            self.outbuf = b""
            return False
        return True

    def lines(self) -> list[bytes] | None:
        """Complete lines read from its stdout now; None at end of file (it exited)."""
        eof = False
        try:
            while True:
                b = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not b:
                    eof = True
                    break
                self.inbuf += b
                if len(self.inbuf) > REPLY_CAP:
                    eof = True
                    break
        except BlockingIOError:
            pass
        *done, rest = self.inbuf.split(b"\n")
        self.inbuf = bytearray(rest)
        return None if eof and not done else done

    def drain_stderr(self, budget: list[int]) -> None:
        """Pass its stderr on to the stage's (up to STDERR_CAP bytes in all), keeping the last line."""
        try:
            while True:
                b = os.read(self.proc.stderr.fileno(), 1 << 16)
                if not b:
                    self.err_open = False
                    return
                self.tail = (self.tail + b)[-4096:]
                if budget[0] > 0:
                    out = b[:budget[0]]
                    budget[0] -= len(out)
                    try:
                        sys.stderr.buffer.write(out)  # type: ignore[union-attr]
                        sys.stderr.flush()
                    except (AttributeError, ValueError, OSError):
                        pass
        except (BlockingIOError, OSError):
            return

    def last_words(self) -> str:
        lines = [x.strip() for x in self.tail.decode(errors="replace").splitlines() if x.strip()]
        return f": {lines[-1][:200]}" if lines else ""

    def status(self) -> str:
        """How it ended (after kill)."""
        import signal

        rc = self.proc.returncode
        if rc is None:
            return "stopped answering"
        sig = self.sandbox.backend.exit_signal(rc)  # bwrap: 128 + signal
        if sig in signal.Signals._value2member_map_:
            return f"was killed by {signal.Signals(sig).name}"
        return f"exited with status {rc}"


class Workers:
    """The sandboxed worker processes of one reward function (see the module docstring)."""

    def __init__(self, sandbox, ref, name: str, label: str, timeout: float):
        self.config, self.binds = where_from(ref)
        per_call = sandbox.limits.cpu_s if not timeout else max(sandbox.limits.cpu_s, math.ceil(timeout) + 1)
        self.config["cpu_s"] = per_call
        if sandbox.backend.pid_namespace:  # a PID namespace of its own: the worker kills what a call left behind
            self.config["sweep"], self.config["host_pidns"] = True, os.readlink("/proc/self/ns/pid")
        self.sandbox = replace(sandbox, limits=replace(sandbox.limits, cpu_s=WORKER_CPU_S))
        self.size = sandbox.n_workers
        self.name, self.label, self.timeout = name, label, timeout
        self.live: list[_Worker] = []
        self._budget = [STDERR_CAP]
        self._finalizer = weakref.finalize(self, _kill_all, self.live)

    def _what(self) -> str:
        return f"--reward-fn {self.name} ({self.label})"

    def _source(self) -> str:
        """The Python program each worker runs (`python -I -c SOURCE`)."""
        return worker_source()

    def _spawn(self) -> None:
        from rlkit.sandbox.process import spawn

        argv = [os.path.realpath(sys.executable), "-I", "-c", self._source()]
        proc = spawn(self.sandbox, argv, ro_binds=self.binds, venv=True)
        w = _Worker(proc, time.monotonic() + max(START_S, self.timeout), self.sandbox)
        self.live.append(w)
        w.outbuf = json.dumps(self.config).encode() + b"\n"  # its CONFIG, written as its pipe takes it
        w.flush()

    def begin(self, k: int = 1) -> None:
        """Start workers up to min(k, size), without waiting for them (`start` or `run` waits)."""
        for _ in range(min(self.size, k) - len(self.live)):
            self._spawn()

    def start(self, k: int = 1) -> None:
        """At least min(k, size) workers, each ready (the function imported in the sandbox)."""
        self.run([], want=k)

    def close(self) -> None:
        """Kill every worker (and all they started); idempotent."""
        _kill_all(self.live)

    def _drop(self, w: _Worker) -> None:
        from rlkit.sandbox.process import kill

        w.drain_stderr(self._budget)
        kill(w.proc)
        self.live.remove(w)

    def run(self, payloads: list[bytes], want: int | None = None) -> list[dict | None]:
        """The replies to `payloads` (JSON request lines), in order, each a dict: the worker's reply, or
        {"timeout": True}, or {"died": "how"}. A reply that is not {"values": ...} is a failure: no later
        payload is sent (those stay None), the earlier ones all get their replies."""
        n = len(payloads)
        self.begin(want if want is not None else n)
        replies: list[dict | None] = [None] * n
        nxt, stop = 0, n
        while True:
            now = time.monotonic()
            for w in self.live:
                if w.ready and w.row is None and nxt < stop:
                    deadline = now + self.timeout if self.timeout else None
                    w.send(payloads[nxt], deadline, nxt)
                    nxt += 1
            for w in [w for w in self.live if w.row is not None and w.row > stop]:
                self._drop(w)  # a row after the first failure: never looked at, and its reply must not come later
            busy = [w for w in self.live if not w.ready or w.row is not None]
            if not busy:
                return replies
            deadlines = [w.deadline for w in busy if w.deadline is not None]
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            poll = select.poll()
            fds = {}
            for w in self.live:
                fds[w.proc.stdout.fileno()] = (w, "out")
                poll.register(w.proc.stdout.fileno(), select.POLLIN)
                if w.err_open:
                    fds[w.proc.stderr.fileno()] = (w, "err")
                    poll.register(w.proc.stderr.fileno(), select.POLLIN)
                if w.outbuf:
                    fds[w.proc.stdin.fileno()] = (w, "in")
                    poll.register(w.proc.stdin.fileno(), select.POLLOUT)
            events = poll.poll(None if wait is None else wait * 1000 + 1)
            for fd, _ in events:
                w, what = fds[fd]
                if w not in self.live:
                    continue
                if what == "err":
                    w.drain_stderr(self._budget)
                elif what == "in":
                    if not w.flush():
                        stop = self._died(w, replies, stop)
                else:
                    stop = self._read(w, replies, stop)
            now = time.monotonic()
            for w in list(self.live):
                if w.deadline is not None and now >= w.deadline and (not w.ready or w.row is not None):
                    if not w.ready:
                        self._drop(w)
                        raise RlkitError(f"{self._what()}: its sandboxed worker did not start within "
                                         f"{max(START_S, self.timeout):g} s (importing the function)")
                    replies[w.row] = {"timeout": True}
                    stop = min(stop, w.row)
                    self._drop(w)

    def _read(self, w: _Worker, replies: list, stop: int) -> int:
        lines = w.lines()
        if lines is None:
            return self._died(w, replies, stop)
        for line in lines:
            try:
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError
            except ValueError:
                return self._died(w, replies, stop, "sent an unreadable reply")
            if not w.ready:
                if "error" in msg:
                    self._drop(w)
                    raise RlkitError(f"{self._what()}: importing it in the sandbox raised {msg['error']} (the sandbox "
                                     "shows the function's folder, the Python installation and the venv, read-only)")
                w.ready, w.deadline = True, None
                continue
            if w.row is None:
                return self._died(w, replies, stop, "sent a reply nobody asked for")
            replies[w.row] = msg
            if "values" not in msg:
                stop = min(stop, w.row)
            w.row, w.deadline = None, None
        return stop

    def _died(self, w: _Worker, replies: list, stop: int, how: str | None = None) -> int:
        row, ready = w.row, w.ready
        self._drop(w)
        how = how or w.status()
        if not ready:
            raise RlkitError(f"{self._what()}: its sandboxed worker {how} before it was ready{w.last_words()}")
        if row is None:
            raise RlkitError(f"{self._what()}: its sandboxed worker {how} between calls{w.last_words()}")
        replies[row] = {"died": f"its sandboxed worker {how}{w.last_words()}"}
        return min(stop, row)


def _kill_all(live: list[_Worker]) -> None:
    """End every worker of `live` (emptied): end of input first (an idle worker exits at once), then
    `rlkit.sandbox.kill` (the sandbox and all in it, waited for)."""
    from rlkit.sandbox.process import kill

    for w in live:
        try:
            w.proc.stdin.close()
        except OSError:
            pass
    while live:
        kill(live.pop().proc)
