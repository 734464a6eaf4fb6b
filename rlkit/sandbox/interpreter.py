"""A Python interpreter in a sandbox, for tools that run model-written code (the built-in `python` tool,
`rlkit.envs.python`; a user's own tool, docs/sandbox.md).

    with Interpreter(Sandbox("bwrap", limits=Limits(memory_mb=512)), timeout=5) as py:
        py.run("x = 6 * 7").status          # 0
        py.run("print(x)").stdout           # '42\\n': the names of one call are there in the next
        py.run("while True: pass").ended    # 'timeout': the interpreter was killed (and its names with it)

The interpreter (`_repl.py`, stdlib only, the base interpreter with `-I -S`, as the code task's programs) starts in
a sandbox of its own at the first `run` and lives until `close()` (or a timeout, a crash, an `os._exit`: the next
`run` starts a fresh one, with no names); `stateful=False` starts a fresh one for every call. What it sees and may
do is the sandbox's (docs/sandbox.md): no network, a read-only system, a private tmpfs at /tmp, its own PID
namespace, the limits of `sandbox.limits` (memory, processes, file size, open files) with CPU seconds per call
`max(limits.cpu_s, timeout + 1)`; `timeout` is the wall clock per call, after which the whole sandbox is killed.
`close()` (and `kill()`, from any thread) ends the sandbox with every process the code started; bwrap's
--die-with-parent ends it with the stage, however the stage ends.

Each call returns a `CodeRun`: the call's stdout (its first `max_output` characters) and stderr (its last
`max_output` characters: a traceback's end is the error), how many characters of each were cut, the exit status
(0; 1 for an uncaught exception, whose traceback shows the model's own frames only; `sys.exit`'s code), or
`ended`: why the interpreter did not answer. Interpreters of different threads run at once: nothing here is
shared between them but the sandbox's probe.
"""

from __future__ import annotations

import json
import math
import os
import select
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from rlkit.sandbox.sandbox import Sandbox

START_S = 30.0  # seconds the interpreter may take to start
CPU_HARD_S = 1 << 30  # the interpreter's hard RLIMIT_CPU (each call sets its own soft limit)
REPLY_CAP = 16 << 20  # bytes of one reply line (two cut streams of JSON text)


def repl_source() -> str:
    return Path(__file__).with_name("_repl.py").read_text()


@dataclass(frozen=True)
class CodeRun:
    """One call's result (see the module docstring)."""

    stdout: str = ""
    stderr: str = ""
    status: int | None = None  # the exit status; None when the interpreter did not answer (`ended` says why)
    stdout_cut: int = 0  # characters of stdout after the first max_output, not shown
    stderr_cut: int = 0  # characters of stderr before the last max_output, not shown
    ended: str | None = None  # "timeout", or how the interpreter died ("was killed by SIGXCPU (CPU time limit)")

    @property
    def ok(self) -> bool:
        return self.status == 0

    def text(self, timeout: float | None = None) -> str:
        """The observation a model sees (docs/environments.md, the Python interpreter tool): stdout without its
        trailing newlines, then `stderr:` and stderr, then `exit status: N` when not 0, or what ended the
        interpreter; `(no output)` for nothing at all."""
        parts = []
        out = self.stdout.rstrip("\n")
        if out or self.stdout_cut:
            parts.append(out + (f"...[{self.stdout_cut} characters cut]" if self.stdout_cut else ""))
        err = self.stderr.rstrip("\n")
        if err or self.stderr_cut:
            parts.append("stderr:\n" + (f"[{self.stderr_cut} characters cut]..." if self.stderr_cut else "") + err)
        if self.ended == "timeout":
            limit = f" of {timeout:g} s" if timeout else ""
            parts.append(f"timeout: the code ran past its time limit{limit}; the interpreter was restarted (its "
                         "names are lost)")
        elif self.ended is not None:
            parts.append(f"the interpreter {self.ended}; it was restarted (its names are lost)")
        elif self.status:
            parts.append(f"exit status: {self.status}")
        return "\n".join(parts) if parts else "(no output)"


