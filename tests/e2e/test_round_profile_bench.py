"""benchmarks/round_profile.py scaled down (one round and a one-step follow pipe of 16 prompts x 4, this checkout
alone): the real stages run under py-spy, and the figures and phases it reports are those of the runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_round_profile_bench_scaled_down(tmp_path, sft_dir, ref_dir):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "sft").symlink_to(sft_dir)
    (runs / "ref").symlink_to(ref_dir)
    out = tmp_path / "figures.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "round_profile.py"), "--runs", str(runs),
                        "--prompts", "16", "--n", "4", "--rounds", "1", "--rate", "200", "--timeline", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())["new"]
    assert set(res) == {"rounds", "follow"}
    for mode, fig in res.items():
        assert fig["rows"] == 64 and fig["tokens"] > 64, mode  # 16 prompts x 4 samples, prompt and completion tokens
        assert 0 < max(fig["walls"].values()) <= fig["wall"] + 0.5, mode
        p = fig["profile"]
        assert 0 <= p["overhead"] <= p["wall"] + 0.5, mode
        ph = p["phases"]
        for stage in ("rollout", "score-ref", "update"):  # each imports torch and transformers
            assert ph[stage]["imports"] > 0.5, (mode, stage, ph[stage])
        assert ph["rollout"].get("sampling", 0) > 0 and ph["update"].get("backward", 0) > 0, (mode, ph)
        # each process's phases fill its wall in the profiled run (the samples are scaled to it)
        for stage, wall in p["walls"].items():
            assert math.isclose(sum(ph[stage].values()), wall, rel_tol=0.01), (mode, stage)
        first = p["first"]
        assert first["rollout"][0] <= first["update"][0], mode  # sampled before trained on
        for stage, top in p["top"].items():  # the functions with the most self time, most first
            secs = [t for _, t in top]
            assert top and secs == sorted(secs, reverse=True) and secs[-1] > 0, (mode, stage, top)
    assert "timeline" in r.stdout and "start-up" in r.stdout and "compute" in r.stdout
