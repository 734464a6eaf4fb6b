"""The unisolated backend (kind "none", `--sandbox none`): the same launcher as a plain subprocess in a temporary
directory, with the same limits and timeout and none of the isolation. The program runs as the user, sees the
user's files and network, and a process that leaves its process group survives `kill`. Only for code you trust.
"""

from __future__ import annotations

import subprocess
import tempfile

from rlkit.sandbox.process import kill_group


class Unisolated:
    """The "none" backend (rlkit.sandbox.backends.Backend)."""

    name = "none"
    isolated = False
    pid_namespace = False
    how = ""

    def probe_key(self):
        return None

    def probe(self, sb) -> str | None:
        return None

    def launcher_uid(self) -> str:
        return "-"

    def command(self, sb, argv, *, ro_binds, env, venv) -> list[str]:
        return list(argv)

    def process_env(self, env):
        cwd = tempfile.mkdtemp(prefix="rlkit-sandbox-")
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "TMPDIR": cwd}
        return cwd, {**base, **env}

    def end(self, p: subprocess.Popen) -> None:
        kill_group(p)

    def exit_signal(self, returncode: int) -> int:
        return -returncode if returncode < 0 else 0
