"""Running untrusted code: a bubblewrap sandbox with resource limits and a wall clock (docs/sandbox.md).

`Sandbox(kind, workers, limits)` says how: kind "bwrap" (Linux namespaces through bubblewrap: no network, a
read-only system, a private tmpfs as the working directory, its own PID namespace; rlimits inside, and the
uid dropped when rlkit runs as root) or "none" (a plain subprocess with the same limits and timeout: UNSAFE,
only for code you trust). `check()` refuses, with one line, a sandbox that cannot start.
`rlkit.sandbox.programs` runs model-written programs against tests (`run_programs`: concurrent, results in
order); `spawn`/`kill` run any command in the sandbox (the sandboxed `--reward-fn` worker). Stdlib only.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field

from rlkit.errors import SandboxUnavailable
from rlkit.sandbox.bwrap import bwrap_path, kill, spawn

__all__ = ["KINDS", "REASONS", "Limits", "Sandbox", "SandboxUnavailable", "spawn", "kill"]

KINDS = ("bwrap", "none")
REASONS = ("passed", "wrong_answer", "runtime_error", "syntax_error", "timeout", "memory")


@dataclass(frozen=True)
class Limits:
    """Per program; wall_s covers all its tests together."""

    wall_s: float = 10.0  # wall clock for the whole sandboxed run; then the group is killed and reaped
    cpu_s: int = 5  # RLIMIT_CPU per process
    memory_mb: int = 1024  # RLIMIT_AS per process
    processes: int = 64  # RLIMIT_NPROC (the sandbox's uid)
    file_mb: int = 16  # RLIMIT_FSIZE, and the size of the sandbox's tmpfs
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 4 << 20  # stdout read per test (more: killed, wrong_answer)

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "file_mb", "open_files", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox limit memory_mb must be >= 64 (Python itself needs it), got {self.memory_mb}")
        if self.open_files < 16:
            raise ValueError(f"sandbox limit open_files must be >= 16, got {self.open_files}")


_probed: dict[tuple, str | None] = {}  # (kind, bwrap, euid) -> None (works) or the reason it does not
_probe_lock = threading.Lock()

HOW = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; elsewhere see docs/install.md) "
       "or pass --sandbox none to run untrusted code without a sandbox (unsafe)")


@dataclass(frozen=True)
class Sandbox:
    kind: str = "bwrap"  # "bwrap" | "none" (a plain subprocess with the same limits and timeout: UNSAFE)
    workers: int | None = None  # programs run at once; None: os.cpu_count()
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"sandbox kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"sandbox workers must be >= 1, got {self.workers}")

    @property
    def n_workers(self) -> int:
        return self.workers or os.cpu_count() or 1

    def check(self) -> None:
        """Raise SandboxUnavailable (one line: what is wrong, how to fix it) unless a sandbox of this kind
        starts and runs Python here. Probes once per process (per bwrap found on PATH)."""
        if self.kind == "none":
            return
        exe = bwrap_path()
        key = (self.kind, exe, os.geteuid())
        with _probe_lock:
            if key not in _probed:
                _probed[key] = _probe(self, exe)
            why = _probed[key]
        if why is not None:
            raise SandboxUnavailable(f"cannot sandbox untrusted code: {why}; {HOW}")


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
    from rlkit.sandbox.bwrap import launcher_argv, popen

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
