"""The memory planner (`rlkit plan`, rlkit.planner): its traced peak against the real step's peak RSS on this CPU,
the layer extrapolation against a full trace, a 7B full fine-tune refused on one 80 GB GPU and LoRA with gradient
checkpointing and micro-batches fitting, the pre-flight refusal (exit 71) from a config alone, and bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlkit import planner
from rlkit.errors import RlkitError

# ~58M parameters: the model's weights, gradients and AdamW moments (~0.9 GB) dominate the process's own memory
SMALL = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 1024, "tie_word_embeddings": False}
FP32_ONE_PASS = {"dtype": "fp32", "micro_batch_size": None, "micro_batch_tokens": None, "packing": True}

REPO = Path(__file__).resolve().parents[2]


def _bench():
    """benchmarks/planner_accuracy.py: the same step run for real, its peak RSS (see its docstring)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_accuracy", REPO / "benchmarks" / "planner_accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_planned_peak_agrees_with_the_real_steps_peak_rss_and_extrapolation_with_a_full_trace():
    spec = {"stage": "sft", "config": SMALL, "rows": 4, "prompt": 64, "completion": 192, "train": FP32_ONE_PASS}
    extrapolated, full = planner.run_traces([spec, {**spec, "exact": True}])
    # 8 layers from traces of 1 and 2 == a trace of all 8 (every figure is linear in the layer count)
    for key in ("passes_total", "step_total", "optimizer"):
        assert extrapolated[key] == pytest.approx(full[key], rel=0.01), key
    est = planner._estimate("sft", extrapolated, planner.Hardware(), {})
    real = _bench().measure_real(spec)  # the real engine step, fp32 on this CPU, twice
    assert real > 2**30, real  # the model's memory dominates: a comparison that means something
    assert est.peak == pytest.approx(real, rel=0.20), (est.peak / 2**20, real / 2**20)
    # ... and it can fail: the plan without AdamW's moments (16 -> 8 bytes a parameter) is far off
    assert not (est.peak - est.parts["optimizer"]) == pytest.approx(real, rel=0.20)


def test_7b_full_fine_tune_does_not_fit_one_80gb_gpu_and_lora_with_checkpointing_and_micro_batches_does():
    from rlkit.training import TrainOptions
    from rlkit.training.lora import LoraOptions

    config, work, hw = planner.model_config("qwen2.5-7b"), planner.Work(512, 1024, rows=128), planner.Hardware(1, 80)
    full, lora = planner.plan_trainings("update", config, work, [
        (TrainOptions(), hw),
        (TrainOptions(lora=LoraOptions(rank=64), gradient_checkpointing=True, micro_batch_size=1), hw)])
    assert not full.fits
    # fp32 weights, gradients, two AdamW moments: 16 bytes for each of 7.6B parameters, before any activation
    assert full.parts["weights"] + full.parts["gradients"] + full.parts["optimizer"] > 7.6e9 * 16 * 0.95
    assert lora.fits and lora.peak < 40 * 2**30, lora.peak / 2**30
    # LoRA's frozen base is held in bf16 on a GPU: about 2 bytes a parameter of weights, not 4
    assert lora.parts["weights"] < 7.6e9 * 2.6


def test_preflight_refuses_from_the_config_alone_with_exit_71(tmp_path):
    """A directory holding nothing but Qwen2.5-7B's config.json: the check refuses a full fine-tune on a simulated
    80 GB GPU before any weight exists to read, naming the peak, the GPU's memory and --no-plan."""
    from rlkit.devices import OutOfMemory
    from rlkit.training import TrainOptions
    from tests.devsim import SimulatedGPU

    (tmp_path / "config.json").write_text((planner.MODELS_DIR / "qwen2.5-7b.json").read_text())
    work = planner.Work(512, 1024, rows=1)
    with SimulatedGPU(memory_gib=80) as dev:
        with pytest.raises(OutOfMemory) as e:
            planner.preflight("update", tmp_path, work, TrainOptions(dtype="bf16", micro_batch_size=1), dev)
        assert planner.preflight("update", tmp_path, work, TrainOptions(), "cpu") is None  # the CPU: no check
    msg = str(e.value)
    assert e.value.exit_code == 71
    assert "GiB per GPU" in msg and "80.0 GiB" in msg and "--no-plan" in msg and "nothing was written" in msg
    assert "--lora-rank 64" in msg  # what makes it fit, from the plan's own search
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_bad_input_is_one_line_exit_2(tmp_path):
    for args, words in ((["bogus"], "expected one of update"), (["update", "--policy", str(tmp_path)], "no config.json"),
                        (["update", "--policy", "qwen2.5-7b", "--micro-batch-size", "0"], "--micro-batch-size"),
                        (["update", "--policy", "qwen2.5-7b", "--nonsense"], "No such option")):
        r = subprocess.run([sys.executable, "-m", "rlkit", "plan", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)
        assert words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    with pytest.raises(RlkitError, match="not readable JSON"):
        (tmp_path / "config.json").write_text("{")
        planner.model_config(tmp_path)


def test_shipped_shapes_count_their_parameters():
    """The shipped configs are the published models' shapes (parameter counts as published)."""
    counts = {"qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9, "qwen2.5-14b": 14.77e9}
    for name, n in counts.items():
        assert planner.parameters(planner.model_config(name)) == pytest.approx(n, rel=0.01), name
    assert Path(planner.MODELS_DIR).is_dir()


def test_vllm_preflight_refuses_a_share_without_room_for_one_sequence(tmp_path):
    """rollout's check before vLLM starts: Qwen2.5-7B in bf16 (15.2 GiB) cannot start in half of a 24 GiB GPU; in 0.9
    of an 80 GB GPU it holds the weights and the KV cache of tens of 32k-token sequences."""
    from rlkit.devices import OutOfMemory

    (tmp_path / "config.json").write_text((planner.MODELS_DIR / "qwen2.5-7b.json").read_text())
    with pytest.raises(OutOfMemory, match=r"--gpu-memory-utilization 0.5 of 24.0 GiB\) holds the weights \(14.2 GiB"):
        planner.preflight_vllm(tmp_path, "bf16", 0.5, 24 * 2**30)
    ok = planner.preflight_vllm(tmp_path, "bf16", 0.9, 80 * 2**30)
    # 28 layers x 4 KV heads x 128 x 2 (K and V) x 2 bytes = 57,344 bytes a token
    assert ok.settings["kv_cache_tokens"] == (int(0.9 * 80 * 2**30) - ok.parts["weights"]) // 57344
    assert planner.preflight_vllm(tmp_path, "bf16", 0.5, 24 * 2**30, max_model_len=None, tp=2).parts["weights"] < 8 * 2**30


def test_score_ref_preflight_weighs_its_models_against_the_free_memory(tmp_path):
    from rlkit.devices import OutOfMemory
    from tests.devsim import SimulatedGPU

    (tmp_path / "config.json").write_text((planner.MODELS_DIR / "qwen2.5-1.5b.json").read_text())
    with SimulatedGPU(memory_gib=80) as dev:
        with pytest.raises(OutOfMemory, match="GiB free; lower it with --batch-tokens 4096"):
            planner.preflight_scoring(tmp_path, [], "auto", 16384, True, dev, free=3 * 2**30)
        est = planner.preflight_scoring(tmp_path, [], "auto", 16384, True, dev, free=20 * 2**30)
    # the reference in bf16 on a GPU (1.54B parameters, 2 bytes each) plus one 16k-token forward
    assert 2.8e9 < est.parts["weights"] < 3.3e9 and est.fits
