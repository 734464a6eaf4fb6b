"""benchmarks/update_memory.py at --size small: the whole benchmark runs and its figures are sane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_update_memory_bench_small(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "update_memory.py"), "--size", "small",
                        "--modes", "fp32", "lora16", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    params = res["model"]["parameters"]
    assert 1_000_000 < params < 10_000_000  # a few-M-parameter Qwen2
    assert res["batch"]["optimizer_steps"] >= 2  # the second step runs with the AdamW moments allocated
    loaded = res["baseline"]["loaded_kib"]
    assert loaded > res["baseline"]["imports_kib"] > 0
    modes = {m["mode"]: m for m in res["modes"]}
    assert modes["fp32"]["status"] == "ok", modes["fp32"]["status"]
    ran = [m for m in modes.values() if not m["status"].startswith("not available")]
    for m in ran:
        assert m["status"] == "ok", (m["mode"], m["status"])
        assert m["peak_rss_kib"] > loaded // 2 > 0
        assert m["tokens_per_s"] > 0 and m["train_seconds"] > 0
        assert m["grad_norm"] > 0  # the batch's mixed rewards give non-zero advantages
        # fp32 AdamW moments (2 x 4 bytes) for every trainable parameter: all of them in full fine-tuning,
        # the adapter's alone (a few percent) under LoRA
        trainable = m["trainable_params"]
        assert m["moment_dtype"] == "F32"
        assert trainable == params if m["mode"] == "fp32" else 0 < trainable < 0.1 * params
        overhead = m["optimizer_bytes"] - 2 * 4 * trainable
        assert 0 < overhead < 64 * 1024, overhead  # header, per-tensor step counters, RNG state
    assert "peak RSS MiB" in r.stdout and "fp32" in r.stdout
