"""The planner's table for docs/gpu.md: `rlkit update` (GRPO) on Qwen2.5 0.5B / 1.5B / 7B / 14B (the shapes shipped
in rlkit/planner/models) x {1, 8, 16} GPUs of 80 GB x {full fine-tune, LoRA r64} x {sequences of 2k, 8k tokens}:
whether one optimizer step of 128 rows fits with the GPU defaults, its peak per GPU, and the smallest change of
flags that makes it fit.

Usage: python benchmarks/plan_table.py [--models qwen2.5-7b ...] [--gpus 1 8 16] [--json FILE]

Each case is traced by the planner (`rlkit.planner.plan_trainings`: the real update step on fake tensors, FSDP2
over the GPUs): first with the GPU defaults (--dtype auto = bf16 autocast over fp32 masters, micro-batches of
16,384 tokens), then, where that does not fit, with --micro-batch-size 1 --gradient-checkpointing, the least memory a step of these rows
takes on that many GPUs. A sequence is a quarter prompt, three quarters completion. Prints the markdown table docs/gpu.md holds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b")
ROWS = 128  # update's default --minibatch-size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--seqs", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--gpu-memory", type=float, default=80.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from dataclasses import replace

    from rlkit import planner
    from rlkit.training import TrainOptions
    from rlkit.training.lora import LoraOptions

    tries = [({}, TrainOptions()),
             ({"--micro-batch-size": 1, "--gradient-checkpointing": True},
              TrainOptions(micro_batch_size=1, gradient_checkpointing=True))]
    out = []
    t0 = time.monotonic()
    print("| model | GPUs | training | sequence | fits (defaults) | peak per GPU | least memory | its peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in a.models:
        config = planner.model_config(name)
        for gpus in a.gpus:
            hw = planner.Hardware(gpus, a.gpu_memory)
            for mode in ("full", "lora"):
                for seq in a.seqs:
                    work = planner.Work(seq // 4, seq - seq // 4, ROWS)
                    lora = LoraOptions(rank=64) if mode == "lora" else None
                    ests = planner.plan_trainings("update", config, work, [(replace(tries[0][1], lora=lora), hw)])
                    if not ests[0].fits:  # the least memory a step of these rows takes on these GPUs
                        ests += planner.plan_trainings("update", config, work, [(replace(tries[1][1], lora=lora), hw)])
                    first = ests[0]
                    fix = next(((flags, e) for (flags, _), e in zip(tries, ests, strict=False) if e.fits), None)
                    if first.fits:
                        change, peak = "-", "-"
                    elif fix is not None:
                        change = " ".join(k if v is True else f"{k} {v}" for k, v in fix[0].items())
                        peak = f"{fix[1].peak / planner.GIB:.1f} GiB"
                    else:
                        change, peak = ("more GPUs" if mode == "lora" else "LoRA or more GPUs"), "-"
                    label = "full fine-tune" if mode == "full" else "LoRA r64"
                    print(f"| {name} | {gpus} | {label} | {seq // 1024}k | {'yes' if first.fits else 'no'} | "
                          f"{first.peak / planner.GIB:.1f} GiB | {change} | {peak} |", flush=True)
                    out.append({"model": name, "gpus": gpus, "mode": mode, "seq": seq,
                                "plans": [e.to_json() for e in ests]})
    print(f"\n{len(out)} cases, {time.monotonic() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
