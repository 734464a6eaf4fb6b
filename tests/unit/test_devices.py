"""Where the models run (`rlkit.devices`): `--device` resolution, and device placement checked on a CPU.

The placement checks run the real code paths with the model on a GPU simulated on the CPU (tests/devsim.py:
tensors that report `cuda:0` but hold real CPU data, and `torch.cuda` answering for an H100; an op that mixes
them with CPU tensors raises, as CUDA raises "Expected all tensors to be on the same device") and every input
made on the CPU, as the stages make them: the training step of the GRPO family, GSPO, PPO with its critic and
DPO, the log-prob path, score-ref's forward and a reward model's. In fp32 each must compute what it computes
on the CPU, and the trainer may read values back to the host once per optimizer step.

The GPU-only branches run there too, each checked by what it does: `--dtype auto` is bf16 on the GPU and the
update really runs under bf16 autocast, the batch goes over once from pinned memory, the peak-memory figure is
the simulated allocator's, and the GPU memory cache is released where the stage releases it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from devsim import DeviceMismatch, SimulatedGPU, loading_outside

from rlkit import devices
from rlkit.algorithms.config import RLConfig
from rlkit.errors import RlkitError

from conftest import one_error_line, run_cli, run_cli_inproc

# ---------------------------------------------------------------- resolution


def test_device_spellings():
    assert devices.parse("auto") == ("auto", None) and devices.parse("cuda:3") == ("cuda", 3)
    assert devices.parse("CPU") == ("cpu", None)
    for bad in ("tpu", "cuda:", "cuda:x", "cpu:1", "gpu", ""):
        with pytest.raises(RlkitError, match="expected auto, cpu, cuda or cuda:N"):
            devices.parse(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a machine without CUDA")
def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused_in_one_line():
    assert devices.resolve("auto") == torch.device("cpu") and devices.auto_dtype(torch.device("cpu")) == "fp32"
    for spec in ("cuda", "cuda:0", "cuda:7"):
        with pytest.raises(RlkitError, match=f"--device {spec}: CUDA is not available here"):
            devices.resolve(spec)


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda answering as on a 2-GPU machine with bf16 kernels (no GPU is lent to this project: the
    resolution logic is what is under test here, not CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_resolution_on_a_machine_with_two_gpus(two_gpus, monkeypatch):
    assert devices.resolve("auto") == torch.device("cuda", 0)
    assert devices.resolve("cuda") == torch.device("cuda", 0) and devices.resolve("cuda:1") == torch.device("cuda", 1)
    assert devices.resolve("cpu") == torch.device("cpu")  # --device cpu on a GPU machine is honoured
    with pytest.raises(RlkitError, match=r"--device cuda:7: this machine has 2 GPUs \(cuda:0\.\.cuda:1\)"):
        devices.resolve("cuda:7")
    monkeypatch.setenv("LOCAL_RANK", "1")  # under torchrun: each rank its own GPU
    assert devices.resolve("auto") == torch.device("cuda", 1) and devices.resolve("cuda") == torch.device("cuda", 1)
    assert devices.auto_dtype(torch.device("cuda", 1)) == "bf16" and devices.auto_dtype(torch.device("cpu")) == "fp32"
    assert devices.auto_dtype(torch.device("cuda", 1), "fp16") == "fp16"


def test_the_flags_that_lower_memory_are_named_for_an_out_of_memory_error():
    e = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 98765 bytes")
    assert devices.is_out_of_memory(e) and not devices.is_out_of_memory(RuntimeError("shape mismatch"))
    oom = devices.out_of_memory("update", {"minibatch_size": 4096, "micro_batch_size": 64, "micro_batch_tokens": None,
                                           "gradient_checkpointing": False, "lora_rank": None,
                                           "dtype": "auto", "device": "auto", "lr": 1e-5}, e)
    assert oom.exit_code == 71
    # --minibatch-size is shown, never advised: lowering it changes the algorithm, a micro-batch does not
    assert str(oom) == ("update: out of host memory with --minibatch-size 4096, --micro-batch-size 64, --dtype auto, "
                        "--device auto; lower it with --micro-batch-size, --micro-batch-tokens, --gradient-checkpointing, "
                        "--lora-rank; nothing was written")


@pytest.mark.slow
def test_bad_devices_are_one_line_each_and_write_nothing(sft_dir, tmp_path):
    out = tmp_path / "out"
    for stage in (("update", "--policy", str(sft_dir), "--in", str(tmp_path / "none.arrow"), "--out", str(out)),
                  ("sft", "--out", str(out), "--num-examples", "8"),
                  ("score-ref", "--ref", str(sft_dir), "--in", str(tmp_path / "none.arrow"), "--out", str(out))):
        line = one_error_line(run_cli_inproc(*stage, "--device", "tpu"))
        assert line == "rlkit: error: --device 'tpu': expected auto, cpu, cuda or cuda:N (e.g. cuda:0)", line
    if not torch.cuda.is_available():
        line = one_error_line(run_cli("sft", "--out", str(out), "--num-examples", "8", "--device", "cuda:1"))
        assert line.startswith("rlkit: error: --device cuda:1: CUDA is not available here"), line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- placement, on a simulated GPU


@pytest.fixture(scope="module")
def policy(sft_dir):
    from rlkit.io import checkpoints

    return checkpoints.load_policy(sft_dir)


def _rl_batch(tok):
    """Two groups of two rollouts with mixed rewards, reference log-probs, on the CPU."""
    from rlkit.algorithms.inputs import RLBatch
    from rlkit.ops.logprobs import pack_sequences

    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+7=", "12+7=", "3+4=", "3+4=")]
    comps = [tok.encode(s, add_special_tokens=False) for s in ("19", "1", "7", "70")]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    old = torch.where(mask, -torch.rand(mask.shape, generator=g) - 0.5, 0)
    ref = torch.where(mask, old - 0.1 * torch.rand(mask.shape, generator=g), 0)
    return RLBatch(ids, attn, targets, mask, start, old, ref, torch.tensor([1.0, 0.0, 1.0, 0.0]),
                   torch.tensor([0, 0, 1, 1]))


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: (p.elem if hasattr(p, "elem") else p).detach().clone() for n, p in model.named_parameters()}


def _same_update(got, want, start) -> None:
    """The two updates moved the weights alike: |delta_got - delta_want| / |delta_want| < 1%. (The device runs
    other attention kernels, so values differ at 1e-7; AdamW's first steps, ~lr x sign(gradient), turn that
    into a full 2 x lr on the few elements whose gradient is ~0. The norm of the whole update does not.)"""
    w, v, s = _weights(got), _weights(want), _weights(start)
    num = sum(float((w[n] - v[n]).norm() ** 2) for n in v) ** 0.5
    den = sum(float((v[n] - s[n]).norm() ** 2) for n in v) ** 0.5
    assert den > 0 and num / den < 0.01, (num, den)


def _train(model, tok, cfg: RLConfig, batch, sft_dir, device=None, dtype: str = "fp32"):
    from rlkit.algorithms.trainer import Trainer
    from rlkit.training import TrainOptions

    t = Trainer(model, cfg, tokenizer=tok, device=device, train=TrainOptions(dtype=dtype))
    if cfg.algo == "ppo":
        with loading_outside(device):
            t.load(sft_dir)  # the critic, initialised from the policy, moved beside it onto the device
    return t, t.train(batch, temperature=1.0, recompute=True, length_norm=16.0)


@pytest.mark.parametrize("algo", ["grpo", "gspo", "reinforce-pp", "ppo"])
def test_an_update_on_another_device_is_the_cpu_update(algo, policy, sft_dir):
    model, tok = policy
    batch = _rl_batch(tok)
    cfg = RLConfig(algo=algo, beta=0.05 if algo != "gspo" else 0.0, minibatch_size=2, epochs=2, lr=1e-3, seed=1)
    want_t, want = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir)
    with SimulatedGPU() as dev:
        t, got = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir, device=dev)
        assert next(t.model.parameters()).device == dev
        if algo == "ppo":
            assert next(t.algo.critic.model.parameters()).device == dev
    for k in ("loss", "grad_norm", "kl_per_token", "ratio_mean", "entropy", "clip_fraction"):
        assert got[k] == pytest.approx(want[k], rel=2e-3, abs=1e-6), k
    _same_update(t.model, want_t.model, model)


def test_the_trainer_reads_the_device_once_per_optimizer_step(policy, sft_dir):
    """rlkit's own host syncs in an update are a fixed few (prepare's metrics) plus exactly one per
    optimizer step (the step's loss terms, counts and gradient norm, read together)."""
    model, tok = policy
    batch = _rl_batch(tok)
    syncs = {}
    for epochs in (1, 3):  # 2 and 6 optimizer steps
        cfg = RLConfig(algo="grpo", beta=0.05, minibatch_size=2, epochs=epochs, lr=1e-3)
        mode = SimulatedGPU()
        with mode as dev:
            _, m = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir, device=dev)
        syncs[m["optimizer_steps"]] = mode.syncs["rlkit"]
    assert sorted(syncs) == [2, 6] and (syncs[6] - syncs[2]) / 4 == 1, syncs


