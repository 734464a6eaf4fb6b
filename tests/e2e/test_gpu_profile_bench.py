"""benchmarks/gpu_profile.py at --size tiny on the CPU: every mode runs every stage and the figures are sane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODES = ["fp32", "bf16", "bf16-gc", "lora"]
STAGES = ["sft", "rollout", "score-ref", "update"]


@pytest.mark.slow
def test_gpu_profile_bench_tiny_on_cpu(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_profile.py"), "--size", "tiny", "--device", "cpu",
                        "--workdir", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {"size", "device_requested", "machine", "model", "workload", "memory", "modes"} <= set(res)
    assert res["size"] == "tiny" and res["device_requested"] == "cpu"
    params = res["model"]["parameters"]
    assert 1_000_000 < params < 10_000_000  # a few-M-parameter Qwen2
    assert res["memory"] == "rss" and "gpu" not in res["machine"]  # --device cpu: nothing ran on a GPU
    w = res["workload"]
    assert [m["mode"] for m in res["modes"]] == MODES
    for m in res["modes"]:
        assert m["status"] == "ok", (m["mode"], m["status"])
        assert list(m["stages"]) == STAGES
        for name, s in m["stages"].items():
            where = (m["mode"], name)
            assert s["status"] == "ok", where
            assert s["tokens_per_s"] > 0 and s["tokens"] > 0 and s["seconds"] > 0, where
            assert 50 < s["peak_rss_mib"] < 16_384, where  # Python + torch + a 6M-parameter model
            assert s["gpu_mem_peak_gib"] is None, where  # no GPU memory on the CPU
            assert s["device_line"] is None or s["device_line"].startswith(f"{name}: device cpu"), where
            assert s["command"].startswith(f"rlkit {name} ") and "--device cpu" in s["command"], where
        roll = m["stages"]["rollout"]
        assert roll["rows"] == w["prompts"] * w["n"]
        assert 0 < roll["completion_tokens_mean"] <= w["max_new_tokens"]
        assert 0 < roll["reward_coin_mean"] < 1  # the groups' rewards differ: the update has a signal
        assert m["stages"]["score-ref"]["tokens"] > roll["tokens"]  # prompts and completions are scored
        sft, upd = m["stages"]["sft"], m["stages"]["update"]
        assert sft["manifest_device"] == upd["manifest_device"] == "cpu"
        assert upd["grad_norm"] > 0
        train = upd["train_config"]
        assert train["dtype"] == ("fp32" if m["mode"] == "fp32" else "bf16")
        assert train["gradient_checkpointing"] is (m["mode"] == "bf16-gc")
        assert (train["lora"] is not None) is (m["mode"] == "lora")
    trainable = {m["mode"]: m["trainable_params"] for m in res["modes"]}
    # full fine-tuning trains every weight; LoRA an adapter of a few percent of them
    assert trainable["fp32"] == trainable["bf16"] == trainable["bf16-gc"] == params
    assert 0 < trainable["lora"] < 0.1 * params
    assert "peak RSS MiB" in r.stdout and "NO GPU" in r.stdout and "tokens/s" in r.stdout
    for mode in MODES:
        assert f"\n{mode} " in r.stdout
