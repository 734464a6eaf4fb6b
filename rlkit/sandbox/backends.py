"""Sandbox backends: how a sandbox of each kind (`Sandbox.kind`, `--sandbox KIND`) starts, probes and ends.

A backend is one file in this folder, a class with the attributes and methods of `Backend`, and one line in
`BACKENDS` below (kind -> "module:class", imported when a sandbox of that kind is first used). Everything else,
the launcher and its limits (`rlkit.sandbox.process`), the test harness (`programs`), the reward-function and
tool workers (`workers`), runs the same over any backend.
"""

from __future__ import annotations

import importlib
import subprocess
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

BACKENDS: dict[str, str] = {
    "bwrap": "rlkit.sandbox.bwrap:Bwrap",  # bubblewrap: Linux namespaces, no network, a read-only system
    "none": "rlkit.sandbox.none:Unisolated",  # a plain subprocess with the same limits: UNSAFE
}
KINDS = tuple(BACKENDS)

_loaded: dict[str, Backend] = {}


class Backend(Protocol):
    name: str  # its kind, the key in BACKENDS
    isolated: bool  # False: the program runs as the user, sees the user's files and network (unsafe)
    pid_namespace: bool  # a PID namespace of its own: killing its first process ends every process in it
    how: str  # how to make it available, said after the reason `probe` gave

    def probe_key(self) -> Hashable:
        """What a probe's answer depends on besides the kind (e.g. the binary found on PATH and the uid):
        `Sandbox.check` probes once per process and key."""

    def probe(self, sb: Any) -> str | None:
        """None when a sandbox of this kind starts and runs Python here; else why not (one line)."""

    def launcher_uid(self) -> str:
        """The uid the launcher inside drops to before the untrusted code runs, as text; "-" for none."""

    def command(self, sb: Any, argv: Sequence[str], *, ro_binds: Sequence[Path], env: Mapping[str, str],
                venv: bool) -> list[str]:
        """The full command line running argv (a command inside the sandbox)."""

    def process_env(self, env: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
        """(working directory or None, environment) of the host process that runs `command(...)`; a working
        directory made here is removed by `end`."""

    def end(self, p: subprocess.Popen) -> None:
        """SIGKILL the sandbox and wait: when it returns, no process of the sandbox exists (see `kill`)."""

    def exit_signal(self, returncode: int) -> int:
        """The signal that ended a sandboxed process exiting with this status; 0 for none."""


def backend(kind: str) -> Backend:
    """The backend of `kind` (one of BACKENDS), imported on first use."""
    if kind not in _loaded:
        if kind not in BACKENDS:
            raise ValueError(f"sandbox kind {kind!r}: expected one of {', '.join(BACKENDS)}")
        module, _, name = BACKENDS[kind].partition(":")
        _loaded[kind] = getattr(importlib.import_module(module), name)()
    return _loaded[kind]
