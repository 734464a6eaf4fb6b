"""What a GPU runs in, decided on the CPU: vLLM's sampling dtype, score-ref's dtype, LoRA's frozen base, TF32, vLLM's
start-up out-of-memory, score-ref loading its models only once input comes, and follow mode dropping its gradients
between steps. The resolution functions take the device type, so the GPU's answers are checked here; the real GPU
runs are tests/gpu/test_precision_gpu.py."""

from __future__ import annotations

import json
import os
import threading
import time

import pyarrow as pa
import pytest
import torch

from rlkit import devices
from rlkit.engines import vllm as vllm_engine
from rlkit.engines.base import EngineOptions
from rlkit.engines.memory import GiB


def test_vllm_samples_in_bf16_on_a_gpu_and_as_stored_on_the_cpu():
    sd = vllm_engine.sampling_dtype
    # --dtype auto: bf16 on a GPU with bf16 kernels, whatever the checkpoint (rlkit writes fp32 ones)
    assert sd("float32", "auto", "cuda") == sd("bfloat16", "auto", "cuda") == "bfloat16"
    # an older GPU, and vLLM's CPU backend: the checkpoint's own dtype, as before
    assert sd("float32", "auto", "cuda", bf16=False) == "float32"
    assert sd("float32", "auto", "cpu") == "float32" and sd("bfloat16", "auto", "cpu") == "bfloat16"
    # an explicit --dtype is obeyed everywhere
    for dev in ("cpu", "cuda"):
        assert sd("bfloat16", "fp32", dev) == "float32" and sd("float32", "bf16", dev) == "bfloat16"
        assert sd("float32", "fp16", dev) == "float16"


def test_score_ref_runs_in_bf16_on_a_gpu_and_in_fp32_on_the_cpu():
    from rlkit.scorers import score_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert score_dtype(cuda, "auto", bf16=True) == "bf16"
    assert score_dtype(cuda, "auto", bf16=False) == "stored"  # a GPU without bf16: the reference as frozen
    assert score_dtype(cpu, "auto") == "fp32"
    for dev in (cuda, cpu):
        assert score_dtype(dev, "fp32", bf16=True) == "fp32" and score_dtype(dev, "stored", bf16=True) == "stored"


def test_resolving_a_cuda_device_turns_tf32_on(monkeypatch):
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine answering as one with a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert devices.resolve("cpu").type == "cpu" and not devices.tf32_enabled()  # the CPU leaves it alone
        for spec in ("auto", "cuda", "cuda:0"):
            torch.backends.cuda.matmul.allow_tf32 = False
            assert devices.resolve(spec) == torch.device("cuda", 0)
            assert devices.tf32_enabled() and torch.backends.cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# vLLM 0.32's own texts: vllm/v1/engine/utils.py (this process), vllm/v1/core/kv_cache_utils.py and
# vllm/v1/worker/utils.py (an engine run in this process)
CORE_FAILED = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): "
                           "{'EngineCore_DP0': 1}")
NO_CACHE = ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                      "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
                      "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for "
                      "more details.")
NOT_FREE = ValueError("Free memory on device cuda:0 (10.5/79.19 GiB) on startup is less than desired GPU memory "
                      "utilization (0.5, 39.6 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
                      "other processes.")
KV_SHORT = ValueError("To serve at least one request with the model's max seq len (32768), (1.75 GiB KV cache is "
                      "needed, which is larger than the available KV cache memory (0.5 GiB). Try increasing "
                      "`gpu_memory_utilization` ...")


def test_a_vllm_start_that_fails_for_memory_is_one_out_of_memory_line():
    oom = vllm_engine.start_out_of_memory
    total, pol = 80 * GiB, 15 * GiB  # a 7B bf16 policy on an 80 GiB GPU
    # the engine-core process died: another process holds the GPU (free < the share asked for)
    e = oom(CORE_FAILED, 0.5, total=total, free=10 * GiB, policy_bytes=pol)
    assert isinstance(e, devices.OutOfMemory) and e.exit_code == 71
    assert str(e) == ("rollout: vLLM ran out of memory starting up (--gpu-memory-utilization 0.5 of the GPU's "
                      "80.0 GiB is 40.0 GiB; 10.0 GiB of it is free (other processes hold the rest)); size its share "
                      "with --gpu-memory-utilization (lower when other processes hold the GPU, higher when the policy "
                      "does not fit), or name each model score-ref runs beside it with --colocate DIR so rollout "
                      "sizes it (docs/gpu.md); nothing was written")
    # ... or its share cannot hold the policy with the least KV cache (15 x 1.25 + 1 = 19.75 GiB > 16 GiB)
    e = oom(CORE_FAILED, 0.2, total=total, free=79 * GiB, policy_bytes=pol)
    assert "the policy's 15.0 GiB of weights need about 19.8 GiB" in str(e) and "--colocate" in str(e)
    # a start-up failure with room to spare is not memory: it stays what vLLM raised
    assert oom(CORE_FAILED, 0.5, total=total, free=79 * GiB, policy_bytes=pol) is None
    assert oom(CORE_FAILED, 0.3) is None  # no figures (vLLM's CPU backend): nothing to call it memory
    assert oom(RuntimeError("Model architectures ['Foo'] are not supported for now."), 0.5, total=total,
               free=79 * GiB, policy_bytes=pol) is None
    # vLLM's own memory texts, and torch's allocator, whatever the figures
    for err in (NO_CACHE, NOT_FREE, KV_SHORT, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")):
        e = oom(err, 0.3)
        assert isinstance(e, devices.OutOfMemory) and "--gpu-memory-utilization" in str(e) and "--colocate" in str(e)


def test_the_vllm_engine_turns_a_start_failure_into_the_line(sft_dir, monkeypatch):
    """The engine's start on vLLM's CPU backend, failing with vLLM's own cache-blocks error: one line, exit 71."""
    if vllm_engine.vllm_import_error():
        pytest.skip("vLLM does not import here")
    import vllm

    def no_room(*a, **k):
        raise NO_CACHE

    monkeypatch.setattr(vllm, "LLM", no_room)  # vLLM's start, failing as it does when the share holds no KV cache
    with pytest.raises(devices.OutOfMemory, match="vLLM ran out of memory starting up"):
        vllm_engine.VLLMEngine.start(sft_dir, EngineOptions())
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: (_ for _ in ()).throw(CORE_FAILED))
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):  # no figures on the CPU: as raised
        vllm_engine.VLLMEngine.start(sft_dir, EngineOptions())


