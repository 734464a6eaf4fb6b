"""--dtype bf16/fp16 (autocast over fp32 master weights) and --gradient-checkpointing on the real tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.inputs import build_batch
from rlkit.algorithms.trainer import Trainer
from rlkit.io import checkpoints, streams
from rlkit.ops.logprobs import gather_logprobs
from rlkit.training import Precision, TrainOptions

from conftest import one_error_line, run_cli, run_cli_inproc, stage


def test_half_precision_logprobs_keep_no_fp32_copy_and_match_autograd():
    """bf16 logits: the custom backward equals autograd through per-chunk upcasts, bit for bit, and what
    autograd saves for backward is the bf16 logits alone (no (B, T, V) fp32 copy)."""
    torch.manual_seed(0)
    x = torch.randn(3, 70, 50).to(torch.bfloat16)
    t = torch.randint(0, 50, (3, 70))
    g = torch.randn(3, 70)
    a = x.clone().requires_grad_()
    lp, ent = gather_logprobs(a, t, chunk=32, temperature=0.7, with_entropy=True)
    (lp * g).sum().backward()
    b = x.clone().requires_grad_()
    parts = []
    for s in range(0, 70, 32):
        lg = b[:, s : s + 32].float() / 0.7
        parts.append(lg.gather(-1, t[:, s : s + 32, None]).squeeze(-1) - torch.logsumexp(lg, -1))
    ref = torch.cat(parts, 1)
    (ref * g).sum().backward()
    assert torch.equal(lp, ref.detach()) and torch.equal(a.grad, b.grad)
    assert lp.dtype == torch.float32 and ent.shape == (3, 70)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda z: saved.append(z) or z, lambda z: z):
        gather_logprobs(x.clone().requires_grad_(), t, chunk=32)
    big = [z for z in saved if z.numel() >= x.numel()]
    assert big and all(z.dtype == torch.bfloat16 for z in big), [(z.dtype, z.shape) for z in big]


def test_fp16_loss_scaler_skips_an_overflowing_step_and_counts_it():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    prec = Precision("fp16")
    before = [p.detach().clone() for p in m.parameters()]
    with prec.autocast():
        y = m(torch.randn(2, 4))
    prec.backward(y.float().sum() * float("inf"))  # inf gradients
    _, stepped = prec.step([(m.parameters(), opt, 1.0)])
    assert not stepped and prec.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert prec.state()["scale"] == 65536.0 / 2  # backed off
    opt.zero_grad()
    with prec.autocast():
        y = m(torch.randn(2, 4))
    prec.backward(y.float().sum() * 1e-3)  # scaled by 32768, still inside fp16's range
    _, stepped = prec.step([(m.parameters(), opt, 1.0)])
    assert stepped and not all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    p2 = Precision("fp16")
    p2.load_state(prec.state())
    assert p2.scaler.get_scale() == prec.scaler.get_scale()


def _rollouts(sft_dir, out, seed, num=12, n=4):
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", str(num), "--n", str(n), "--seed", str(seed),
          "--out", str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sequential_half_precision_updates_equal_one_process(sft_dir, tmp_path, dtype):
    """Two `update --dtype` processes == the same two updates in one process, exactly: the fp32 master
    weights, AdamW moments and (fp16) loss scale travel in the checkpoint."""
    r1 = _rollouts(sft_dir, tmp_path / "r1.arrow", seed=1)
    r2 = _rollouts(sft_dir, tmp_path / "r2.arrow", seed=2)
    flags = ["--beta", "0", "--minibatch-size", "16", "--epochs", "2", "--lr", "1e-3", "--dtype", dtype,
             "--length-penalty", "0.05"]
    for src, pol, out in ((r1, sft_dir, tmp_path / "u1"), (r2, tmp_path / "u1", tmp_path / "u2")):
        r = run_cli("update", "--policy", str(pol), "--in", str(src), "--out", str(out), *flags)
        assert r.returncode == 0, r.stderr
        assert f"--dtype {dtype} computes other log-probs" in r.stderr.decode()  # auto: pi_old recomputed
    cfg = RLConfig(beta=0.0, minibatch_size=16, epochs=2, lr=1e-3)
    model, tok = checkpoints.load_policy(sft_dir)
    trainer = Trainer(model, cfg, tokenizer=tok, train=TrainOptions(dtype=dtype))
    prec = trainer.prec
    for src in (r1, r2):
        t, _ = streams.read_table(src, ["rollouts"])
        batch, _ = build_batch(t, tok.pad_token_id, length_penalty=0.05)
        m = trainer.train(batch, length_norm=16.0, recompute=True)
        assert m["logprob_mismatch"] > 0  # the trainer's half-precision pass is not the fp32 engine's
    seq = load_file(str(tmp_path / "u2" / "model.safetensors"))
    one = model.state_dict()
    sft = load_file(str(sft_dir / "model.safetensors"))
    assert all(torch.equal(seq[k], one[k]) for k in seq)
    assert any(not torch.equal(sft[k], one[k]) for k in seq)
    with safe_open(str(tmp_path / "u2" / "model.safetensors"), "pt") as f:  # the fp32 master is what is saved
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    man = json.loads((tmp_path / "u2" / "rlkit.json").read_text())
    assert man["config"]["train"]["dtype"] == dtype and man["weights_dtype"] == "fp32"
    st = json.loads((tmp_path / "u2" / "trainer" / "state.json").read_text())
    assert st["precision"]["dtype"] == dtype
    if dtype == "fp16":
        assert st["precision"]["scale"] == prec.scaler.get_scale()
        assert man["metrics"]["loss_scale"] == prec.scaler.get_scale()


@pytest.mark.slow
def test_gradient_checkpointing_changes_memory_not_the_update(sft_dir, tmp_path):
    """Recomputing activations in backward gives the same weights (fp32 and bf16) as keeping them."""
    r = _rollouts(sft_dir, tmp_path / "r.arrow", seed=3)
    cfg = RLConfig(beta=0.0, minibatch_size=16, epochs=1, lr=1e-3)
    t, _ = streams.read_table(r, ["rollouts"])
    for dtype in ("fp32", "bf16"):
        out = []
        for ckpt in (False, True):
            model, tok = checkpoints.load_policy(sft_dir)
            trainer = Trainer(model, cfg, train=TrainOptions(dtype=dtype, gradient_checkpointing=ckpt))
            assert model.is_gradient_checkpointing == ckpt
            batch, _ = build_batch(t, tok.pad_token_id, length_penalty=0.05)
            trainer.train(batch, length_norm=16.0)
            out.append(model.state_dict())
        assert all(torch.allclose(out[0][k], out[1][k], atol=1e-6) for k in out[0]), dtype


@pytest.mark.slow
def test_every_training_stage_runs_in_bf16_with_checkpointing(sft_dir, ref_dir, tmp_path):
    """sft, train-rm, and update's PPO (policy and critic) and DPO, as a user runs them."""
    half = ["--dtype", "bf16", "--gradient-checkpointing"]
    r = run_cli("sft", "--model", str(sft_dir), "--num-examples", "64", "--eval-num", "4", "--out",
                str(tmp_path / "sft"), *half)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "sft" / "rlkit.json").read_text())
    assert m["config"]["train"] == {"dtype": "bf16", "gradient_checkpointing": True, "lora": None,
                                    "micro_batch_size": None, "micro_batch_tokens": None, "packing": True,
                                    "dist_timeout": 60.0}
    assert m["weights_dtype"] == "fp32"
    assert m["metrics"]["train_loss"] == m["metrics"]["train_loss"]  # finite, not NaN

    prefs = tmp_path / "prefs.arrow"
    stage("build-prefs", "--policy", str(sft_dir), "--num-prompts", "24", "--out", str(prefs))
    r = run_cli("train-rm", "--model", str(sft_dir), "--prefs", str(prefs), "--epochs", "1", "--out",
                str(tmp_path / "rm"), *half)
    assert r.returncode == 0, r.stderr

    roll = _rollouts(sft_dir, tmp_path / "r.arrow", seed=4, num=8)
    stage("score-ref", "--ref", str(ref_dir), "--in", str(roll), "--out", str(tmp_path / "s.arrow"))
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(tmp_path / "s.arrow"), "--algo", "ppo",
                "--minibatch-size", "16", "--out", str(tmp_path / "ppo"), *half)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ppo" / "critic" / "model.safetensors").is_file()
    m = json.loads((tmp_path / "ppo" / "rlkit.json").read_text())["metrics"]
    assert m["old_logprobs"] == "recompute" and m["value_loss"] == m["value_loss"]

    stage("score-ref", "--ref", str(ref_dir), "--in", str(prefs), "--out", str(tmp_path / "sp.arrow"))
    r = run_cli("update", "--policy", str(sft_dir), "--algo", "dpo", "--in", str(tmp_path / "sp.arrow"),
                "--out", str(tmp_path / "dpo"), *half)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "dpo" / "rlkit.json").read_text())["config"]["train"]["dtype"] == "bf16"


