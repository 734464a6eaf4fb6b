"""vLLM's share of one GPU beside the models other stages run there (`rlkit.engines.memory`), on made-up sizes:
0.5B and 7B bf16 policies with a bf16 reference of the same size on 24 and 80 GiB GPUs, the cap, the policy that
does not fit, and the sizes read from safetensors headers (the numbers docs/gpu.md tabulates)."""

from __future__ import annotations

import json

import pytest

from rlkit.engines import memory
from rlkit.engines.memory import GiB, default_share, vllm_memory_share
from rlkit.errors import RlkitError

B05, B7 = 10**9, 14 * 10**9  # bf16 weights of 0.5B and 7B parameters (2 bytes each)


def test_half_b_policy_beside_its_reference():
    # others = 1e9 x 1.25 + 2 GiB = 3,397,483,648; (24 GiB - others) / 24 GiB = 0.868 -> 0.86 (rounded down)
    assert vllm_memory_share(24 * GiB, B05, [B05]) == 0.86
    # 80 GiB: (80 GiB - others) / 80 GiB = 0.960, above vLLM's own default: capped at 0.9
    assert vllm_memory_share(80 * GiB, B05, [B05]) == memory.CAP == 0.9
    # a second model (an fp32 reward model of 0.5B: 2e9 bytes) takes 2.5e9 more: 0.868 - 0.097 = 0.771 -> 0.77
    assert vllm_memory_share(24 * GiB, B05, [B05, 2 * B05]) == 0.77


def test_7b_policy_beside_its_reference():
    # others = 14e9 x 1.25 + 2 GiB = 19,647,483,648; (80 GiB - others) / 80 GiB = 0.771 -> 0.77: 61.6 GiB for vLLM,
    # of which the policy needs 14e9 x 1.25 + 1 GiB = 17.3 GiB
    share = vllm_memory_share(80 * GiB, B7, [B7])
    assert share == 0.77 and share * 80 * GiB > memory.policy_need(B7)
    # 24 GiB: (24 GiB - 18.3 GiB) / 24 GiB = 0.237 -> 0.23, 5.5 GiB: the policy alone needs 17.3 GiB
    with pytest.raises(RlkitError, match=r"does not fit on this GPU beside --colocate's models: vLLM needs about "
                                         r"17\.3 GiB .* leaves 5\.5 GiB; run score-ref on another GPU"):
        vllm_memory_share(24 * GiB, B7, [B7])


def test_the_cap_the_reserve_and_no_room_at_all():
    assert vllm_memory_share(80 * GiB, B05, []) == 0.9  # nothing beside it: vLLM's own 0.9
    assert vllm_memory_share(10 * GiB, B05, [], reserve_bytes=0) == 0.9
    # the reserve is CUDA contexts: 2 GiB of 10 GiB is 0.2
    assert vllm_memory_share(10 * GiB, B05, []) == 0.8
    with pytest.raises(RlkitError, match=r"leaves 0\.0 GiB"):  # the others alone exceed the GPU
        vllm_memory_share(24 * GiB, B05, [30 * GiB])
    with pytest.raises(ValueError):
        vllm_memory_share(0, B05, [])


def test_the_default_without_colocate():
    assert memory.DEFAULT_SHARE == 0.5
    assert default_share(24 * GiB, B05) == default_share(80 * GiB, B7) == 0.5
    with pytest.raises(RlkitError, match=r"default share of this GPU without --colocate \(0\.5 of 24\.0 GiB\): it "
                                         r"needs about 17\.3 GiB.* pass --gpu-memory-utilization 0\.9 when rollout "
                                         r"has the GPU to itself, or --colocate DIR"):
        default_share(24 * GiB, B7)


