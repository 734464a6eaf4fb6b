"""A LoRA checkpoint on vLLM on a GPU: vLLM runs it as base + adapter, its log-probs are those of the merged model
(HF, fp32), and `update` keeps training the adapter on the GPU."""

from __future__ import annotations

import json

from .conftest import bash, device_line, on_cuda, vllm_half
from conftest import make_lora_checkpoint, rlkit_cmd

TOL_MEAN = 1e-2  # mean |log-prob gap| per token, vLLM in bf16 with its LoRA kernels vs the merged model in fp32


def test_lora_checkpoint_on_vllm_then_update_on_cuda(vllm_ok, cuda_sft, gpu, tmp_path):
    from rlkit.algorithms.inputs import build_batch, recompute_logprobs
    from rlkit.io import checkpoints, streams

    # an adapter far from zero on the GPU-trained policy (made on the CPU of this process, as `update` saves one)
    lora = make_lora_checkpoint(cuda_sft.dir, tmp_path / "lora", seed=1, rank=4)
    d, cmd = tmp_path, " ".join(rlkit_cmd())
    r = bash(
        f"{cmd} rollout --engine vllm --dtype {vllm_half(gpu)} --policy {lora} --num-prompts 32 --n 4 --seed 5 "
        f"| tee {d}/rollouts.arrow "
        f"| {cmd} update --policy {lora} --out {d}/lora2 --beta 0 --epochs 1 --minibatch-size 32 --device cuda "
        f"--metrics {d}/metrics.jsonl\n")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rollout: engine vllm (asked for)" in r.stderr
    device_line(r.stderr, "rollout")
    device_line(r.stderr, "update")

    rolls, reader = streams.read_table(d / "rollouts.arrow", ["rollouts"])
    on_cuda(reader.manifest)
    assert reader.manifest["engine"] == "vllm" and rolls.num_rows == 32 * 4

    # update kept training the adapter, on the GPU
    man = json.loads((d / "lora2" / "rlkit.json").read_text())
    on_cuda(man)
    assert man["lora"]["rank"] == 4 and man["lora"]["base"] == str(cuda_sft.dir.absolute())
    assert (d / "lora2" / "adapter_model.safetensors").is_file() and not (d / "lora2" / "model.safetensors").exists()
    m = man["metrics"]
    assert m["old_logprobs"] == "recompute" and m["logprob_mismatch"] < TOL_MEAN and m["gpu_mem_peak_gib"] > 0

    # vLLM's logged log-probs are the merged model's (HF, fp32, on this process's CPU), not the base's
    gaps = {}
    for name, ckpt in (("lora", lora), ("base", cuda_sft.dir)):
        model, tok = checkpoints.load_policy(ckpt, "fp32", merged=True)
        batch, _ = build_batch(rolls, tok.pad_token_id)
        gaps[name] = recompute_logprobs(model, batch, 1.0, 64)
    mask = batch.mask
    vllm_vs_lora = float((gaps["lora"] - batch.old_logp).abs()[mask].mean())
    lora_vs_base = float((gaps["lora"] - gaps["base"]).abs()[mask].mean())
    print(f"\nvLLM ({vllm_half(gpu)}, LoRA) vs HF merged (fp32): mean {vllm_vs_lora:.3g}; the adapter moves the "
          f"log-probs by {lora_vs_base:.3g} on average")
    assert vllm_vs_lora < TOL_MEAN
    assert lora_vs_base > 3 * vllm_vs_lora  # the adapter was applied: without it vLLM would be this far off
