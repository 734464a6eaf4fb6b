"""`stages/` installs as `rlkit.stages` (never a generic top-level `stages`), in a wheel too."""

import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_maps_stages_under_rlkit_and_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("rlkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rlkit/stages/sft.py" in names and "rlkit/cli.py" in names
    assert "rlkit/tasks/data_files/math_sample.jsonl" in names  # the math task's default data ships with rlkit
    assert not any(n.startswith("stages/") for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    code = "import rlkit.stages.sft, rlkit.cli, sys; assert rlkit.cli.__file__.startswith(sys.argv[1]); print(rlkit.cli.main(['--version']))"
    r = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True,
                       cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "rlkit 0.1.0" in r.stdout
