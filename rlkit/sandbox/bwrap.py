"""The sandbox's command line and process handling: bubblewrap (`bwrap`) around the base Python interpreter.

A sandbox sees: /usr (and the /bin, /lib, /lib64 links into it) and the base interpreter's prefix, read-only;
a fresh /proc of its own PID namespace, a minimal /dev, and a private writable tmpfs at /tmp, its working
directory. No network (a new network namespace with only a down loopback), no IPC or UTS sharing, an empty
environment, no home directory, no project directory, no outputs. `--die-with-parent` and `--new-session`.

Started as root (here and in CI), bwrap runs without a user namespace (the kernel never applies RLIMIT_NPROC
to a process whose real uid is the host's root, user namespace or not): every capability is dropped but
SETUID/SETGID, and the launcher inside sets the limits and then drops to an unprivileged uid of its own before
the untrusted code runs (one uid per live sandbox of this process, so that one program's fork bomb does not
use up the next one's process count). Not root: `--unshare-all` (a user namespace, with its own process
count). Kind "none" runs the same launcher as a plain subprocess in a temporary directory: the same limits and
timeout, none of the isolation.

Ending a sandbox (`kill`) kills its PID namespace's init, which takes every process of the namespace with it
(double-forked daemons included), waits for bwrap to reap it, then kills the process group and waits: when
`kill` returns, no process of the sandbox exists.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
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

_HARNESS = Path(__file__).with_name("_harness.py")
_uids = itertools.count()
_uid_lock = threading.Lock()


def harness_source() -> str:
    return _HARNESS.read_text()


def python() -> str:
    """The base interpreter (the venv's python resolves to it): what runs inside the sandbox."""
    return os.path.realpath(sys.executable)


def bwrap_path() -> str | None:
    """bwrap as found on PATH now (RLKIT_BWRAP names another), or None."""
    given = os.environ.get("RLKIT_BWRAP")
    if given:
        return given if os.access(given, os.X_OK) else None
    return shutil.which("bwrap")


def _next_uid() -> int:
    """An unprivileged uid for one sandbox, distinct among this process's live sandboxes (1,024 at a time)
    and, by the pid, from other rlkit processes' (uids 1,000,000 and up: no account has them)."""
    with _uid_lock:
        n = next(_uids) % 1024
    return uid_base() + n


def uid_base() -> int:
    """The first of this process's 1,024 sandbox uids (root only)."""
    return 1_000_000 + (os.getpid() % 1_000_000) * 1024


def rlimits(limits: Limits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": int(limits.cpu_s),
        "RLIMIT_AS": int(limits.memory_mb) << 20,
        "RLIMIT_NPROC": int(limits.processes),
        "RLIMIT_FSIZE": int(limits.file_mb) << 20,
        "RLIMIT_NOFILE": int(limits.open_files),
        "RLIMIT_CORE": 0,
    }


def _read_only_roots(venv: bool) -> list[str]:
    roots = ["/usr"]
    for p in (sys.base_prefix, sys.base_exec_prefix, str(Path(python()).parent.parent)):
        p = os.path.realpath(p)
        if p not in roots and not any(p == r or p.startswith(r + "/") for r in roots):
            roots.append(p)
    if venv:
        roots.append(sys.prefix)
    return roots


def command(sb: Sandbox, argv: Sequence[str], *, ro_binds: Sequence[Path] = (), env: Mapping[str, str] = {},
            venv: bool = False, bwrap: str | None = None) -> list[str]:
    """The full command line running argv (a command inside the sandbox) under sb's kind."""
    if sb.kind == "none":
        return list(argv)
    exe = bwrap or bwrap_path() or "bwrap"
    if os.geteuid() == 0:
        ns = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        ns = ["--unshare-all"]
    cmd = [exe, *ns, "--die-with-parent", "--new-session", "--clearenv",
           "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
           "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    cmd += ["--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
            "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    size = max(1, int(sb.limits.file_mb)) << 20
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(size), "--tmpfs", "/tmp"]
    covered, made = ["/usr", "/proc", "/dev", "/tmp"], set()
    # the binds come after /tmp's tmpfs (a bind under /tmp would be hidden under it), each on parents made 0755
    # (bwrap would give them the host's mode: /root's 0700 closes the base interpreter to the dropped uid)
    for p in [*_read_only_roots(venv)[1:], *(os.path.realpath(p) for p in ro_binds)]:
        if any(p == c or p.startswith(c + "/") for c in covered if c != "/tmp"):
            continue  # already in view
        for a in reversed(Path(p).parents):
            a = str(a)
            if a != "/" and a not in made and a not in covered:
                made.add(a)
                cmd += ["--perms", "0755", "--dir", a]
        cmd += ["--ro-bind", p, p]
        covered.append(p)
    cmd += ["--chdir", "/tmp", "--", *argv]
    return cmd


def launcher_argv(sb: Sandbox, mode: str, argv: Sequence[str] = ()) -> list[str]:
    """The base interpreter running the harness's launcher: limits, then the uid dropped, then `mode`."""
    uid = str(_next_uid()) if sb.kind == "bwrap" and os.geteuid() == 0 else "-"
    limits = ",".join(f"{k}={v}" for k, v in rlimits(sb.limits).items())
    return [python(), "-I", "-S", "-X", "utf8", "-c", harness_source(), mode, uid, limits, *argv]


def popen(sb: Sandbox, inner: Sequence[str], *, ro_binds: Sequence[Path] = (), env: Mapping[str, str] = {},
          venv: bool = False) -> subprocess.Popen:
    """Start `inner` (a launcher command line) in sb: pipes on stdin/stdout/stderr, its own session."""
    cwd = None
    if sb.kind == "none":
        cwd = tempfile.mkdtemp(prefix="rlkit-sandbox-")
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "TMPDIR": cwd}
        full_env = {**base, **env}
    else:
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    p = subprocess.Popen(command(sb, inner, ro_binds=ro_binds, env=env, venv=venv), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd=cwd,
                         env=full_env, close_fds=True)
    p._rlkit_tmp = cwd  # type: ignore[attr-defined]  (kind none: removed by kill)
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


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    st = _stat(pid)
    return st[19] if st else None


def _state(pid: int) -> str | None:
    st = _stat(pid)
    return st[0] if st else None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def kill(p: subprocess.Popen) -> None:
    """SIGKILL the sandbox: its PID namespace (through the namespace's init, which bwrap then reaps), then its
    process group; wait for it. No zombie, no survivor (kind none: a process that left the group survives)."""
    inits = []
    if p.returncode is None and getattr(p, "_rlkit_kind", "bwrap") == "bwrap":
        inits = [(pid, _start_time(pid)) for pid in _children(p.pid)]  # the namespace's init
        for pid, _ in inits:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if inits:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # bwrap, and an init it was starting (same group)
    except OSError:
        pass
    p.wait()
    for pid, start in inits:  # an init no longer running has emptied its namespace (the kernel did first)
        deadline = time.monotonic() + 5
        while start is not None and _start_time(pid) == start and _state(pid) not in ("Z", "X", None) \
                and time.monotonic() < deadline:
            time.sleep(0.001)
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
    tmp = getattr(p, "_rlkit_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
