"""recipes/rlvr.sh on a GPU, scaled down through its knobs (the values tests/e2e/test_recipes.py uses), every stage
with its defaults: the GPU is where they run (--device auto), bf16 is what training computes in (--dtype auto),
and the rollout engine is what `--engine auto` picks there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import auto_dtype, device_line, metrics_rows, on_cuda
from conftest import REPO

ROUNDS = 2
KNOBS = {"SFT_EXAMPLES": "3000", "EVAL_NUM": "20", "ROUNDS": str(ROUNDS), "PROMPTS": "16", "N": "4",
         "MAX_NEW_TOKENS": "16"}


def test_rlvr_recipe_scaled_down_on_cuda(gpu, tmp_path):
    runs = tmp_path / "runs"
    env = {**os.environ, **KNOBS, "RUNS": str(runs), "RLKIT_DEBUG": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(REPO / "recipes" / "rlvr.sh")], capture_output=True, text=True, env=env,
                       timeout=2400, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"after RL ({ROUNDS} rounds)" in r.stdout
    err = r.stderr

    sft = json.loads((runs / "sft" / "rlkit.json").read_text())
    on_cuda(sft)
    assert sft["config"]["train"]["dtype"] == auto_dtype(gpu) and sft["metrics"]["gpu_mem_peak_gib"] > 0
    assert device_line(err, "sft") == f"sft: device {sft['device']} ({sft['gpu']}, {auto_dtype(gpu)})"
    for i in range(1, ROUNDS + 1):
        m = json.loads((runs / f"round-{i}" / "rlkit.json").read_text())
        on_cuda(m)
        assert m["step"] == i and m["config"]["train"]["dtype"] == auto_dtype(gpu)
        assert 0 < m["metrics"]["gpu_mem_peak_gib"] < gpu["memory_gib"]
    # one update process per round, each says once where it trains
    lines = [ln for ln in err.splitlines() if ln.startswith("update: device ")]
    assert len(lines) == ROUNDS and all(ln.startswith("update: device cuda:") for ln in lines), lines

    metrics = runs / "metrics.jsonl"
    updates = metrics_rows(metrics, "update")
    assert [u["step"] for u in updates] == list(range(1, ROUNDS + 1))
    assert all(u["gpu_mem_peak_gib"] > 0 for u in updates)
    assert [e["step"] for e in metrics_rows(metrics, "eval")] == list(range(ROUNDS + 1))
    assert (runs / "report.png").read_bytes()[:4] == b"\x89PNG"
