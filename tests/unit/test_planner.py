"""The memory planner (`rlkit plan`, rlkit.planner): its traced peak against the real step's peak RSS on this CPU,
the layer extrapolation against a full trace, a 7B full fine-tune refused on one 80 GB GPU and LoRA with gradient
checkpointing and micro-batches fitting, the pre-flight refusal (exit 71) from a config alone, and bad input."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
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
    est = planner.estimate("sft", extrapolated, planner.Hardware(), {})
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


def test_the_parts_sum_to_the_peak_and_fsdp_shards_the_state_over_its_ranks():
    """Each part is what the rank holds at the peak, so they add up to it exactly; under FSDP2 over 4 fake ranks the
    sharded fp32 state (the optimizer step's weights, gradients and AdamW moments) is a quarter of one GPU's; and the
    parts extrapolated from a few layers equal those of a trace of every layer (a peak that falls at another moment
    with few layers, as the logits' does against the embedding's gathered gradient, would not)."""
    from rlkit.training import TrainOptions

    config, work = dict(SMALL, num_hidden_layers=6), planner.Work(32, 96, rows=8)
    train = TrainOptions(dtype="bf16", micro_batch_size=2)
    one, four = planner.plan_trainings("update", config, work, [(train, planner.Hardware(1)), (train, planner.Hardware(4))])
    for est in (one, four):
        assert sum(est.parts.values()) == est.peak, est.parts
        assert all(v >= 0 for v in est.parts.values()), est.parts
    spec = planner.train_spec("update", config, work, planner.Hardware(4), train, algo="grpo", beta=0.0)
    extrapolated, full, solo = planner.run_traces([spec, {**spec, "exact": True}, {**spec, "world": 1}])
    # fp32 weights and gradients at the optimizer step, and AdamW's two moments held after it (8 bytes a parameter)
    sharded = {**{k: extrapolated["step"][k] for k in ("weights", "gradients")}, "moments": extrapolated["optimizer"]}
    whole = {**{k: solo["step"][k] for k in ("weights", "gradients")}, "moments": solo["optimizer"]}
    params = planner.parameters(config)
    assert whole["gradients"] == pytest.approx(4 * params, rel=0.01)
    assert whole["moments"] == pytest.approx(8 * params, rel=0.01)
    for k in sharded:  # each rank holds its shard of each parameter: a quarter (padded to 4 rows)
        assert sharded[k] == pytest.approx(whole[k] / 4, rel=0.01), (k, sharded[k], whole[k])
    for snap in ("passes", "step"):
        for k in ("weights", "gradients", "optimizer", "activations"):
            assert extrapolated[snap][k] == pytest.approx(full[snap][k], rel=0.01, abs=2**16), (snap, k)


def test_plan_refuses_what_it_cannot_plan_in_one_line(tmp_path, sft_dir):
    """Lengths past the model's context (the tiny model's 256 tokens), a world past MAX_GPUS or past the step's rows,
    the hf engine, and an input the stage itself refuses (a rollouts table as train-rm's --prefs): exit 2, one
    line, nothing written, the input byte-identical; no real allocation at a 2**31-token shape."""
    from tests.conftest import one_error_line, run_cli, run_cli_inproc, stage

    roll = tmp_path / "roll.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--out", str(roll))
    before = roll.read_bytes()
    listing = sorted(tmp_path.iterdir())
    pol = str(sft_dir)
    cases = (
        (["update", "--policy", pol, "--completion-tokens", "2147483647", "--json"], "context of 256 tokens"),
        (["update", "--policy", pol, "--prompt-tokens", "200", "--completion-tokens", "100"], "expected at most 256"),
        (["sft", "--model", pol, "--max-length", "1024"], "context of 256 tokens"),
        (["update", "--policy", pol, "--gpus", "100000", "--json"], "expected at most 1024"),
        (["update", "--policy", pol, "--gpus", "200"], "more GPUs than the 128 rows"),
        (["rollout", "--policy", pol, "--engine", "hf"], "expected --engine vllm"),
        (["train-rm", "--model", pol, "--prefs", str(roll)], "prefs"),
    )
    for args, words in cases:
        r = run_cli_inproc("plan", *args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlkit: error:") and words in lines[0], (args, lines)
        assert not r.stdout
    line = one_error_line(run_cli("plan", "update", "--policy", pol, "--completion-tokens", "2147483647"))
    assert "max_position_embeddings" in line
    assert roll.read_bytes() == before and sorted(tmp_path.iterdir()) == listing


def test_plan_says_what_it_planned_for_and_where_each_figure_came_from(sft_dir):
    import json

    from tests.conftest import run_cli_inproc

    r = run_cli_inproc("plan", "update", "--policy", str(sft_dir), "--micro-batch-size", "16", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plans"][0]
    shape = plan["settings"]["shape"]
    # neither --in nor lengths: half the tiny model's 256-token context each (the default 256 is longer)
    assert (shape["prompt_tokens"], shape["completion_tokens"], shape["rows"]) == (128, 128, 128)
    assert "context" in shape["from"]["prompt_tokens"] and shape["from"]["rows"] == "--minibatch-size's default"
    assert (shape["micro_batch_rows"], shape["micro_batches_per_gpu"]) == (16, 8)
    assert shape["micro_batch_from"] == "--micro-batch-size"
    assert sum(plan["parts"].values()) == plan["peak"]
    r = run_cli_inproc("plan", "update", "--policy", str(sft_dir), "--prompt-tokens", "100", "--completion-tokens", "50")
    out = r.stdout.decode()
    assert r.returncode == 0 and "planned for: 128 rows a step (--minibatch-size's default); 100 prompt tokens " \
        "(--prompt-tokens); 50 completion tokens (--completion-tokens)" in out, out


def test_suggest_says_nothing_fits_after_one_trace():
    """The least memory the search reaches is traced first: when even that does not fit, one line says so."""
    from rlkit.training import TrainOptions

    config, work, hw = dict(SMALL, num_hidden_layers=4), planner.Work(32, 32, rows=4), planner.Hardware(1, 1.0)
    sug = planner.suggest_training("update", config, work, hw, TrainOptions(dtype="bf16"))
    # 1 GiB less the 1 GiB reserved for the CUDA context: nothing fits
    assert sug["nothing"] and sug["gpus"] == 4 and sug["flags"]["--lora-rank"] == 64
    # one row a step: three candidates to trace (micro-batch 1, with checkpointing, with LoRA), not nine
    roomy = planner.suggest_training("update", config, replace(work, rows=1), planner.Hardware(1, 2.0),
                                     TrainOptions(dtype="bf16"))
    assert not roomy["nothing"] and roomy["peak_gib"] < 2.0 - 1.0
