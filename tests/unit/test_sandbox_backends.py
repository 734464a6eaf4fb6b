"""A sandbox backend is one file and one line of `rlkit.sandbox.backends.BACKENDS`: a toy backend added through
only those two places runs programs against tests, spawns commands and is refused by its own probe, with the
launcher, the harness and the limits every backend shares."""

from __future__ import annotations

import textwrap

import pytest

from rlkit.errors import SandboxUnavailable
from rlkit.sandbox import BACKENDS, KINDS, Limits, Sandbox, kill, spawn
from rlkit.sandbox.programs import Outcome, TestCase, TestSuite, run_programs

TOY = '''
import os

from rlkit.sandbox.none import Unisolated


class Toy(Unisolated):
    """The unisolated backend, with a mark in the environment of what runs in it, and a switch to refuse."""

    name = "toy"
    how = "switch the toy on (TOY_OFF unset)"

    def probe_key(self):
        return os.environ.get("TOY_OFF")

    def probe(self, sb):
        return "the toy is switched off" if os.environ.get("TOY_OFF") else None

    def command(self, sb, argv, *, ro_binds, env, venv):
        return ["/usr/bin/env", "RLKIT_TOY=in the toy", *argv]
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's file on sys.path and its one registry line."""
    (tmp_path / "toy_backend.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "toy", "toy_backend:Toy")
    monkeypatch.delenv("TOY_OFF", raising=False)
    return Sandbox("toy", workers=2, limits=Limits(wall_s=10.0))


def test_a_toy_backend_runs_programs_and_commands(toy):
    suite = TestSuite((TestCase("stdio", "", "in the toy"), TestCase("stdio", "", "in the toy")))
    program = "import os\nprint(os.environ.get('RLKIT_TOY'))"
    assert run_programs(toy, [(program, suite), ("print('elsewhere')", suite)]) == [
        Outcome(2, 2, "passed"), Outcome(0, 2, "wrong_answer")]
    assert toy.backend.name == "toy" and not toy.backend.isolated
    p = spawn(toy, ["/bin/sh", "-c", 'echo "$RLKIT_TOY"; ulimit -n'])
    try:
        out, _ = p.communicate(timeout=30)
    finally:
        kill(p)
    assert out.decode().split("\n")[:2] == ["in the toy", str(toy.limits.open_files)]  # the shared launcher's limits


def test_a_toy_backend_refused_by_its_probe_says_how(toy, monkeypatch):
    monkeypatch.setenv("TOY_OFF", "1")
    with pytest.raises(SandboxUnavailable) as e:
        toy.check()
    assert str(e.value) == "cannot sandbox untrusted code: the toy is switched off; switch the toy on (TOY_OFF unset)"


def test_an_unknown_kind_names_the_registered_ones():
    assert KINDS == ("bwrap", "none") and tuple(BACKENDS) == KINDS
    with pytest.raises(ValueError, match="sandbox kind 'toy': expected one of bwrap, none"):
        Sandbox("toy")
