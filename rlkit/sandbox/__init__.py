"""Running untrusted code: a bubblewrap sandbox with resource limits and a wall clock (docs/sandbox.md).

`Sandbox(kind, workers, limits)` says how: kind "bwrap" (Linux namespaces through bubblewrap: no network, a
read-only system, a private tmpfs as the working directory, its own PID namespace; rlimits inside, and the
uid dropped when rlkit runs as root) or "none" (a plain subprocess with the same limits and timeout: UNSAFE,
only for code you trust). `check()` refuses, with one line, a sandbox that cannot start.
Each kind is a backend (`rlkit.sandbox.backends`: one file and one line of `BACKENDS` a kind).
`rlkit.sandbox.programs` runs model-written programs against tests (`run_programs`: concurrent, results in
order); `spawn`/`kill` run any command in the sandbox; `rlkit.sandbox.workers` runs a `--reward-fn` function or
an environment's tools in sandboxed worker processes. Stdlib only.
"""

from rlkit.errors import SandboxUnavailable
from rlkit.sandbox.backends import BACKENDS, KINDS, Backend
from rlkit.sandbox.process import kill, spawn
from rlkit.sandbox.sandbox import REASONS, Limits, Sandbox

__all__ = ["BACKENDS", "KINDS", "REASONS", "Backend", "Limits", "Sandbox", "SandboxUnavailable", "spawn", "kill"]
