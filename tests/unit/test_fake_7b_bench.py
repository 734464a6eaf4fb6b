"""benchmarks/fake_7b.py's tracer at its --smoke shapes, in-process on fake tensors (a second or two): it still
calls the current rlkit.ops.logprobs and rlkit.ops.packing, and its byte counts are the ones a step must have."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_7b():
    spec = importlib.util.spec_from_file_location("fake_7b_bench", REPO / "benchmarks" / "fake_7b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fake_step_bytes_and_micro_batches(fake_7b):
    shapes, every = fake_7b.SMOKE, fake_7b.cases(8)
    got = {name: fake_7b.trace(every[name], shapes, prompt=16, completion=32, minibatch=8)
           for name in ("new-8", "new-mb2", "new-mb2-packed")}
    params = got["new-8"]["parameters"]
    for name, r in got.items():
        assert r["parameters"] == params, name
        peak, passes = r["peak"], r["passes_peak"]
        assert peak["Parameter"] == 4 * params, name  # fp32 weights, counted once
        # AdamW's two fp32 moments per weight (plus its step counters), allocated by the one step
        assert 8 * params <= r["optimizer_state_bytes"] < 8 * params + 4096, name
        assert peak["Total"] >= passes["Total"] > 4 * params, name
        assert r["steady_peak"] == max(passes["Total"] + r["optimizer_state_bytes"], peak["Total"]), name
    # the second micro-batch runs with every gradient allocated; its activations are a quarter of 8 rows'
    full, mb = got["new-8"]["passes_peak"], got["new-mb2"]["passes_peak"]
    assert mb["Gradient"] == 4 * params and full["Gradient"] == 0
    assert mb["Total"] - mb["Parameter"] - mb["Gradient"] < full["Total"] - full["Parameter"]