def test_lora_holds_its_frozen_base_in_bf16_on_a_gpu(sft_dir):
    from rlkit import training
    from rlkit.io import checkpoints
    from rlkit.training import LoraOptions, TrainOptions, lora

    model, _ = checkpoints.load_policy(sft_dir)
    model = training.prepare_model(model, TrainOptions(lora=LoraOptions(rank=4)), "causal-lm", base=sft_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the CPU, fp32 and fp16 leave it as it is (the CPU computes what it did)
    for dtype, dev in (("bf16", torch.device("cpu")), ("fp32", torch.device("cuda")), ("fp16", torch.device("cuda"))):
        assert lora.hold_base(model, dtype, dev) == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # bf16 on a GPU: the frozen linear layers in bf16; the adapter, the embeddings and the norms fp32
    assert lora.hold_base(model, "bf16", torch.device("cuda", 0)) > 0
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for n, p in model.named_parameters():
        owner = n.rsplit(".", 1)[0]
        if p.requires_grad:
            assert p.dtype == torch.float32 and "lora_" in n, n
        elif owner in linear and "embed" not in n:
            assert p.dtype == torch.bfloat16, n
            assert torch.equal(p.float(), before[n].to(torch.bfloat16).float())
        else:
            assert p.dtype == torch.float32, n
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert model.get_output_embeddings().weight.dtype == (torch.float32 if tied else torch.bfloat16)
    # AdamW holds the adapter only, in fp32
    opt = training.make_adamw(model, 1e-3, 0.0)
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])


def test_a_follow_step_leaves_no_gradients_behind(sft_dir, tmp_path):
    """After each `update --follow` step the trained models hold no gradients (their memory is vLLM's to wake into
    at --max-lag 0)."""
    from rlkit.algorithms.config import RLConfig
    from rlkit.algorithms.inputs import build_batch
    from rlkit.algorithms.trainer import Trainer, free_grads
    from rlkit.io import checkpoints, streams
    from rlkit.stages.rollout import RolloutConfig
    from rlkit.stages.rollout import run as rollout

    table = rollout(RolloutConfig(policy=sft_dir, engine="hf", num_prompts=2, n=4, out=tmp_path / "r.arrow"))
    t_, _ = streams.read_table(table, ["rollouts"])
    model, tok = checkpoints.load_policy(sft_dir)
    batch, _ = build_batch(t_, tok.pad_token_id)
    tr = Trainer(model, RLConfig(minibatch_size=4, epochs=1, beta=0.0), tokenizer=tok)
    tr.train(batch, temperature=1.0, length_norm=16.0)
    assert any(p.grad is not None for p in tr.model.parameters())  # what the step leaves without free_grads
    free_grads(tr)
    assert all(p.grad is None for t in tr.trained for p in t.model.parameters())


def test_score_ref_loads_its_models_only_once_the_first_batch_comes(sft_dir, ref_dir, tmp_path, monkeypatch):
    """In a pipe, score-ref's reference must not load while rollout's vLLM starts: the input's header comes, then
    nothing for a while; the reference loads after the first batch, not before."""
    from rlkit.io import checkpoints, streams
    from rlkit.stages.rollout import RolloutConfig
    from rlkit.stages.rollout import run as rollout
    from rlkit.stages.score_ref import ScoreRefConfig
    from rlkit.stages.score_ref import run as score_ref

    table, _ = streams.read_table(rollout(RolloutConfig(policy=sft_dir, engine="hf", num_prompts=2, n=2,
                                                        out=tmp_path / "r.arrow")), ["rollouts"])
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    sent: list[float] = []
    loaded: list[float] = []
    real = checkpoints.load_reference
    monkeypatch.setattr(checkpoints, "load_reference", lambda *a, **k: loaded.append(time.monotonic()) or real(*a, **k))

    def upstream():  # rollout's side of the pipe: the stream's header at once, its first rows a second later
        with open(fifo, "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            f.flush()
            time.sleep(1.0)
            sent.append(time.monotonic())
            for b in table.to_batches():
                w.write_batch(b)
            w.write_batch(pa.record_batch(
                [pa.array([], type=f.type) for f in table.schema], schema=table.schema),
                custom_metadata={streams.END_KEY: str(table.num_rows)})  # rlkit's end marker (streams.TableWriter)

    th = threading.Thread(target=upstream)
    th.start()
    out = score_ref(ScoreRefConfig(ref=ref_dir, inp=str(fifo), out=tmp_path / "s.arrow", device="cpu"))
    th.join()
    assert len(loaded) == 1 and loaded[0] > sent[0]
    scored, reader = streams.read_table(out, ["scored"])
    assert scored.num_rows == table.num_rows and scored.column("ref_logprobs").null_count == 0
    assert json.loads(json.dumps(reader.record.raw["config"]))["dtype"] == "fp32"  # what auto became on the CPU
