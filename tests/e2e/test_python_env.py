"""`rollout --env python` on the real tiny model: the environment's own prompts (large products), its reward, the
table and manifest, every trajectory's interpreter gone when the stage returns; and a bad option as one line."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rlkit.io import manifests, streams
from rlkit.sandbox.bwrap import bwrap_path

from conftest import one_error_line, run_cli_inproc

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bwrap_path() is None and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                                 reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")]


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(stat[1]) == me and stat[0] != "Z":
                out.add(int(d.name))
    return out


def test_rollout_with_the_python_environment(sft_dir, tmp_path):
    before = _children()
    out = tmp_path / "py.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", "python:digits=4,timeout=2,memory=256",
                       "--num-prompts", "4", "--n", "2", "--max-turns", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    table, _ = streams.read_table(out, ["rollouts"])
    assert table.num_rows == 8
    prompts = table.column("prompt").to_pylist()
    assert all(re.fullmatch(r"<\d{4}\*\d{4}>=", p) for p in prompts)
    assert set(table.column("reward/env").to_pylist()) <= {0.0, 1.0}
    assert "tool_calls" in table.column_names
    m = manifests.read_manifest(out)
    assert m["config"]["env"].startswith("python:") and m["reward"]["composition"] == "env"
    assert _children() <= before  # no trajectory's sandbox outlives the stage


def test_a_bad_option_is_one_line(sft_dir, tmp_path):
    out = tmp_path / "bad.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", "python:timeout=0", "--out", str(out))
    assert r.returncode == 2
    assert "python tool: timeout=0; expected timeout > 0 (seconds)" in one_error_line(r)
    assert not out.exists()
