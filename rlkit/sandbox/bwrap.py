"""The bwrap backend (kind "bwrap"): bubblewrap around the base Python interpreter.

A sandbox sees: /usr (and the /bin, /lib, /lib64 links into it) and the base interpreter's prefix, read-only;
a fresh /proc of its own PID namespace, a minimal /dev, and a private writable tmpfs at /tmp, its working
directory. No network (a new network namespace with only a down loopback), no IPC or UTS sharing, an empty
environment, no home directory, no project directory, no outputs. `--die-with-parent` and `--new-session`.

Started as root (here and in CI), bwrap runs without a user namespace (the kernel never applies RLIMIT_NPROC
to a process whose real uid is the host's root, user namespace or not): every capability is dropped but
SETUID/SETGID, and the launcher inside sets the limits and then drops to an unprivileged uid of its own before
the untrusted code runs (one uid per live sandbox of this process, so that one program's fork bomb does not
use up the next one's process count). Not root: `--unshare-all` (a user namespace, with its own process
count).

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
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlkit.sandbox.process import kill_group, python

if TYPE_CHECKING:
    from rlkit.sandbox.process import Sandbox

_uids = itertools.count()
_uid_lock = threading.Lock()

HOW = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; elsewhere see docs/install.md) "
       "or pass --sandbox none to run untrusted code without a sandbox (unsafe)")


class Bwrap:
    """The bwrap backend (rlkit.sandbox.backends.Backend)."""

    name = "bwrap"
    isolated = True
    pid_namespace = True
    how = HOW

    def probe_key(self):
        return bwrap_path(), os.geteuid()

    def probe(self, sb) -> str | None:
        return _probe(sb, bwrap_path())

    def launcher_uid(self) -> str:
        return str(_next_uid()) if os.geteuid() == 0 else "-"

    def command(self, sb, argv, *, ro_binds, env, venv) -> list[str]:
        return command(sb, argv, ro_binds=ro_binds, env=env, venv=venv)

    def process_env(self, env):
        return None, {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}

    def end(self, p: subprocess.Popen) -> None:
        end(p)

    def exit_signal(self, returncode: int) -> int:
        return -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0  # 128 + signal


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
    """The full command line running argv (a command inside the sandbox) under bwrap."""
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


def end(p: subprocess.Popen) -> None:
    """SIGKILL the sandbox: its PID namespace (through the namespace's init, which bwrap then reaps), then its
    process group; wait for it, and for the namespace to be empty."""
    inits = []
    if p.returncode is None:
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
    kill_group(p)  # bwrap, and an init it was starting (same group)
    for pid, start in inits:  # an init no longer running has emptied its namespace (the kernel did first)
        deadline = time.monotonic() + 5
        while start is not None and _start_time(pid) == start and _state(pid) not in ("Z", "X", None) \
                and time.monotonic() < deadline:
            time.sleep(0.001)


def _userns_disabled() -> bool:
    for path, off in (("/proc/sys/kernel/unprivileged_userns_clone", "0"), ("/proc/sys/user/max_user_namespaces",
                                                                           "0")):
        try:
            with open(path) as f:
                if f.read().strip() == off:
                    return True
        except OSError:
            pass
    return False


def _probe(sb: Sandbox, exe: str | None) -> str | None:
    if exe is None:
        return "bwrap (bubblewrap) not found on PATH"
    if os.geteuid() != 0 and _userns_disabled():
        return "user namespaces are disabled (sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces)"
    from rlkit.sandbox.process import kill, launcher_argv, popen
    from rlkit.sandbox.sandbox import Limits, Sandbox

    probe = Sandbox(sb.kind, 1, Limits(wall_s=10.0))
    p = popen(probe, launcher_argv(probe, "exec", ["/bin/sh", "-c", "echo ok"]))
    try:
        out, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return "bwrap did not start within 10 s"
    finally:
        kill(p)
    if p.returncode == 0 and out.strip() == b"ok":
        return None
    lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    first = lines[0].strip() if lines else f"exit status {p.returncode}"
    if "No permissions to creat" in first or "Operation not permitted" in first and os.geteuid() != 0:
        return f"bwrap failed: {first} (user namespaces disabled or blocked by a seccomp profile?)"
    return f"bwrap failed: {first}"
