"""The wheel users install (`pip install .`, the Dockerfile): built from the source tree, installed with its
dependencies into a fresh virtual environment (no editable install, no checkout on sys.path), then run from
a folder outside the checkout by tests/installed/smoke.sh: `rlkit --help`, recipes/quickstart.sh scaled down,
the code task through the bubblewrap sandbox, `rlkit plan` on a shipped model config and the math task on
its shipped sample."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("installed_wheel")]  # one build for both tests
PACKAGES = {"rlkit": "rlkit", "stages": "rlkit/stages"}  # source folder -> where it installs
PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def _source_files() -> list[str]:
    """The source tree as a user's checkout has it: tracked files and new ones git does not ignore."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                       capture_output=True, check=True)
    return [f for f in r.stdout.decode().split("\0") if f and (REPO / f).is_file()]


def _find_links() -> list[str]:
    """The local wheel folder the Makefile hands uv (this machine's CPU build of torch), if there is one."""
    fl = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    ).stdout.strip()
    return ["--find-links", fl] if fl else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel built from a copy of the source tree (a clean copy: no
    build/ or *.egg-info left by another build can add files that this build would leave out), installed
    with its dependencies as the Makefile installs them (uv, constraints.txt, the CPU torch)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    for f in _source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    uv = str(Path(sys.executable).parent / "uv")
    r = subprocess.run([uv, "build", "-q", "--wheel", "-o", str(dist), str(src)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = dist.glob("rlkit-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), *_find_links(),
                        "-c", str(REPO / "constraints.txt"), "torch==2.13.0", str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return venv


def test_the_wheel_installs_every_module_and_data_file(installed):
    site = Path(subprocess.run([str(installed / "bin" / "python"), "-c", PURELIB], capture_output=True,
                               text=True, check=True, cwd=installed).stdout.strip())
    expected = set()
    for f in _source_files():
        top, _, rest = f.partition("/")
        if top in PACKAGES and rest:
            expected.add(f"{PACKAGES[top]}/{rest}")
    assert {"rlkit/sandbox/_harness.py", "rlkit/stages/sft.py", "rlkit/tasks/data_files/math_sample.jsonl",
            "rlkit/planner/models/qwen2.5-0.5b.json"} <= expected
    shipped = {str(p.relative_to(site)) for p in (site / "rlkit").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    missing, extra = sorted(expected - shipped), sorted(shipped - expected)
    assert not missing, f"in the source tree, not in the installed wheel: {missing}"
    assert not extra, f"in the installed wheel, not in the source tree: {extra}"
    assert not (site / "stages").exists()  # stages/ installs as rlkit.stages, never as a top-level `stages`
    (dist_info,) = site.glob("rlkit-*.dist-info")
    assert (dist_info / "top_level.txt").read_text().split() == ["rlkit"]
    assert "rlkit = rlkit.cli:main" in (dist_info / "entry_points.txt").read_text()


def test_the_installed_wheel_runs_outside_the_checkout(installed, tmp_path):
    """tests/installed/smoke.sh checks each command's outputs (exit codes, files, JSON fields) and exits
    non-zero, naming the step, at the first wrong one. The code task's programs run in bubblewrap, as in
    the other sandbox tests; only where it is missing and RLKIT_REQUIRE_SANDBOX is unset (never in `make
    test`) with --sandbox none."""
    home = tmp_path / "home"
    home.mkdir()
    sandbox = "bwrap" if shutil.which("bwrap") or os.environ.get("RLKIT_REQUIRE_SANDBOX") else "none"
    # a new user's environment: the venv first on PATH, no PYTHONPATH, bytecode written (the first process
    # writes torch's .pyc, the next ones read it), this test session's rlkit cache
    env = {"PATH": f"{installed / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "SANDBOX": sandbox, "RLKIT_CACHE_DIR": os.environ["RLKIT_CACHE_DIR"],
           "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    r = subprocess.run(["bash", str(REPO / "tests" / "installed" / "smoke.sh"), str(tmp_path / "work")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.strip().splitlines()[-1].endswith("] all passed")
    sft = tmp_path / "work" / "quickstart" / "sft" / "model.safetensors"
    assert sft.stat().st_size > 0  # it ran where it was asked to, outside the checkout
