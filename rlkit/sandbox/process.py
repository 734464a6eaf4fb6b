"""The sandbox's processes, whatever its backend: the launcher command line (the base interpreter running the
harness: limits, then the uid dropped, then the work), starting it under the backend's command line, and
ending it (`kill`: the backend's way, then the pipes closed).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
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
    """Start `inner` (a launcher command line) in sb: pipes on stdin/stdout/stderr, its own session."""
    backend = sb.backend
    cwd, full_env = backend.process_env(env)
    p = subprocess.Popen(backend.command(sb, inner, ro_binds=ro_binds, env=env, venv=venv), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd=cwd,
                         env=full_env, close_fds=True)
    p._rlkit_tmp = cwd  # type: ignore[attr-defined]  (a working directory of the backend's: removed by kill)
    p._rlkit_kind = sb.kind  # type: ignore[attr-defined]
    return p


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
