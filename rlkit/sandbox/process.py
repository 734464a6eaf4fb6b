"""The sandbox's processes, whatever its backend: the launcher command line (the base interpreter running the
harness: limits, then the uid dropped, then the work), starting it under the backend's command line, and
ending it (`kill`: the backend's way, then the pipes closed).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol


class Limits(Protocol):  # rlkit.sandbox.Limits (not imported: rlkit.sandbox imports this module)
    cpu_s: int
    memory_mb: int
    processes: int
    file_mb: int
    open_files: int


class Sandbox(Protocol):  # rlkit.sandbox.Sandbox
    kind: str
    limits: Limits

    @property
    def backend(self): ...

_HARNESS = Path(__file__).with_name("_harness.py")


def harness_source() -> str:
    return _HARNESS.read_text()


def python() -> str:
    """The base interpreter (the venv's python resolves to it): what runs inside the sandbox."""
    return os.path.realpath(sys.executable)


def rlimits(limits: Limits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": int(limits.cpu_s),
        "RLIMIT_AS": int(limits.memory_mb) << 20,
        "RLIMIT_NPROC": int(limits.processes),
        "RLIMIT_FSIZE": int(limits.file_mb) << 20,
        "RLIMIT_NOFILE": int(limits.open_files),
        "RLIMIT_CORE": 0,
    }


def launcher_argv(sb: Sandbox, mode: str, argv: Sequence[str] = ()) -> list[str]:
    """The base interpreter running the harness's launcher: limits, then the uid dropped, then `mode`."""
    uid = sb.backend.launcher_uid()
    limits = ",".join(f"{k}={v}" for k, v in rlimits(sb.limits).items())
    return [python(), "-I", "-S", "-X", "utf8", "-c", harness_source(), mode, uid, limits, *argv]


def popen(sb: Sandbox, inner: Sequence[str], *, ro_binds: Sequence[Path] = (), env: Mapping[str, str] = {},
          venv: bool = False) -> subprocess.Popen:
    """Start `inner` (a launcher command line) in sb: pipes on stdin/stdout/stderr, its own session. Started from
    the process's spawner thread (`_spawned`), whatever thread asks."""
    backend = sb.backend
    cwd, full_env = backend.process_env(env)
    argv = backend.command(sb, inner, ro_binds=ro_binds, env=env, venv=venv)
    p = _spawned(lambda: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, cwd=cwd, env=full_env, close_fds=True))
    p._rlkit_tmp = cwd  # type: ignore[attr-defined]  (a working directory of the backend's: removed by kill)
    p._rlkit_kind = sb.kind  # type: ignore[attr-defined]
    return p


# bwrap's --die-with-parent (PR_SET_PDEATHSIG) kills a sandbox when the *thread* that started it ends, not the
# process: a sandbox started from an environment call's thread (the driver's --env-workers pool gives a thread up
# after a timeout) or a benchmark's would die with that thread while a trajectory or a worker pool still uses it.
# Every sandbox is therefore started from one daemon thread that lives as long as the process: it dies with rlkit.
_spawner: queue.SimpleQueue | None = None
_spawner_lock = threading.Lock()


def _serve(q: queue.SimpleQueue) -> None:
    while True:
        fn, box, done = q.get()
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the thread that asked)
            box["error"] = e
        done.set()


def _spawned(fn):
    """fn() (a Popen) run on the spawner thread; its value, or its exception raised here."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_spawner,), name="rlkit-sandbox-spawner", daemon=True).start()
        q = _spawner
    box: dict = {}
    done = threading.Event()
    q.put((fn, box, done))
    try:
        done.wait()
    except BaseException:  # interrupted while it starts (^C, the driver's time limit): the sandbox is not kept
        done.wait()
        if "value" in box:
            kill(box["value"])
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def _forget_spawner() -> None:  # in a forked child: the parent's spawner thread is not there
    global _spawner, _spawner_lock
    _spawner, _spawner_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_spawner)


def spawn(sb: Sandbox, argv: Sequence[str], *, ro_binds: Sequence[Path] = (), env: Mapping[str, str] = {},
          venv: bool = False) -> subprocess.Popen:
    """argv run inside the sandbox (stdin, stdout and stderr pipes), in its own session and process group, with
    sb.limits applied and (root) the uid dropped. ro_binds: host paths visible read-only at the same path
    (e.g. the directory of a user's reward function); venv=True also binds sys.prefix (the virtual environment
    with its site-packages) read-only, so trusted user code can import its packages; an editable install's
    source tree is not in it: add it to ro_binds. The caller ends it with `kill(p)` (also after it exited:
    that reaps what the sandbox left)."""
    return popen(sb, launcher_argv(sb, "exec", argv), ro_binds=ro_binds, env=env, venv=venv)


def kill(p: subprocess.Popen) -> None:
    """SIGKILL the sandbox the way its backend ends one, wait for it; then close its pipes and remove its working
    directory. No zombie, no survivor (kind none: a process that left the group survives)."""
    from rlkit.sandbox.backends import backend

    backend(getattr(p, "_rlkit_kind", "bwrap")).end(p)
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
    tmp = getattr(p, "_rlkit_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL p's process group and wait for p."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    p.wait()