class Interpreter:
    """A sandboxed Python interpreter kept across calls (see the module docstring)."""

    def __init__(self, sandbox: Sandbox | str = "bwrap", timeout: float = 10.0, max_output: int = 1000,
                 stateful: bool = True) -> None:
        sb = Sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        if not timeout > 0:
            raise ValueError(f"interpreter timeout must be > 0, got {timeout!r}")
        if not (isinstance(max_output, int) and max_output > 0):
            raise ValueError(f"interpreter max_output must be an integer > 0, got {max_output!r}")
        self.timeout, self.max_output, self.stateful = float(timeout), max_output, stateful
        self.cpu_s = max(sb.limits.cpu_s, math.ceil(self.timeout) + 1)
        self.sandbox = replace(sb, limits=replace(sb.limits, cpu_s=CPU_HARD_S))
        self._proc = None
        self._calls = 0  # requests sent: each reply names its request's (a line the code forged for another is skipped)
        self._lock = threading.Lock()  # _proc between run() and kill() from another thread (this one's only)
        self._live: list = []  # the process, for the finalizer (an interpreter dropped without close())
        weakref.finalize(self, _end_all, self._live)

    def __enter__(self) -> Interpreter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The host pid of the running sandbox (bwrap's), or None when none runs."""
        p = self._proc
        return p.pid if p is not None else None

    def check(self) -> None:
        """SandboxUnavailable (one line) unless the sandbox starts here."""
        self.sandbox.check()

    def run(self, code: str) -> CodeRun:
        """Run `code` in the interpreter (started now if none runs): its `CodeRun`."""
        if self._proc is None:
            started = self._start()
            if isinstance(started, CodeRun):
                return started
        self._calls += 1
        try:
            payload = json.dumps({"code": code, "id": self._calls}).encode() + b"\n"
        except (TypeError, ValueError) as e:  # not text
            return CodeRun(stderr=f"the code cannot be sent: {e}", status=1)
        reply = self._exchange(payload, time.monotonic() + self.timeout, self._calls)
        if isinstance(reply, CodeRun):
            if not self.stateful:
                self.close()
            return reply
        fields = (reply.get("out"), reply.get("err"), reply.get("status"), reply.get("out_cut"), reply.get("err_cut"))
        if not all(isinstance(v, str) for v in fields[:2]) or not all(type(v) is int for v in fields[2:]):
            return self._died(self._proc, "sent a malformed reply")  # the code wrote it on the pipe itself
        if not self.stateful:
            self.close()
        return CodeRun(*fields)

    def kill(self) -> None:
        """End the sandbox now, from any thread (the call waiting on it returns `ended`)."""
        from rlkit.sandbox.backends import backend

        p = self._proc
        if p is not None:
            backend(self.sandbox.kind).end(p)

    def close(self) -> None:
        """End the sandbox and every process in it (idempotent); a later `run` starts a fresh interpreter."""
        with self._lock:
            p, self._proc = self._proc, None
            if p is not None and p in self._live:
                self._live.remove(p)
        if p is not None:
            _end(p)

    # -- the process -------------------------------------------------------------------------------------------------
    def _start(self) -> CodeRun | None:
        from rlkit.sandbox.process import python, spawn

        self.sandbox.check()
        argv = [python(), "-I", "-S", "-X", "utf8", "-c", repl_source(), str(self.max_output), str(self.cpu_s)]
        p = spawn(self.sandbox, argv)
        for f in (p.stdout, p.stderr):
            os.set_blocking(f.fileno(), False)
        p._rlkit_buf = bytearray()  # type: ignore[attr-defined]
        with self._lock:
            self._proc = p
            self._live.append(p)
        reply = self._exchange(None, time.monotonic() + START_S, None)
        if isinstance(reply, CodeRun):
            return CodeRun(stderr=f"the interpreter did not start: {reply.ended}", ended=reply.ended)
        return None

    def _exchange(self, payload: bytes | None, deadline: float, ident: int | None) -> dict | CodeRun:
        """Send payload (None: nothing) and read the reply to request `ident` (None: the first line) before the
        deadline, skipping other lines (what the code wrote on the pipe itself); a CodeRun with `ended` when none
        comes (the sandbox is then ended)."""
        p = self._proc
        assert p is not None
        if payload is not None:
            try:
                p.stdin.write(payload)
                p.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return self._died(p)
        buf = p._rlkit_buf
        while True:
            while b"\n" in buf:
                line, _, rest = bytes(buf).partition(b"\n")
                buf[:] = rest
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(msg, dict) and (ident is None or msg.get("id") == ident):
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                return CodeRun(ended="timeout")
            try:
                ready, _, _ = select.select([p.stdout], [], [], left)
            except (ValueError, OSError):  # closed under us (killed from another thread)
                return self._died(p)
            if not ready:
                continue
            try:
                chunk = os.read(p.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                return self._died(p)
            buf += chunk
            if len(buf) > REPLY_CAP:
                return self._died(p, "sent a reply too long")

    def _died(self, p, how: str | None = None) -> CodeRun:
        import signal

        self.close()
        if how is None:
            rc = p.returncode
            sig = self.sandbox.backend.exit_signal(rc) if rc is not None else 0
            if sig in signal.Signals._value2member_map_:
                name = signal.Signals(sig).name
                how = f"was killed by {name}" + (" (CPU time limit)" if name == "SIGXCPU" else "")
            else:
                how = f"exited with status {rc}"
        return CodeRun(ended=how)


def _end(p) -> None:
    from rlkit.sandbox.process import kill

    try:
        p.stdin.close()
    except OSError:
        pass
    kill(p)


def _end_all(live: list) -> None:
    while live:
        _end(live.pop())


def run_code(code: str, sandbox: Sandbox | str = "bwrap", timeout: float = 10.0, max_output: int = 1000) -> CodeRun:
    """`code` run once in a fresh sandboxed interpreter (no state kept)."""
    with Interpreter(sandbox, timeout, max_output, stateful=False) as py:
        return py.run(code)