def test_dpo_on_another_device_is_the_cpu_update(policy, sft_dir):
    from rlkit.algorithms.inputs import PrefBatch
    from rlkit.ops.logprobs import pack_sequences

    model, tok = policy
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("1+2=", "3+4=", "5+6=")]
    chosen = [tok.encode(s, add_special_tokens=False) for s in ("3", "7", "11")]
    rejected = [tok.encode(s, add_special_tokens=False) for s in ("4", "77", "1")]
    ids, attn, targets, mask, start = pack_sequences(prompts * 2, chosen + rejected, tok.pad_token_id)
    batch = PrefBatch(ids, attn, targets, mask, start, -torch.arange(6, dtype=torch.float32) - 1.0,
                      torch.tensor([False, False, True]))
    cfg = RLConfig(algo="dpo", minibatch_size=1, epochs=1, lr=1e-3)
    want_t, want = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir)
    with SimulatedGPU() as dev:
        t, got = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir, device=dev)
    for k in ("loss", "grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=2e-3, abs=1e-6), k
    for k in ("train_reward_margin", "heldout_reward_accuracy", "heldout_logp_chosen"):  # after the update
        assert got[k] == pytest.approx(want[k], rel=1e-2, abs=1e-6), k
    _same_update(t.model, want_t.model, model)


def test_the_check_catches_a_forgotten_move(policy):
    """The harness is not vacuous: the log-prob path fed the CPU tensors it was given fails."""
    from rlkit.ops.logprobs import completion_logprobs, pack_sequences, padded

    model, tok = policy
    ids, attn, targets, _, start = pack_sequences([[5, 6, 7]], [[8, 9]], tok.pad_token_id)
    with SimulatedGPU() as dev:
        m = copy.deepcopy(model).to(dev)
        with pytest.raises(DeviceMismatch):
            completion_logprobs(m, padded(ids, attn, start))
        lp, _ = completion_logprobs(m, padded(ids, attn, start).to(dev))
        assert lp.device == dev


def test_scoring_on_another_device_is_the_cpu_scoring(policy, sft_dir):
    """score-ref's forward (the reference's log-probs) and a reward model's scores, fed Python lists."""
    from transformers import AutoModelForSequenceClassification

    from rlkit.scorers.logprobs import score_tokens
    from rlkit.scorers.reward_model import score_texts

    model, tok = policy
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+7=", "3+4=", "100+1=")]
    comps = [tok.encode(s, add_special_tokens=False) for s in ("19", "7", "101")]
    want = score_tokens(model, prompts, comps, tok.pad_token_id, 0.7, 64)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(sft_dir), num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    rm.eval()
    texts = (["12+7=", "3+4="], ["19", "seven"])
    want_rm = score_texts(rm, tok, *texts)
    with SimulatedGPU() as dev:
        got = score_tokens(copy.deepcopy(model).to(dev), prompts, comps, tok.pad_token_id, 0.7, 64)
        got_rm = score_texts(copy.deepcopy(rm).to(dev), tok, *texts)
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert got_rm == pytest.approx(want_rm, abs=1e-5) and all(math.isfinite(x) for x in got_rm)


@pytest.mark.slow
def test_out_of_memory_is_one_line_naming_the_flags_and_writes_nothing(tmp_path):
    """A real allocation failure: sft with one huge batch under a 3 GB address-space limit (`ulimit -v`),
    the CPU allocator's error as a GPU's would be: exit 71, the error line last, no traceback, no --out."""
    import shlex
    import subprocess

    from conftest import rlkit_cmd

    out = tmp_path / "sft"
    cmd = " ".join(shlex.quote(c) for c in [*rlkit_cmd(), "sft", "--out", str(out), "--num-examples", "20000",
                                            "--batch-tokens", "1000000", "--eval-num", "4"])
    r = subprocess.run(["bash", "-c", f"ulimit -v 3000000; {cmd}"], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 71 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[-1] == ("rlkit: error: sft: out of host memory with --batch-tokens 1000000, --dtype auto, --device "
                         "auto; lower it with --micro-batch-size, --micro-batch-tokens, --batch-tokens, --gradient-checkpointing, "
                         "--lora-rank; nothing was written")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the GPU-only branches, on the simulated GPU


def test_the_simulated_gpu_takes_the_cuda_branches_of_device_resolution():
    with SimulatedGPU() as dev:
        assert devices.resolve("auto") == dev == torch.device("cuda", 0) and devices.auto_dtype(dev) == "bf16"
        assert devices.describe(dev, "bf16") == "cuda:0 (NVIDIA H100 80GB HBM3, bf16)"
        entry = devices.manifest_entry(dev)
        assert (entry["device"], entry["gpu"], entry["gpu_count"]) == ("cuda:0", "NVIDIA H100 80GB HBM3", 1)
    with SimulatedGPU(name="Tesla T4", memory_gib=16, capability=(7, 5)) as dev:  # no bf16 kernels: fp32
        assert devices.auto_dtype(dev) == "fp32" and torch.cuda.get_device_properties(0).total_memory == 16 * 2**30
    assert not torch.cuda.is_available() or torch.version.cuda  # restored on exit (a CPU build answers False)


def test_a_move_past_the_simulated_memory_is_cudas_out_of_memory_error(policy):
    sim = SimulatedGPU(memory_gib=0.001)  # 1 MiB: the tiny policy's 3 MB of weights do not fit
    with sim as dev, pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory") as e:
        copy.deepcopy(policy[0]).to(dev)
    assert devices.is_out_of_memory(e.value)
    assert str(devices.out_of_memory("update", {"micro_batch_size": 4}, e.value)).startswith(
        "update: out of GPU memory with --micro-batch-size 4; lower it with --micro-batch-size")
    gpu = SimulatedGPU()
    with gpu as dev:
        devices.release_cached(dev)
        devices.release_cached(torch.device("cpu"))
    assert gpu.empty_cache_calls == 1  # the GPU's cache only


def test_an_update_on_the_simulated_gpu_trains_in_bf16_from_pinned_batches(policy, sft_dir):
    """`--dtype auto` on the GPU: bf16 autocast really runs (the figures are the CPU's bf16 autocast ones, not
    fp32's); the batch goes to the device from pinned memory without blocking; the peak-memory figure is the
    simulated allocator's."""
    model, tok = policy
    batch = _rl_batch(tok)
    cfg = RLConfig(algo="grpo", beta=0.05, minibatch_size=2, epochs=2, lr=1e-3, seed=1)
    _, fp32 = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir)
    _, bf16 = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir, dtype="bf16")
    sim = SimulatedGPU()
    with sim as dev:
        t, got = _train(copy.deepcopy(model), tok, cfg, batch, sft_dir, device=dev, dtype="auto")
    assert t.train_options.dtype == "bf16" and t.prec.device_type == "cuda"
    for k in ("loss", "grad_norm"):
        # bf16 moves them ~1e-3 from fp32. The GPU's autocast casts other ops than the CPU's (its own op lists), so
        # the simulated GPU's figures are not the CPU's bf16 ones either (nearer one or the other by CPU): they are
        # off fp32's by bf16's rounding (autocast ran), and within bf16's own distance of them (nothing else moved)
        moved, bf16_moved = abs(got[k] - fp32[k]), abs(bf16[k] - fp32[k])
        assert 1e-4 * abs(fp32[k]) < moved < 10 * bf16_moved, (k, got[k], bf16[k], fp32[k])
    batch_moves = len(batch) - sum(x is None for x in batch)
    assert sim.copies.count((True, True)) >= batch_moves, sim.copies  # pinned, non_blocking: each batch tensor
    assert got["gpu_mem_peak_gib"] == round(sim.peak / 2**30, 3) > 0
