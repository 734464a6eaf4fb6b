"""rlkit.console: progress lines with an eta, a stream's rate, and --log-level / -q."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from rlkit import console

from conftest import run_cli


@pytest.fixture
def captured(monkeypatch):
    buf = io.StringIO()
    c = Console(file=buf, highlight=False, force_terminal=False, width=200)
    monkeypatch.setattr(console, "err", c)
    monkeypatch.setattr(console, "_warnings", c)
    monkeypatch.setattr(console, "_level", 20)
    return buf


def test_a_progress_line_off_a_terminal_says_the_time_left(captured):
    with console.progress("update", 4, every=0.0) as bar:
        for _ in range(4):
            bar.advance(1, loss=0.5)
    lines = captured.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("update: 1/4 [")
    assert all(re.search(r"eta \d+:\d\d\]", x) for x in lines[:3]) and "eta" not in lines[3]
    assert lines[-1].endswith("loss 0.5")


def test_a_stream_shows_its_count_and_rate(captured):
    with console.progress("score-ref", None, every=0.0, unit="rows") as bar:
        bar.advance(1024)
        bar.advance(1024)
    last = captured.getvalue().splitlines()[-1]
    assert re.match(r"score-ref: 2,048 rows \([\d,]+ rows/s\) \[\d+\.\ds\]$", last), last


def test_quiet_keeps_warnings_and_drops_the_rest(captured, monkeypatch):
    monkeypatch.setattr(console, "_level", 30)
    console.info("chatter")
    console.warn("careful")
    with console.progress("sft", 2, every=0.0) as bar:
        bar.advance(2)
    assert captured.getvalue() == "warning: careful\n"


def test_log_level_and_quiet_on_the_command_line(tmp_path):
    table = tmp_path / "a.arrow"
    assert run_cli("prompts", "--num-prompts", "3", "--out", str(table)).returncode == 0
    r = run_cli("inspect", str(table))
    assert r.returncode == 0 and b"first 3 of 3 rows" in r.stderr
    r = run_cli("inspect", str(table), "-q")
    assert r.returncode == 0 and r.stderr == b""
    r = run_cli("inspect", str(table), "--log-level", "debug", "-q")
    assert r.returncode == 0 and r.stderr == b""  # -q wins over a lower --log-level
    r = run_cli("prompts", "--num-prompts", "3", "--out", str(tmp_path / "d.arrow"), "--log-level", "loud")
    assert r.returncode == 2 and b"'loud' is not one of 'debug', 'info', 'warning', 'error'" in r.stderr
    assert not (tmp_path / "d.arrow").exists()


@pytest.mark.parametrize(("rewards", "warned"), [
    ([0, 0, 0, 0] * 9 + [0, 1, 0, 0], True),  # 9 of 10 groups all-equal: 90%
    ([0, 0, 0, 0] * 8 + [0, 1, 0, 0] * 2, False),  # 8 of 10
    ([1, 1, 1, 1] * 10, True),
])
def test_update_warns_when_most_groups_have_no_reward_difference(captured, rewards, warned):
    import torch

    from rlkit import algorithms
    from rlkit.algorithms.config import RLConfig
    from rlkit.ops.advantages import degenerate_groups

    groups = torch.arange(10).repeat_interleave(4)
    counts = degenerate_groups(torch.tensor(rewards, dtype=torch.float32), groups)
    for name in ("grpo", "rloo", "reinforce-pp"):
        algorithms.get(name)(RLConfig(algo=name)).check_signal(counts)
    out = captured.getvalue()
    # reinforce-pp whitens over the batch (no group baseline): all-equal groups still carry signal
    assert out.count("have all-equal rewards") == (2 if warned else 0)
    if warned:
        flat = 10 - sum(1 for g in range(10) if len(set(rewards[4 * g:4 * g + 4])) > 1)
        assert f"update: {flat} of 10 groups" in out and "--algo grpo" in out and "--temperature" in out


def test_paths_names_and_rows_print_as_written_not_as_rich_markup():
    """rich reads `[a]`, `[track]` and `[@SPLIT]` as style tags (dropping them) and fails on `[/x]`: info, warn
    and tables print what rlkit hands them as it is (a fresh process: the consoles as rlkit sets them up)."""
    import subprocess
    import sys

    text = "wrote runs/[a]/r.arrow; pip install 'rlkit[track]'; NAME[:CONFIG][@SPLIT]; a completion with [/b]"
    code = ("import sys; from rich.table import Table; from rlkit import console; t = sys.argv[1]; "
            "console.info(t); console.warn(t); tab = Table(title=t); tab.add_column(t); tab.add_row(t); "
            "console.print_wide(tab, min_width=400)")
    r = subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == text and lines[1] == f"warning: {text}"
    assert sum(text in ln for ln in lines) == 5, r.stderr  # info, warn, the table's title, header and row
