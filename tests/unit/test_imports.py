"""Every module imports; `rlkit --help` imports no torch/transformers; ruff is clean."""

import importlib
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlkit
import rlkit.stages

from conftest import REPO


def _modules():
    for pkg in (rlkit, rlkit.stages):
        for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if not m.name.endswith("__main__"):
                yield m.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_help_imports_no_heavy_libraries():
    code = (
        "import sys\n"
        "from rlkit.cli import main\n"
        "rc = main(['--help'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'pyarrow') if m in sys.modules]\n"
        "assert rc == 0 and not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for cmd in ("sft", "freeze-ref", "eval", "inspect", "prompts"):
        assert cmd in r.stdout


def test_every_command_has_help_for_every_option():
    import typer

    from rlkit.cli import app

    group = typer.main.get_command(app)
    options = 0
    for name, cmd in group.commands.items():
        assert cmd.help, name
        for p in cmd.params:
            if p.param_type_name == "option":
                options += 1
                assert p.help, f"{name} {p.opts} has no help"
    assert options > 100  # the walk saw the options (an isinstance check on another click's class sees none)


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (it is in the dev extra)")
    r = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