def _model(d, tensors: dict[str, tuple[str, list[int]]]):
    """A model directory whose one safetensors file has these (dtype, shape) tensors (zeros)."""
    import torch
    from safetensors.torch import save_file

    dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    d.mkdir(parents=True)
    save_file({k: torch.zeros(shape, dtype=dt[t]) for k, (t, shape) in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return d


def test_sizes_come_from_the_safetensors_headers(tmp_path):
    ref = _model(tmp_path / "ref", {"a": ("BF16", [10, 30]), "b": ("BF16", [100])})  # 400 params, bf16
    (ref / "rlkit.json").write_text(json.dumps({"kind": "reference"}))
    rm = _model(tmp_path / "rm", {"a": ("F32", [10, 30]), "score": ("F32", [1, 30])})  # 330 params, fp32
    rm16 = _model(tmp_path / "rm16", {"a": ("BF16", [10, 30]), "score": ("BF16", [1, 30])})  # 330 params, bf16
    # as score-ref's --dtype auto loads them on a GPU with bf16: every model in bf16, whatever it was saved in
    assert memory.model_bytes(ref) == 800 and memory.model_bytes(rm) == memory.model_bytes(rm16) == 660
    # auto on an older GPU (stored): a frozen reference as stored, any other model in fp32, as reward models are
    # loaded then whatever they were saved in; fp32: 4 bytes a parameter
    assert memory.model_bytes(ref, dtype="stored") == 800
    assert memory.model_bytes(rm, dtype="stored") == memory.model_bytes(rm16, dtype="stored") == 1320
    assert memory.model_bytes(ref, dtype="fp32") == 1600
    # the policy at the dtype vLLM runs it in (an unknown name such as 'auto': as stored)
    assert memory.weights_bytes(ref, "float32") == 1600 and memory.weights_bytes(rm, "bfloat16") == 660
    assert memory.weights_bytes(ref, "auto") == 800
    # a LoRA checkpoint holds only its adapter: its base is counted in
    adapter = _model(tmp_path / "adapter", {"lora_A": ("F32", [2, 30]), "lora_B": ("F32", [30, 2])})  # 120 params
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(rm)}))
    assert memory.model_bytes(adapter) == 660 + 240 and memory.model_bytes(adapter, dtype="stored") == 1320 + 480
    assert memory.weights_bytes(adapter, "bfloat16") == 2 * (330 + 120)
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(RlkitError, match=r"--colocate .*: no \*\.safetensors there \(a model directory, e\.g\. "
                                             r"score-ref's --ref or --rm\)"):
            memory.model_bytes(bad)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(RlkitError, match="its LoRA base model .*gone is missing"):
        memory.model_bytes(adapter)


def test_the_docs_table_is_the_functions():
    """docs/gpu.md's table of shares is what `vllm_memory_share` / `default_share` give (rerun its snippet if not)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()
    for name, pol in (("0.5B", B05), ("7B", B7)):
        for gpu in (24, 80):
            for what, col in (("bf16 reference", [pol]), ("bf16 reference + fp32 reward model", [pol, 2 * pol])):
                try:
                    cell = str(vllm_memory_share(gpu * GiB, pol, col))
                except RlkitError:
                    cell = "does not fit"
                assert f"| {name} | {gpu} GiB | {what} | {cell} |" in text, (name, gpu, what, cell)


def test_one_vllm_memory_model_without_torch(tmp_path):
    """vLLM's accounting lives here, torch-free: the planner's `rollout` plan and rollout's pre-flight use it (the vLLM
    engine imports this module, not the planner). Qwen2.5-7B in bf16: 28 layers x 4 KV heads x 128 x 2 (K, V) x 2
    bytes = 57,344 bytes a token; half of 24 GiB does not hold its 15.2e9 bytes of weights and a 32k sequence."""
    import subprocess
    import sys

    from rlkit import planner
    from rlkit.devices import OutOfMemory

    cfg = planner.model_config("qwen2.5-7b")
    assert memory.kv_bytes_per_token(cfg, "bf16") == 57344
    acc = memory.vllm_accounting(cfg, 80 * GiB, 0.9, 32768, profile=False)
    assert acc["kv_cache_tokens"] == (int(0.9 * 80 * GiB) - acc["weights"]) // 57344 and acc["starts"]
    est = planner.plan_vllm(cfg, planner.Work(512, 1024, 1), planner.Hardware(1, 80))
    assert sum(est.parts.values()) == est.peak == int(0.9 * 80 * GiB)  # the share: weights, activations, KV cache
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OutOfMemory, match=r"not the KV cache of one 32,768-token sequence"):
        memory.preflight_vllm(tmp_path, "bf16", 0.5, 24 * GiB)
    code = ("import sys, rlkit.engines.memory; assert 'torch' not in sys.modules; "
            "src = open('rlkit/engines/vllm.py').read(); assert 'planner' not in src, 'vllm.py imports the planner'")
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
