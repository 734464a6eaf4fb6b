"""Persistent stages on one GPU: `rollout --follow DIR --engine vllm | score-ref | update --follow --out DIR`. At
--max-lag 0 the stages take turns, so rollout puts vLLM to sleep (its sleep mode: weights to host memory, KV cache
dropped) while update trains, and says so on stderr; at --max-lag 1 sampling overlaps training."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from .conftest import bash, device_line, metrics_rows, on_cuda
from conftest import rlkit_cmd

P, N, STEPS = 16, 4, 3  # prompts per step, samples per prompt, steps
SLEEPS = "rollout: --max-lag 0: the engine sleeps between batches"  # docs/gpu.md, "Follow mode on one GPU"


def sleep_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(SLEEPS)]


@pytest.mark.parametrize("lag", [0, 1])
def test_follow_pipe_on_one_gpu(vllm_ok, cuda_sft, cuda_ref, lag, tmp_path):
    sft, ref, root, cmd = cuda_sft.dir, cuda_ref, tmp_path / "ckpts", " ".join(rlkit_cmd())
    r = bash(
        f"{cmd} rollout --follow {root} --policy {sft} --engine vllm --n {N} --batch-prompts {P} --max-lag {lag} "
        f"--seed 100 "
        f"| {cmd} score-ref --ref {ref} "
        f"| {cmd} update --follow --policy {sft} --out {root} --max-steps {STEPS} --max-lag {lag} "
        f"--minibatch-size 32 --epochs 1 --metrics {tmp_path}/metrics.jsonl\n")
    (tmp_path / "stderr.txt").write_text(r.stderr)
    assert r.returncode == 0, r.stderr[-4000:]
    err = r.stderr
    # one process per stage for the whole run: each says once where it runs
    for stage in ("rollout", "score-ref", "update"):
        device_line(err, stage)

    steps = sorted(p.name for p in root.glob("step-*"))
    assert steps == [f"step-{i:06d}" for i in range(1, STEPS + 1)]
    for s in steps:
        on_cuda(json.loads((root / s / "rlkit.json").read_text()))
    rows = metrics_rows(tmp_path / "metrics.jsonl", "update")
    assert [u["step"] for u in rows] == list(range(1, STEPS + 1))
    assert all(u["gpu_mem_peak_gib"] > 0 for u in rows)
    assert max(u["lag_max"] for u in rows) <= lag
    # the live engine took the new weights between batches (batch b waits for step >= b - lag)
    assert err.count("weights reloaded") >= STEPS - 1 - lag
    # each step is the weights vLLM serves, bf16 (2 bytes a parameter), taken in place in that dtype; the fp32 masters
    # and AdamW go into the snapshot (every step: the input is a stream)
    for s in steps:
        assert json.loads((root / s / "config.json").read_text())["dtype"] == "bfloat16"
        assert not (root / s / "trainer").exists()
    n = sum(p.numel() for p in load_file(str(sft / "model.safetensors")).values())
    assert all(u["publish_dtype"] == "bf16" and u["publish_bytes"] < 2.2 * n for u in rows)
    assert all(u["snapshot_bytes"] > 5 * u["publish_bytes"] for u in rows)  # fp32 weights and two moments: 12 B/param
    reloads = [ln for ln in err.splitlines() if "weights reloaded in" in ln or "update: wrote" in ln]
    print("\n" + "\n".join(reloads))  # publish, snapshot and reload seconds, as `make gpu-checks` shows them

    assert "stays awake" not in err  # what rollout says where sleep mode is unavailable (vLLM's CPU backend)
    if lag == 0:
        # rollout waits for every step while update trains: vLLM sleeps meanwhile, and says so
        assert sleep_lines(err), f"rollout --max-lag 0 on a GPU did not say '{SLEEPS} ...'"
        assert all(u["lag_max"] == 0 for u in rows)
    else:
        assert sleep_lines(err) == []  # sampling overlaps training: the engine stays up with its whole share
