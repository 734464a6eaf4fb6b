"""`torchrun --nproc-per-node 2` on 2 GPUs (NCCL, FSDP2, cuda:LOCAL_RANK) against 1 process on 1 GPU, as
tests/e2e/test_distributed.py does on the CPU: the same update up to float summation order.

The parity runs are fp32 with TF32 off (NVIDIA_TF32_OVERRIDE=0 holds cuBLAS to full fp32 whatever torch's
settings): with 10-bit TF32 products a gradient element near zero can change sign between the two summation
orders, and AdamW turns any such flip into a full step of difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlkit.follow import snapshots

from .conftest import auto_dtype, device_line, on_cuda
from conftest import run_cli

FP32 = {"NVIDIA_TF32_OVERRIDE": "0"}


def torchrun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlkit", *args]
    return subprocess.run(cmd, input=b"", capture_output=True, timeout=1200,
                          env={**os.environ, "RLKIT_DEBUG": "0", **(env or {})})


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_update_and_sft_on_two_gpus_match_one(two_gpus, cuda_sft, gpu, tmp_path):
    sft = cuda_sft.dir
    roll = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft), "--engine", "hf", "--num-prompts", "24", "--n", "4", "--seed", "1",
                "--out", str(roll), timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    # the session SFT model is weak (rewards mostly 0): a length penalty gives every group a signal
    flags = ["--beta", "0", "--lr", "1e-3", "--minibatch-size", "32", "--epochs", "2", "--seed", "3",
             "--length-penalty", "0.05", "--dtype", "fp32", "--in", str(roll)]

    one, two = tmp_path / "one", tmp_path / "two"
    r1 = run_cli("update", "--policy", str(sft), "--out", str(one), *flags, env=FP32, timeout=900)
    assert r1.returncode == 0, r1.stderr.decode()[-3000:]
    r2 = torchrun("update", "--policy", str(sft), "--out", str(two), *flags, env=FP32)
    err = r2.stderr.decode()
    assert r2.returncode == 0, err[-3000:]
    assert err.count("data-parallel over 2 processes") == 1  # rank 0 alone talks
    m1, m2 = (json.loads((d / "rlkit.json").read_text()) for d in (one, two))
    # rank 0 runs on cuda:0 (LOCAL_RANK), rank 1 on cuda:1; the manifest is rank 0's
    assert device_line(err, "update") == f"update: device cuda:0 ({m2['gpu']}, fp32)"
    on_cuda(m1)
    on_cuda(m2, gpus=2)
    assert m2["device"] == "cuda:0" and m2["metrics"]["world_size"] == 2
    assert m1["metrics"]["gpu_mem_peak_gib"] > 0 and m2["metrics"]["gpu_mem_peak_gib"] > 0

    w1, w2, w0 = (load_file(str(d / "model.safetensors")) for d in (one, two, sft))
    moved = _max_diff(w1, w0)
    print(f"\nupdate: 2 GPUs vs 1 differ by {_max_diff(w1, w2):.3g} where the update moved the weights by {moved:.3g}")
    assert moved > 1e-3 and _max_diff(w1, w2) < 0.02 * moved  # the same update up to float summation order
    for k in ("sequences", "optimizer_steps", "clip_fraction", "reward_mean"):
        assert m2["metrics"][k] == pytest.approx(m1["metrics"][k], rel=1e-6, abs=1e-9), k
    assert m2["metrics"]["loss"] == pytest.approx(m1["metrics"]["loss"], abs=1e-4)

    # sft from the embedded model: 2 GPUs give the 1-GPU weights (~1e-6 on the CPU's gloo after ~30 steps)
    s1, s2 = tmp_path / "sft1", tmp_path / "sft2"
    args = ["sft", "--num-examples", "1000", "--eval-num", "20", "--dtype", "fp32"]
    r = run_cli(*args, "--out", str(s1), env=FP32, timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    r = torchrun(*args, "--out", str(s2), env=FP32)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    a, b = load_file(str(s1 / "model.safetensors")), load_file(str(s2 / "model.safetensors"))
    print(f"sft: 2 GPUs vs 1 differ by {_max_diff(a, b):.3g}")
    assert _max_diff(a, b) < 1e-3
    n1, n2 = (json.loads((d / "rlkit.json").read_text())["metrics"] for d in (s1, s2))
    assert n2["world_size"] == 2 and n2["steps"] == n1["steps"] and n2["tokens"] == n1["tokens"]

    # the defaults under torchrun: --dtype auto is bf16 on each rank's GPU, recorded as such
    auto = tmp_path / "auto"
    r = torchrun("update", "--policy", str(sft), "--in", str(roll), "--out", str(auto), "--beta", "0",
                 "--minibatch-size", "32")
    err = r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    m = json.loads((auto / "rlkit.json").read_text())
    assert device_line(err, "update") == f"update: device cuda:0 ({m['gpu']}, {auto_dtype(gpu)})"
    assert m["config"]["train"]["dtype"] == auto_dtype(gpu) and m["metrics"]["world_size"] == 2
    # bf16: FSDP2's mixed-precision policy gathers bf16 weights (no autocast), AdamW fused on the GPUs
    mixed = ", bf16 all-gathers" if auto_dtype(gpu) == "bf16" else ""
    assert f"data-parallel over 2 processes (cuda, FSDP2{mixed}, fused AdamW)" in err, err[-3000:]
    # pi_old recomputed (bf16 differs from the sampling engine's fp32), each rank its half of the 96 rows
    if mixed:
        assert m["metrics"]["old_logprobs"] == "recompute" and m["metrics"]["recompute_rows"] == 48
    assert m["metrics"]["loss"] == m["metrics"]["loss"]  # finite


def test_a_fleet_two_gpu_workers_and_a_two_gpu_update_match_one_worker_and_one_process(two_gpus, cuda_sft, tmp_path):
    """docs/scale-out.md's fleet on GPUs: worker I on cuda:I (`rollout --follow --shard I/2 --spool`), the update
    under torchrun on both (NCCL), at --max-lag 0; against one worker and a one-process `update --follow` on one
    GPU: the same weights up to float summation order."""
    import shutil

    sft, cmd = cuda_sft.dir, " ".join([sys.executable, "-m", "rlkit"])
    roll = f"{cmd} rollout --policy {sft} --engine hf --n 4 --batch-prompts 16 --chunk-prompts 8 --max-lag 0 --max-steps 2 --seed 100"
    upd = (f"update --follow --policy {sft} --max-steps 2 --max-lag 0 --beta 0 --lr 1e-3 --minibatch-size 32 "
           "--epochs 2 --seed 3 --length-penalty 0.05 --dtype fp32")
    env = {**os.environ, "RLKIT_DEBUG": "0", **FP32}
    one = tmp_path / "one"
    r = subprocess.run(["bash", "-c", f"set -euo pipefail\n{roll} --follow {one} | {cmd} {upd} --out {one}"],
                       capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    two, sp = tmp_path / "two", tmp_path / "spool"
    sp.mkdir()
    ws = [subprocess.Popen(["bash", "-c", f"{roll} --follow {two} --shard {i}/2 --spool {sp}"], env={
        **env, "CUDA_VISIBLE_DEVICES": str(i)}, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    r2 = torchrun(*upd.split(), "--out", str(two), "--in", str(sp), env=FP32)
    assert r2.returncode == 0, r2.stderr.decode()[-3000:]
    for w in ws:
        assert w.wait(timeout=600) == 0, w.stderr.read()[-3000:]
    m = json.loads((two / "step-000002/rlkit.json").read_text())
    on_cuda(m, gpus=2)
    assert m["metrics"]["world_size"] == 2 and len(m["follow"]["batches"]) == 2
    # a step is what the workers load, bf16 on a GPU whatever --dtype trains in; the fp32 masters and AdamW are in
    # the snapshot, each rank's shards written by that rank
    assert m["metrics"]["publish_dtype"] == "bf16" and not (two / "step-000002/trainer").exists()
    a, b = (load_file(str(d / "step-000002/model.safetensors")) for d in (one, two))
    assert {t.dtype for t in (*a.values(), *b.values())} == {torch.bfloat16}
    assert _max_diff(a, b) < 2e-2  # bf16 roundings of masters equal up to float summation order
    snap = two / "snapshots" / "snapshot-000002"
    assert {p.name for p in snap.glob("__*_0.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    ma, mb = (snapshots.read_weights(d / "snapshots" / "snapshot-000002") for d in (one, two))
    assert {t.dtype for t in ma.values()} == {torch.float32}
    assert _max_diff(ma, mb) < 1e-4
    pub = [ln for ln in r2.stderr.decode().splitlines() if "update: wrote" in ln]
    print("\n" + "\n".join(pub))  # publish (and snapshot) seconds and bytes a step, as `make gpu-checks` shows them
    shutil.rmtree(sp)
