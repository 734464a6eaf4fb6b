"""Package discovery for setuptools (everything else is in pyproject.toml).

Every package under rlkit/ is found, so a new one cannot be left out of the wheel, and the top-level folder
stages/ (with any package under it) installs as `rlkit.stages`: rlkit never claims the generic top-level name
`stages` in site-packages. Data files inside the packages ship through MANIFEST.in (`graft`).
tests/e2e/test_installed_wheel.py checks that every module and data file of the source tree is in the wheel.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["rlkit", "rlkit.*"]),
              *(f"rlkit.{p}" for p in find_packages(include=["stages", "stages.*"]))],
    package_dir={"rlkit": "rlkit", "rlkit.stages": "stages"},
)
