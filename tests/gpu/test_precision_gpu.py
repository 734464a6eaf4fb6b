"""What `--dtype auto` runs in on a GPU, for real: vLLM samples in bf16, score-ref's reference and reward models run in
bf16, TF32 is on, LoRA's frozen base is held in bf16, and an `update --follow` step leaves no gradients behind. The
stages run as `rlkit` processes; the in-process checks run in a python subprocess (this pytest process never touches
CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import bash, device_line, on_cuda
from conftest import rlkit_cmd


def _manifest(table) -> dict:
    from rlkit.io import streams

    _, reader = streams.read_table(table, ["rollouts", "scored"])
    return reader.record.raw


def test_auto_samples_and_scores_in_bf16_with_tf32(vllm_ok, cuda_sft, cuda_ref, gpu, tmp_path):
    if not gpu["bf16"]:
        import pytest

        pytest.skip("this GPU has no bf16 kernels: --dtype auto keeps the stored dtypes there")
    cmd, sft, ref = " ".join(rlkit_cmd()), cuda_sft.dir, cuda_ref
    r = bash(f"{cmd} rollout --policy {sft} --engine vllm --n 4 --num-prompts 8 --out {tmp_path}/r.arrow\n"
             f"{cmd} score-ref --ref {ref} --rm rm={sft} --no-verify --in {tmp_path}/r.arrow --out {tmp_path}/s.arrow\n")
    assert r.returncode == 0, r.stderr[-4000:]
    assert device_line(r.stderr, "rollout").endswith(", bf16)")  # an fp32 checkpoint, sampled in bf16
    assert device_line(r.stderr, "score-ref").endswith(", bf16)")
    rolled, scored = _manifest(tmp_path / "r.arrow"), _manifest(tmp_path / "s.arrow")
    assert rolled["sampling_dtype"] == "bf16" and rolled["config"]["dtype"] == "auto"
    assert scored["config"]["dtype"] == "bf16"  # what auto became
    on_cuda(scored)
    assert scored["tf32"] is True


def test_lora_base_in_bf16_and_no_gradients_after_a_follow_step(cuda_sft, gpu, tmp_path):
    """In a subprocess on CUDA: a LoRA Trainer under --dtype auto holds its base's linear layers in bf16 and its
    adapter and AdamW state in fp32; after a step and `free_grads` no parameter holds a gradient."""
    code = f"""
import json, torch
from pathlib import Path
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.inputs import build_batch
from rlkit.io import checkpoints, streams
from rlkit.stages.rollout import RolloutConfig
from rlkit.stages.rollout import run as rollout
from rlkit.training import LoraOptions, TrainOptions
from rlkit.algorithms.trainer import free_grads
from rlkit.training.runtime import Runtime
from rlkit.algorithms.trainer import Trainer
from rlkit import devices

sft = Path({str(cuda_sft.dir)!r})
rt = Runtime.resolve("auto", TrainOptions(lora=LoraOptions(rank=4)))
model, tok = checkpoints.load_policy(sft, "fp32")
t = Trainer(model, RLConfig(minibatch_size=4, epochs=1, beta=0.0), tokenizer=tok, base=sft, runtime=rt)
dtypes = {{str(p.dtype) for n, p in t.model.named_parameters() if not p.requires_grad and "proj" in n}}
trained = {{str(p.dtype) for p in t.model.parameters() if p.requires_grad}}
table = rollout(RolloutConfig(policy=sft, engine="hf", num_prompts=2, n=4, out=Path({str(tmp_path)!r}) / "r.arrow"))
rows, _ = streams.read_table(table, ["rollouts"])
batch, _ = build_batch(rows, tok.pad_token_id)
t.train(batch, temperature=1.0, length_norm=16.0)
had = any(p.grad is not None for p in t.model.parameters())
free_grads(t)
devices.release_cached(t.device)
print(json.dumps({{"tf32": devices.tf32_enabled(), "dtype": t.train_options.dtype, "base": sorted(dtypes),
                  "trained": sorted(trained), "had": had,
                  "grads": sum(p.grad is not None for tr in t.trained for p in tr.model.parameters())}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tf32"] is True and got["had"] is True and got["grads"] == 0
    assert got["trained"] == ["torch.float32"]
    assert got["base"] == (["torch.bfloat16"] if gpu["bf16"] else ["torch.float32"]), got
