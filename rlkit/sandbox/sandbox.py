"""What a sandbox is: its kind (a backend, `rlkit.sandbox.backends`), how many run at once, and the limits of each.
`check()` refuses, with one line, a sandbox that cannot start."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from rlkit.errors import SandboxUnavailable
from rlkit.sandbox.backends import BACKENDS, Backend, backend

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


_probed: dict[tuple, str | None] = {}  # (kind, the backend's probe key) -> None (works) or the reason it does not
_probe_lock = threading.Lock()


@dataclass(frozen=True)
class Sandbox:
    kind: str = "bwrap"  # a key of rlkit.sandbox.backends.BACKENDS: "bwrap" | "none" (a plain subprocess: UNSAFE)
    workers: int | None = None  # programs run at once; None: os.cpu_count()
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        if self.kind not in BACKENDS:
            raise ValueError(f"sandbox kind {self.kind!r}: expected one of {', '.join(BACKENDS)}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"sandbox workers must be >= 1, got {self.workers}")

    @property
    def backend(self) -> Backend:
        return backend(self.kind)

    @property
    def n_workers(self) -> int:
        return self.workers or os.cpu_count() or 1

    def check(self) -> None:
        """Raise SandboxUnavailable (one line: what is wrong, how to fix it) unless a sandbox of this kind
        starts and runs Python here. Probes once per process (per backend's probe key: e.g. the bwrap found on
        PATH)."""
        b = self.backend
        key = (self.kind, b.probe_key())
        with _probe_lock:
            if key not in _probed:
                _probed[key] = b.probe(self)
            why = _probed[key]
        if why is not None:
            raise SandboxUnavailable(f"cannot sandbox untrusted code: {why}; {b.how}")
