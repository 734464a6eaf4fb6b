"""The memory planner against the real step: planned peak (rlkit.planner, fake tensors, layers extrapolated) vs the
peak RSS of the same engine step run for real in fp32 on this CPU, for the embedded tiny model and a ~100M model.

Usage: python benchmarks/planner_accuracy.py [--models tiny 100m] [--stage sft|update] [--json FILE]
       python benchmarks/planner_accuracy.py --real SPEC_JSON      (one real step; what the test suite runs)

Method. The planner traces the stage's step (`rlkit.planner.trace`) at 1 and 2 layers and extrapolates. The
real step is a child process that first runs a tiny model's two steps (the libraries' first-use memory: kernels,
autograd, allocator arenas), takes its RSS as the baseline (the peak RSS reset there, /proc/self/clear_refs), builds the model and runs the engine's step twice
(the second holds AdamW's moments through its passes, as the plan's steady peak does), and reports the peak RSS
growth. MALLOC_MMAP_THRESHOLD_=65536 makes glibc return a freed tensor's pages at once, so RSS follows the live
tensors as a GPU allocator's count does (without it, glibc's growing threshold keeps freed activations mapped and
RSS runs 20-30% above the live bytes). The planner's figure is the allocator's; a GPU adds its CUDA context,
which the plan's fit check reserves separately.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = {
    # the embedded tiny model at sft's default size (rlkit.tiny), vocabulary of its character tokenizer
    "tiny": {"model_type": "llama", "vocab_size": 0, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
             "tie_word_embeddings": True},
    # ~100M parameters (Qwen2-shaped, untied head)
    "100m": {"model_type": "qwen2", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
             "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 2048,
             "tie_word_embeddings": False},
}
SHAPES = {"tiny": (16, 8, 48), "100m": (4, 64, 192)}  # rows, prompt, completion


def real_step(spec: dict) -> int:
    """Peak RSS growth (bytes) of the spec's engine step run twice for real, fp32, in this process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlkit.training import Optim, TrainOptions
    from rlkit.training.engine import Engine
    from rlkit.training.supervised import CrossEntropy

    d = dict(spec["config"])
    kind = d.pop("model_type")
    torch.set_num_threads(1)

    def engine(cfg) -> Engine:
        cfg._attn_implementation = "sdpa"
        return Engine(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), CrossEntropy(), Optim(lr=1e-5),
                      train=TrainOptions(dtype="fp32"), device="cpu")

    warm = engine(AutoConfig.for_model(kind, **{**d, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                                "num_key_value_heads": 2}))
    wp = warm.objective.plan([[5] * 8, [5] * 8], [2, 2])
    warm.step(wp, wp.rows)
    warm.step(wp, wp.rows)
    del warm
    rows, length = spec["rows"], spec["prompt"] + spec["completion"]
    base = _reset_peak_rss()
    eng = engine(AutoConfig.for_model(kind, **d))
    plan = eng.objective.plan([[5] * length for _ in range(rows)], [spec["prompt"]] * rows)
    for _ in range(2):
        eng.step(plan, plan.rows)
    return _status("VmHWM") - base


def _status(key: str) -> int:
    """A figure of /proc/self/status in bytes (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> int:
    """The peak RSS (VmHWM) reset to the RSS now (Linux: /proc/self/clear_refs, 5); -> the RSS now."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def measure_real(spec: dict) -> int:
    """`real_step` in a child process of its own (a clean baseline), glibc returning freed pages at once."""
    r = subprocess.run([sys.executable, __file__, "--real", json.dumps(spec)], capture_output=True, text=True,
                       env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if r.returncode:
        raise SystemExit(f"real step failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["rss"]


def spec_for(name: str) -> dict:
    config = dict(MODELS[name])
    if not config["vocab_size"]:
        from rlkit.tiny import build_tokenizer

        config["vocab_size"] = len(build_tokenizer())
    rows, prompt, completion = SHAPES[name]
    return {"stage": "sft", "config": config, "rows": rows, "prompt": prompt, "completion": completion,
            "train": {"dtype": "fp32", "micro_batch_size": None, "micro_batch_tokens": None, "packing": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--real", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.real:
        print(json.dumps({"rss": real_step(json.loads(a.real))}))
        return
    from rlkit import planner

    rows = []
    print(f"{'model':6} {'params':>8} {'rows x tokens':>14} {'planned MiB':>12} {'real RSS MiB':>13} {'plan/real':>9} "
          f"{'trace s':>8} {'real s':>7}")
    for name in a.models:
        spec = spec_for(name)
        t0 = time.monotonic()
        measured = planner.run_traces([spec])[0]
        t1 = time.monotonic()
        est = planner.estimate("sft", measured, planner.Hardware(), {})
        real = measure_real(spec)
        t2 = time.monotonic()
        n = planner.parameters(spec["config"])
        row = {"model": name, "parameters": n, "rows": spec["rows"], "tokens": spec["prompt"] + spec["completion"],
               "planned": est.peak, "real_rss": real, "ratio": est.peak / real, "trace_s": t1 - t0, "real_s": t2 - t1}
        rows.append(row)
        print(f"{name:6} {n / 1e6:7.1f}M {row['rows']:>5} x {row['tokens']:<6} {est.peak / 2**20:12.1f} "
              f"{real / 2**20:13.1f} {row['ratio']:9.3f} {row['trace_s']:8.1f} {row['real_s']:7.1f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
