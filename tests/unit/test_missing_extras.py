"""An optional extra that is not installed (its library hidden from the import system in a real `rlkit` process):
one line naming the install command, exit 2, nothing written, before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("hidden", "args", "extra"), [
    ("reasoning_gym", ["prompts", "--task", "reasoning-gym:dataset=gcd"], "rlkit[reasoning-gym]"),
    ("textarena", ["rollout", "--policy", "nowhere", "--env", "textarena:game=GuessTheNumber-v0"], "rlkit[textarena]"),
    ("websockets", ["rollout", "--policy", "nowhere", "--env", "openenv:url=ws://127.0.0.1:1/ws"], "rlkit[openenv]"),
])
def test_a_missing_extra_is_one_line_naming_its_install_command(hidden, args, extra, tmp_path):
    out = tmp_path / "out.arrow"
    code = (f"import sys; sys.modules[{hidden!r}] = None\n"
            "from rlkit.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *args, "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and not out.exists(), r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"pip install '{extra}'" in line and "is not installed" in line, line