def test_bad_precision_options_are_one_line_and_write_nothing(sft_dir, tmp_path):
    out = tmp_path / "out"
    r = run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(tmp_path / "none.arrow"), "--out", str(out),
                       "--dtype", "fp8")  # a choice: click's usage error names the option and the choices
    assert r.returncode == 2 and "Invalid value for '--dtype'" in r.stderr.decode()
    assert "'fp8' is not one of 'auto', 'fp32', 'bf16', 'fp16'" in r.stderr.decode()
    r = run_cli("sft", "--model", str(sft_dir), "--out", str(out), "--dtype", "fp16", env={"WORLD_SIZE": "2"})
    assert "fp16 under torchrun" in one_error_line(r)
    r = run_cli_inproc("train-rm", "--model", str(sft_dir), "--prefs", str(tmp_path / "p.arrow"), "--out", str(out),
                       "--dtype", "half")
    assert r.returncode == 2 and "'half' is not one of" in r.stderr.decode()
    assert not out.exists()
    with pytest.raises(Exception, match="expected one of"):
        TrainOptions(dtype="float16").check()


@pytest.mark.slow
def test_bf16_with_checkpointing_under_torchrun_matches_one_process(sft_dir, tmp_path):
    """FSDP2: gradient checkpointing is enabled before sharding; autocast runs over the sharded fp32
    parameters; the update equals one process's up to float summation order."""
    roll = _rollouts(sft_dir, tmp_path / "r.arrow", seed=5, num=16)
    flags = ["--beta", "0", "--lr", "1e-3", "--minibatch-size", "32", "--epochs", "1", "--length-penalty", "0.05",
             "--dtype", "bf16", "--gradient-checkpointing"]
    one = tmp_path / "one"
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(one), *flags)
    assert r.returncode == 0, r.stderr
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlkit",
           "update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(two), *flags]
    r = subprocess.run(cmd, capture_output=True, timeout=600, input=b"",
                       env={**os.environ, "RLKIT_DEBUG": "0", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    w1, w2, w0 = (load_file(str(d / "model.safetensors")) for d in (one, two, sft_dir))
    # bf16 rounds differently when each rank's matmuls see half the rows, and AdamW moves a weight by
    # ~lr whatever the size of its gradient, so single weights may differ by ~lr: compare the update as
    # a whole (observed here: 1.0% apart, cosine 0.99995)
    d1 = torch.cat([(w1[k] - w0[k]).flatten() for k in sorted(w1)])
    d2 = torch.cat([(w2[k] - w0[k]).flatten() for k in sorted(w1)])
    assert float(d1.norm()) > 1e-3
    assert float((d1 - d2).norm() / d1.norm()) < 0.05 and float(torch.nn.functional.cosine_similarity(d1, d2, 0)) > 0.999
