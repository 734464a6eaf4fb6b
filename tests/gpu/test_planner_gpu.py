"""The memory planner against a real GPU: the planned peak of GRPO's update step (bf16 autocast over fp32 masters,
the GPU's default micro-batches) against `torch.cuda.max_memory_allocated` of the same step run for real on the
GPU (Qwen2.5-0.5B's shapes, random weights: nothing downloaded), within 20%; and LoRA with its base in bf16."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlkit import planner

REAL = r"""
import json, sys, torch
from rlkit.planner import trace
spec = trace.Spec(**json.loads(sys.argv[1]))
model, step = trace.real_step(spec, "cuda")
torch.cuda.reset_peak_memory_stats()
step.run(); step.run()  # the second step holds AdamW's moments through its passes: the plan's steady peak
torch.cuda.synchronize()
print(json.dumps({"peak": torch.cuda.max_memory_allocated()}))
"""


@pytest.mark.parametrize("lora", [None, {"rank": 64}])
def test_planned_peak_agrees_with_the_gpus_max_memory_allocated(lora):
    from rlkit.training import TrainOptions
    from rlkit.training.lora import LoraOptions

    config = planner.model_config("qwen2.5-0.5b")
    work, hw = planner.Work(128, 384, rows=16), planner.Hardware(1, 80)
    train = TrainOptions(dtype="bf16", lora=LoraOptions(**lora) if lora else None)
    est = planner.plan_training("update", config, work, hw, train)
    spec = planner.train_spec("update", config, work, hw, train, algo="grpo", beta=0.0)
    r = subprocess.run([sys.executable, "-c", REAL, json.dumps(spec)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    real = json.loads(r.stdout.strip().splitlines()[-1])["peak"]
    assert est.peak - est.parts.get("batch", 0) == pytest.approx(real, rel=0.20), (est.peak / 2**30, real / 2**30)
