"""The card's pipe on one GPU, as a user runs it: `rlkit sft` with its defaults, then
`rollout --engine vllm | score-ref | update`, every stage on CUDA; vLLM's log-probs against the HF forward pass
of the same checkpoint on the same tokens, in half precision."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from .conftest import auto_dtype, bash, device_line, metrics_rows, on_cuda, vllm_half
from conftest import rlkit_cmd

TOL_MEAN = 1e-2  # mean |log-prob gap| per token, vLLM in bf16 vs HF (about 3e-3 for this model: bf16 rounding)
TOL_MAX = 0.25  # any one token: far above bf16 rounding (~0.02 here), far below a misaligned token (~1 and more)


def test_sft_defaults_on_cuda_train_in_bf16_and_record_the_gpu(cuda_sft, gpu):
    """`rlkit sft --out DIR` on a GPU machine: --device auto is the GPU, --dtype auto is bf16 there, the stage says so
    once on stderr, and the manifest records the GPU, the resolved dtype and the peak GPU memory."""
    m, want = cuda_sft.manifest, auto_dtype(gpu)
    on_cuda(m)
    assert m["device"] == f"cuda:{gpu['index']}" and m["gpu"] == gpu["name"] and m["gpu_count"] == gpu["count"]
    assert device_line(cuda_sft.stderr, "sft") == f"sft: device {m['device']} ({m['gpu']}, {want})"
    assert m["config"]["train"]["dtype"] == want  # the resolved dtype, not "auto": the manifest says what ran
    assert m["weights_dtype"] == "fp32"  # bf16 is autocast over fp32 master weights
    peak = m["metrics"]["gpu_mem_peak_gib"]
    assert 0 < peak < gpu["memory_gib"]
    assert m["metrics"]["train_loss"] < 4.0  # it trained: ln(100) = 4.6 at init
    assert "Traceback" not in cuda_sft.stderr


def test_card_pipe_with_vllm_on_one_gpu(vllm_ok, cuda_sft, cuda_ref, gpu, tmp_path):
    from rlkit.algorithms.inputs import build_batch, recompute_logprobs
    from rlkit.io import checkpoints, streams

    sft, ref, d, cmd = cuda_sft.dir, cuda_ref, tmp_path, " ".join(rlkit_cmd())
    r = bash(
        f"{cmd} rollout --engine vllm --dtype {vllm_half(gpu)} --policy {sft} --task arithmetic --num-prompts 64 "
        f"--n 8 --seed 3 --colocate {ref} "
        f"| tee {d}/rollouts.arrow "
        f"| {cmd} score-ref --ref {ref} "
        f"| tee {d}/scored.arrow "
        f"| {cmd} update --policy {sft} --out {d}/upd --metrics {d}/metrics.jsonl\n")
    (d / "stderr.txt").write_text(r.stderr)
    assert r.returncode == 0, r.stderr[-4000:]
    err = r.stderr
    assert "rollout: engine vllm (asked for)" in err
    # every stage says once where it runs, and records it
    device_line(err, "rollout")
    device_line(err, "score-ref")
    rolls, rman = streams.read_table(d / "rollouts.arrow", ["rollouts"])
    _, sman = streams.read_table(d / "scored.arrow", ["scored"])
    man = json.loads((d / "upd" / "rlkit.json").read_text())
    for mf in (rman.manifest, sman.manifest, man):
        on_cuda(mf)
    assert rman.manifest["engine"] == "vllm" and rolls.num_rows == 64 * 8
    assert device_line(err, "update") == f"update: device {man['device']} ({man['gpu']}, {auto_dtype(gpu)})"
    assert man["config"]["train"]["dtype"] == auto_dtype(gpu)

    # update: trained on the GPU, pi_old recomputed by the trainer (vLLM's are not the trainer's log-probs)
    m = man["metrics"]
    rows = metrics_rows(d / "metrics.jsonl", "update")
    assert len(rows) == 1 and rows[0]["gpu_mem_peak_gib"] == m["gpu_mem_peak_gib"]
    assert m["step"] == 1 and m["old_logprobs"] == "recompute"
    assert 0 < m["gpu_mem_peak_gib"] < gpu["memory_gib"]
    print(f"\nupdate's logged mismatch (trainer {auto_dtype(gpu)} vs vLLM {vllm_half(gpu)}): mean "
          f"{m['logprob_mismatch']:.3g}, max {m['logprob_mismatch_max']:.3g}")
    assert 0 <= m["logprob_mismatch"] < TOL_MEAN and m["logprob_mismatch_max"] < TOL_MAX
    w0, w1 = load_file(str(sft / "model.safetensors")), load_file(str(d / "upd" / "model.safetensors"))
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w0) > 0  # the update moved the weights

    # vLLM's logged log-probs against the HF forward pass of the same checkpoint on the same tokens: fp32, on
    # the CPU of this process (the exact values; this process never holds the GPU)
    model, tok = checkpoints.load_policy(sft, "fp32")
    batch, _ = build_batch(rolls, tok.pad_token_id)
    hf = recompute_logprobs(model, batch, 1.0, 64)
    gap = (hf - batch.old_logp).abs()[batch.mask]
    print(f"vLLM ({vllm_half(gpu)}) vs HF (fp32) over {int(batch.mask.sum())} tokens: mean {float(gap.mean()):.3g}, "
          f"max {float(gap.max()):.3g}")
    assert float(gap.mean()) < TOL_MEAN and float(gap.max()) < TOL_MAX
