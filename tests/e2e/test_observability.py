"""Watching the policy: the drift figure and `rlkit report` (the drift across a pipeline, the metrics file and
the trackers: tests/e2e/test_tracking.py)."""

from __future__ import annotations

import json

import pytest
import torch

from rlkit.errors import RlkitError
from rlkit.io.checkpoints import load_weights
from rlkit.training.drift import relative_drift

from conftest import one_error_line, run_cli


def test_relative_drift_by_hand():
    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([[0.0, 5.0]])}  # norms 5 and 5
    assert relative_drift(ref, ref) == 0.0
    moved = {"a": torch.tensor([3.0, 5.0]), "b": torch.tensor([[0.0, 5.0]]), "extra": torch.ones(3)}
    assert relative_drift(moved, ref) == pytest.approx(1.0 / 10.0)  # ||(0,1)|| / (5 + 5); 'extra' not in ref
    # a bf16 reference frozen from these very weights: freeze-ref's rounding is not drift
    w = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    assert relative_drift(w, {"w": w["w"].to(torch.bfloat16)}) == 0.0
    assert relative_drift({"w": w["w"] + 1.0}, {"w": w["w"].to(torch.bfloat16)}) > 0.1
    with pytest.raises(RlkitError, match="share no weight names"):
        relative_drift({"x": torch.ones(2)}, ref)
    with pytest.raises(RlkitError, match="shape"):
        relative_drift({"a": torch.ones(3)}, ref)


def test_update_refuses_a_reference_that_is_not_one(sft_dir, tmp_path):
    out = tmp_path / "u"
    line = one_error_line(run_cli("update", "--policy", str(sft_dir), "--out", str(out), "--ref", str(sft_dir),
                                  "--in", str(tmp_path / "none.arrow")))
    assert "not a frozen reference" in line and not out.exists()
    assert load_weights(sft_dir)  # the tensors a drift figure reads, without building a model


def _write_metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_renders_the_panels_it_has(tmp_path):
    from rlkit.stages.report import draw, load_run

    full = [{"stage": "eval", "step": 0, "accuracy": 0.5}]
    for s in (1, 2, 3):
        full.append({"stage": "update", "step": s, "reward_mean": 0.1 * s, "reward/rm:lenbias": 0.1 * s,
                     "reward/verifier": 0.3, "kl_per_seq": 0.01 * s, "mean_response_tokens": 3 + s, "entropy": 0.6,
                     "clip_fraction": 0.05, "drift": 0.001 * s})
        full.append({"stage": "eval", "step": s, "accuracy": 0.5 - 0.05 * s})
    a = _write_metrics(tmp_path / "a.jsonl", full)
    # another run whose rows lack most fields (an older rlkit, or DPO): only reward and KL to draw
    sparse = [{"stage": "update", "step": s, "reward_mean": 0.2, "kl_per_seq": 0.02 * s, "entropy": None}
              for s in (1, 2)]
    b = _write_metrics(tmp_path / "b.jsonl", sparse)

    fig = draw([load_run("b", b)], None)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["reward (each component)", "KL to the reference"]

    fig = draw([load_run("a", a), load_run("b", b)], "sweep")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert len(panels) == 7
    labels = [ln.get_label() for ln in panels["reward (each component)"].get_lines()]
    assert labels == ["a: reward = rm:lenbias", "a: reward/verifier", "b"]  # reward_mean == its one component
    acc = panels["held-out accuracy"].get_lines()
    assert len(acc) == 1 and list(acc[0].get_xdata()) == [0, 1, 2, 3]

    out = tmp_path / "report.png"
    r = run_cli("report", f"first={a}", f"second={b}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    err = r.stderr.decode()
    assert "first" in err and "50.0% → 35.0%" in err  # the summary table: accuracy first -> last

    html = tmp_path / "report.html"
    r = run_cli("report", str(a), str(b), "--out", str(html))
    assert r.returncode == 0, r.stderr
    page = html.read_text()
    assert "data:image/png;base64," in page and "<table>" in page and "50.0% → 35.0%" in page


def test_report_keeps_the_last_row_of_a_rerun_step(tmp_path):
    from rlkit.stages.report import load_run

    m = _write_metrics(tmp_path / "m.jsonl", [{"stage": "update", "step": 1, "reward_mean": 0.1},
                                               {"stage": "update", "step": 2, "reward_mean": 0.2},
                                               {"stage": "update", "step": 2, "reward_mean": 0.9}])
    assert load_run("m", m).series("update", "reward_mean") == ([1, 2], [0.1, 0.9])


def test_report_bad_input(tmp_path):
    good = _write_metrics(tmp_path / "m.jsonl", [{"stage": "update", "step": 1, "reward_mean": 0.1}])
    out = tmp_path / "r.png"
    line = one_error_line(run_cli("report", str(tmp_path / "missing.jsonl"), "--out", str(out)))
    assert "does not exist" in line and not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"stage": "update", "step": 1}\n{oops\n')
    line = one_error_line(run_cli("report", str(bad), "--out", str(out)))
    assert "line 2" in line and "not JSON" in line and not out.exists()
    line = one_error_line(run_cli("report", str(good), "--out", str(tmp_path / "r.gif")))
    assert "'.gif'" in line and ".png" in line
    nothing = _write_metrics(tmp_path / "n.jsonl", [{"stage": "sft", "step": 0, "train_loss": 1.0}])
    line = one_error_line(run_cli("report", str(nothing), "--out", str(out)))
    assert "has a figure to plot" in line and not out.exists()
    out.write_bytes(b"keep me")
    line = one_error_line(run_cli("report", str(good), str(bad), "--out", str(out)))
    assert out.read_bytes() == b"keep me"  # nothing existing damaged
    line = one_error_line(run_cli("report", f"x={good}", f"x={good}", "--out", str(out)))
    assert "both named 'x'" in line
