"""The engine registry (`rlkit.engines`): the names and capabilities the stages rely on, `--engine auto`'s
resolution, and a toy engine registered here for the length of one test, run through the real rollout stage
(no model: it samples fixed tokens), so the stage provably talks to the protocol only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit import engines
from rlkit.engines import Capabilities, Generated
from rlkit.errors import RlkitError


def test_builtin_engines_and_their_capabilities():
    assert engines.names() == ("auto", "hf", "vllm")  # --engine's choices, auto first
    # update trusts pi_old from hf (the trainer's own fp32 forward pass) and recomputes it for vllm
    # hf's `sample` advances the progress bar batch by batch and can keep no log-probs (greedy evaluation)
    assert engines.capabilities("hf") == Capabilities(logprobs_match_trainer=True, supports_lora=False,
                                                      supports_sleep=False, streams_tickers=True,
                                                      optional_logprobs=True)
    # vllm runs a LoRA checkpoint as base + adapter, sleeps between --max-lag 0 batches (on CUDA: its CPU backend
    # has no sleep mode, which the engine finds at start), and batches requests as they come (--env-schedule auto)
    assert engines.capabilities("vllm") == Capabilities(logprobs_match_trainer=False, supports_lora=True,
                                                        supports_sleep=True, continuous_batching=True)
    # a name from a manifest this rlkit does not know (a newer engine, or none recorded): every answer False
    for name in ("sglang-unknown", "", None, "auto"):
        assert engines.capabilities(name) == Capabilities(False, False, False) == engines.CONSERVATIVE
    assert engines.ENGINES["hf"].name == "hf" and engines.ENGINES["vllm"].name == "vllm"


def test_capabilities_import_neither_torch_nor_vllm():
    code = ("import sys\n"
            "from rlkit import engines\n"
            "assert not engines.capabilities('vllm').logprobs_match_trainer\n"
            "print([m for m in ('torch', 'vllm', 'transformers', 'pyarrow') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_unknown_engine_and_options_an_engine_cannot_honour_are_refused():
    with pytest.raises(RlkitError, match=r"--engine 'tpu' is not one of auto, hf, vllm"):
        engines.choose("tpu")
    with pytest.raises(RlkitError, match="vLLM options"):
        engines.check("hf", engines.EngineOptions(tp=2))
    engines.check("auto", engines.EngineOptions(tp=2))  # auto: the engine it resolves to decides at start
    engines.check("vllm", engines.EngineOptions(tp=2))
    with pytest.raises(ValueError, match="taken"):
        engines.register("hf")(type("Another", (), {}))


def _toy(name: str, rank: int, why_not: str | None):
    return type(name, (), {"capabilities": Capabilities(), "auto_rank": rank, "auto_reason": f"{name} is here",
                           "unavailable": classmethod(lambda cls: why_not)})


def test_auto_prefers_the_highest_ranked_available_engine(monkeypatch):
    import torch

    if not torch.cuda.is_available():  # this machine: vLLM is never auto's pick without a GPU
        assert engines.choose("auto") == ("hf", "auto: no GPU here; vLLM on a CPU is for tests, not speed")
    assert engines.choose("vllm") == ("vllm", "asked for")
    # the registry lives in rlkit.engines.base (the package re-exports it): replace it there for this test
    monkeypatch.setattr(engines.base, "ENGINES", {"hf": engines.ENGINES["hf"]})
    assert engines.choose("auto") == ("hf", "auto: no other engine is registered")
    engines.register("slow")(_toy("Slow", 5, None))
    engines.register("gone")(_toy("Gone", 20, "gone is not installed"))
    assert engines.choose("auto") == ("slow", "auto: Slow is here")  # gone ranks higher but is unavailable
    engines.base.ENGINES.pop("slow")
    assert engines.choose("auto") == ("hf", "auto: gone is not installed")  # the fallback, and why


def _toy_policy(d):
    """A policy directory rollout accepts (config, tokenizer, a safetensors file) that no engine here loads."""
    import numpy as np
    from safetensors.numpy import save_file

    from rlkit.tiny import build_tokenizer

    d.mkdir()
    build_tokenizer().save_pretrained(d)
    (d / "config.json").write_text(json.dumps({"model_type": "toy"}))
    save_file({"w": np.zeros((2,), np.float32)}, str(d / "model.safetensors"))
    return d


class _ToyEngine:
    """Sample j of every prompt: "1" repeated j + 1 times, then eos when it fits in max_new_tokens."""

    capabilities = Capabilities(logprobs_match_trainer=True)
    auto_rank = 0
    auto_reason = "never"
    calls: list[dict] = []

    def __init__(self, tokenizer, opts):
        self.tokenizer, self.opts, self.closed = tokenizer, opts, 0

    @classmethod
    def unavailable(cls):
        return None

    @classmethod
    def check_options(cls, opts):
        if opts.tp != 1:
            raise RlkitError("the toy engine runs on one device")

    @classmethod
    def start(cls, policy, opts):
        from rlkit.io import checkpoints

        eng = cls(checkpoints.load_tokenizer(policy), opts)
        cls.calls.append({"start": str(policy), "seed": opts.seed, "engine": eng})
        return eng

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed):
        one, eos = self.tokenizer.convert_tokens_to_ids("1"), self.tokenizer.eos_token_id
        self.calls.append({"prompts": len(prompt_ids), "n": n, "temperature": temperature, "seed": seed})
        ids, fins, lps = [], [], []
        for _ in prompt_ids:
            for j in range(n):
                toks = [one] * (j + 1) + [eos]
                fin = "eos" if len(toks) <= max_new_tokens else "length"
                toks = toks[:max_new_tokens]
                ids.append(toks)
                fins.append(fin)
                lps.append([-0.25 * (k + 1) for k in range(len(toks))])
        return Generated(ids, fins, lps)

    def reload(self, model_dir):
        raise AssertionError("not in this test")

    def close(self):
        self.closed += 1


def test_a_registered_toy_engine_runs_the_real_rollout_stage(tmp_path):
    from rlkit.io import streams
    from rlkit.stages.rollout import RolloutConfig, run

    policy = _toy_policy(tmp_path / "toy-policy")
    engines.register("toy")(_ToyEngine)
    _ToyEngine.calls.clear()
    try:
        assert engines.names() == ("auto", "hf", "vllm", "toy")
        assert engines.capabilities("toy").logprobs_match_trainer
        with pytest.raises(RlkitError, match="one device"):  # asked for by name: its own option check
            run(RolloutConfig(policy=policy, out=tmp_path / "no.arrow", engine="toy", tp=2))
        out = run(RolloutConfig(policy=policy, out=tmp_path / "r.arrow", engine="toy", num_prompts=5, n=3,
                                max_new_tokens=3, temperature=0.5, seed=7, chunk_prompts=2))
    finally:
        engines.ENGINES.pop("toy")
    assert "toy" not in engines.names()
    start, *samples = _ToyEngine.calls
    assert start["start"] == str(policy) and start["seed"] == 7 and start["engine"].closed == 1
    # chunks of 2, 2, 1 prompts, each seeded seed * 1_000_003 + (its first prompt)
    assert samples == [{"prompts": p, "n": 3, "temperature": 0.5, "seed": 7 * 1_000_003 + c0}
                       for p, c0 in ((2, 0), (2, 2), (1, 4))]
    table, reader = streams.read_table(out, ["rollouts"])
    assert reader.manifest["engine"] == "toy"
    assert table.num_rows == 15
    assert table.column("group_id").to_pylist() == [g for g in range(5) for _ in range(3)]
    assert table.column("sample_idx").to_pylist() == [0, 1, 2] * 5
    assert table.column("completion").to_pylist() == ["1", "11", "111"] * 5
    assert table.column("finish_reason").to_pylist() == ["eos", "eos", "length"] * 5
    assert table.column("old_logprobs").to_pylist()[:3] == [[-0.25, -0.5], [-0.25, -0.5, -0.75],
                                                             [-0.25, -0.5, -0.75]]


# --- devices, memory and sleep mode: the GPU paths, checked on this CPU ------------------------------------------


def test_vllm_device_is_checked_not_obeyed(monkeypatch):
    """vLLM takes no device: it runs on the first visible GPU (its CPU backend without CUDA), so `--device` is checked
    against that, and what cannot be honoured says what to do instead."""
    import torch

    from rlkit.engines.vllm import vllm_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vLLM's CPU backend
    assert vllm_device("auto") == vllm_device("cpu") == torch.device("cpu")
    with pytest.raises(RlkitError, match=r"--device cuda: CUDA is not available here .*use --device auto or --device cpu"):
        vllm_device("cuda")
    with pytest.raises(RlkitError, match=r"--device 'tpu': expected auto, cpu, cuda or cuda:N"):
        vllm_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs (nothing here initialises CUDA)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for spec in ("auto", "cuda", "cuda:0"):
        assert vllm_device(spec) == torch.device("cuda", 0)
    with pytest.raises(RlkitError, match=r"--device cpu: --engine vllm runs on the GPU here .* --engine hf --device cpu"):
        vllm_device("cpu")
    with pytest.raises(RlkitError, match=r"--device cuda:1: vLLM runs on the first visible GPU \(cuda:0\) and takes no "
                                         r"device argument; .* CUDA_VISIBLE_DEVICES=1 "):
        vllm_device("cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(RlkitError, match="CUDA_VISIBLE_DEVICES=6 "):  # the GPU cuda:1 is under that setting
        vllm_device("cuda:1")
    with pytest.raises(RlkitError, match=r"--device cuda:2: this machine has 2 GPUs \(cuda:0..cuda:1\)"):
        vllm_device("cuda:2")
    monkeypatch.setenv("LOCAL_RANK", "1")  # auto under torchrun: cuda:LOCAL_RANK, where vLLM does not go
    with pytest.raises(RlkitError, match="CUDA_VISIBLE_DEVICES=6 "):
        vllm_device("auto")


class _FakeLLM:
    """`vllm.LLM` as far as the engine uses it: the keyword arguments it was built with, and the calls since."""

    last = None

    def __init__(self, **kw):
        self.kw, self.calls = kw, []
        type(self).last = self

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        from types import SimpleNamespace as NS

        self.calls.append(("generate", len(prompts)))
        lp = NS(logprob=-0.5)
        return [NS(outputs=[NS(index=0, token_ids=[5, 6], logprobs=[{5: lp}, {6: lp}])]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` package (LLM, SamplingParams, TokensPrompt, the platform's GPU size: 24 GiB), so the
    engine's start-up code runs here without vLLM; restored after the test."""
    import types

    from rlkit.engines.memory import GiB

    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.inputs", "vllm.platforms")}
    mods["vllm"].LLM, mods["vllm"].SamplingParams = _FakeLLM, lambda **kw: kw
    mods["vllm.inputs"].TokensPrompt = lambda **kw: kw
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(get_device_total_memory=lambda i=0: 24 * GiB,
                                                                     has_device_capability=lambda cap, i=0: cap <= 80)
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return mods


def _fp32_policy(d):
    p = _toy_policy(d)
    (p / "config.json").write_text(json.dumps({"model_type": "toy", "dtype": "float32"}))
    return p


def test_vllm_engine_start_on_a_gpu_and_on_its_cpu_backend(fake_vllm, monkeypatch, tmp_path, capsys):
    """What the vllm engine hands `vllm.LLM` where: on a GPU, sleep mode when asked for and a memory share from
    --colocate (or the default, said on stderr); on the CPU backend, neither (0.3, as before)."""
    import torch

    from rlkit.engines.vllm import VLLMEngine
    from rlkit.io import checkpoints

    policy = _fp32_policy(tmp_path / "policy")
    ref = _toy_policy(tmp_path / "ref")
    tok = checkpoints.load_tokenizer(policy)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    eng = VLLMEngine(policy, tok, engines.EngineOptions(sleep=True))
    kw = _FakeLLM.last.kw
    assert "enable_sleep_mode" not in kw and kw["gpu_memory_utilization"] == 0.3 and kw["dtype"] == "float32"
    assert (eng.device, eng.dtype) == (torch.device("cpu"), "fp32")
    assert eng.sleep() is False and eng.wake_up() is None  # no sleep mode on the CPU backend: nothing happens
    eng.sample([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert _FakeLLM.last.calls == [("generate", 1)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    capsys.readouterr()
    eng = VLLMEngine(policy, tok, engines.EngineOptions(sleep=True, colocate=(ref,)))
    kw, llm = _FakeLLM.last.kw, _FakeLLM.last
    # 24 GiB less 2 GiB of CUDA contexts and a few bytes of models: 0.916, capped at 0.9
    assert kw["enable_sleep_mode"] is True and kw["gpu_memory_utilization"] == 0.9
    # --dtype auto on a GPU with bf16 kernels: the fp32 checkpoint is sampled in bf16
    assert (eng.device, eng.dtype, kw["dtype"]) == (torch.device("cuda", 0), "bf16", "bfloat16")
    assert "rollout: vLLM takes 0.9 of the GPU's 24.0 GiB" in capsys.readouterr().err
    assert eng.sleep() is True and eng.sleep() is True  # asleep once
    assert llm.calls == [("sleep", 1)]
    eng.sample([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)  # wakes first
    assert llm.calls == [("sleep", 1), ("wake_up", None), ("generate", 1)]
    eng.wake_up()
    assert len(llm.calls) == 3  # awake already
    eng.sleep()  # a reload wakes the weights alone; the KV cache comes back when sampling needs it
    eng.wake_up(("weights",))
    eng.wake_up(("weights",))
    eng.sample([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert llm.calls[3:] == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), ("generate", 1)]
    VLLMEngine(policy, tok, engines.EngineOptions(dtype="fp32"))  # --dtype fp32 is still fp32 on a GPU
    assert _FakeLLM.last.kw["dtype"] == "float32"

    eng = VLLMEngine(policy, tok, engines.EngineOptions())  # no --colocate: the default share, said once
    assert _FakeLLM.last.kw["gpu_memory_utilization"] == 0.5 and "enable_sleep_mode" not in _FakeLLM.last.kw
    err = capsys.readouterr().err
    assert "rollout: vLLM takes 0.5 of the GPU's 24.0 GiB (the default without --colocate)" in err
    assert eng.sleep() is False  # built without sleep mode
    VLLMEngine(policy, tok, engines.EngineOptions(gpu_memory_utilization=0.7))
    assert _FakeLLM.last.kw["gpu_memory_utilization"] == 0.7 and capsys.readouterr().err == ""
    with pytest.raises(RlkitError, match="--device cpu: --engine vllm runs on the GPU here"):
        engines.check("vllm", engines.EngineOptions(device="cpu"))


class _SleepyToy(_ToyEngine):
    """The toy engine with a sleep mode, on a GPU (as far as rollout can tell): it records sleep, wake_up and
    reload, and while it sleeps the next step appears in the follow directory (as update would publish it)."""

    capabilities = Capabilities(logprobs_match_trainer=True, supports_sleep=True)
    calls: list = []
    device = None
    root = policy = None

    def sleep(self):
        self.calls.append("sleep")
        _publish(self.root, self.policy, 1)
        return True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reload(self, model_dir):
        self.calls.append(("reload", Path(model_dir).name))
        return 0.0


def _publish(root, policy, step: int) -> None:
    """Step `step` in follow directory `root`: a copy of `policy` with the manifest `update --follow` writes."""
    import shutil

    from rlkit.io import checkpoints, follow

    def write(tmp):
        for f in policy.iterdir():
            shutil.copy(f, tmp)
        per_file, digest = checkpoints.hash_weights(tmp)
        return {"kind": "model", "step": step, "weights_sha256": per_file, "weights_digest": digest}

    follow.publish(root, step, write)


@pytest.mark.parametrize("device,lag", [("cuda", 0), ("cpu", 0), ("cuda", 1)])
def test_follow_sleeps_between_batches_only_at_lag_0_on_a_gpu(device, lag, tmp_path, monkeypatch, capsys):
    """rollout --follow --max-lag 0 with an engine that can sleep, on a GPU: sample, write, sleep; (update trains
    and publishes); wake, reload the new step, sample. On the CPU (vLLM's CPU backend) one line, and no sleep."""
    import torch

    from rlkit import devices
    from rlkit.io import streams
    from rlkit.stages.rollout import RolloutConfig, run

    monkeypatch.setattr(devices, "describe", lambda d, dtype=None: str(d))  # no GPU to name here
    monkeypatch.setattr(devices, "manifest_entry", lambda d: {"device": str(d)})
    policy = _toy_policy(tmp_path / "toy-policy")
    root = tmp_path / "ckpts"
    root.mkdir()
    _SleepyToy.calls = []
    _SleepyToy.device, _SleepyToy.root, _SleepyToy.policy = torch.device(device, 0 if device == "cuda" else None), root, policy
    engines.register("sleepy")(_SleepyToy)
    steps = 2 if (device, lag) == ("cuda", 0) else 1  # no one publishes step 1 unless the engine sleeps
    try:
        out = run(RolloutConfig(policy=policy, out=tmp_path / "r.arrow", engine="sleepy", follow=root, batch_prompts=2,
                                n=2, max_new_tokens=3, max_lag=lag, max_steps=steps))
    finally:
        engines.ENGINES.pop("sleepy")
    start, *rest = _SleepyToy.calls
    assert start["engine"].opts.sleep is (lag == 0) and start["engine"].closed == 1
    got = [c if not isinstance(c, dict) else "sample" for c in rest]
    err = capsys.readouterr().err
    t, reader = streams.read_table(out, ["rollouts"])
    assert reader.manifest["device"] == ("cuda:0" if device == "cuda" else "cpu")
    if (device, lag) == ("cuda", 0):
        # the weights woken for the reload, the rest (the KV cache) after it
        assert got == ["sample", "sleep", ("wake_up", ("weights",)), ("reload", "step-000001"), ("wake_up", None),
                       "sample"]
        assert t.column("policy_step").to_pylist() == [0] * 4 + [1] * 4
        assert "the engine sleeps between batches" in err and "1 wake-ups from sleep mode" in err
    else:
        assert got == ["sample"]
        said = "rollout: sleepy's sleep mode needs a GPU; the engine stays awake between batches"
        assert err.count(said) == (1 if device == "cpu" else 0)


def test_colocate_is_checked_before_anything_starts(tmp_path):
    from rlkit.stages.rollout import RolloutConfig, run

    policy = _toy_policy(tmp_path / "toy-policy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RlkitError, match=r"--colocate .*empty: no \*\.safetensors there"):
        run(RolloutConfig(policy=policy, out=tmp_path / "r.arrow", colocate=(tmp_path / "empty",)))
    with pytest.raises(RlkitError, match="--colocate sizes vLLM's --gpu-memory-utilization .*; pass one of them"):
        run(RolloutConfig(policy=policy, out=tmp_path / "r.arrow", colocate=(policy,), gpu_memory_utilization=0.5))
    with pytest.raises(RlkitError, match="--colocate, --max-model-len and --enforce-eager are vLLM options"):
        run(RolloutConfig(policy=policy, out=tmp_path / "r.arrow", colocate=(policy,), engine="hf"))
    assert not (tmp_path / "r.arrow").exists()


@pytest.mark.slow
def test_device_bad_values_through_the_cli(tmp_path):
    import torch

    from conftest import one_error_line, run_cli

    policy = _toy_policy(tmp_path / "toy-policy")
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(policy), "--device", "tpu", "--out", str(out))
    assert r.returncode == 2 and "--device 'tpu': expected auto, cpu, cuda or cuda:N" in one_error_line(r)
    assert not out.exists()
    if not torch.cuda.is_available():
        for extra in ([], ["--engine", "vllm"]):
            r = run_cli("rollout", "--policy", str(policy), "--device", "cuda", "--out", str(out), *extra)
            assert r.returncode == 2 and "--device cuda: CUDA is not available here" in one_error_line(r)
            assert not out.exists()


@pytest.mark.slow
def test_hf_on_cpu_is_auto_here_row_for_row(sft_dir, tmp_path):
    """On a machine without a GPU --device auto is the CPU: the same table, and the manifest says where it ran."""
    import torch

    from rlkit.io import streams

    from conftest import run_cli

    if torch.cuda.is_available():
        pytest.skip("auto is the GPU here")
    tables = {}
    for dev in ("auto", "cpu"):
        out = tmp_path / f"{dev}.arrow"
        r = run_cli("rollout", "--policy", str(sft_dir), "--num-prompts", "6", "--n", "2", "--seed", "3",
                    "--device", dev, "--out", str(out))
        err = r.stderr.decode()
        assert r.returncode == 0, err[-2000:]
        assert err.count("rollout: device cpu (fp32)") == 1
        tables[dev] = streams.read_table(out, ["rollouts"])
    (a, ra), (c, rc) = tables["auto"], tables["cpu"]
    assert a.equals(c)  # every column, bit for bit
    assert ra.manifest["device"] == rc.manifest["device"] == "cpu" and "gpu" not in ra.manifest
    assert (ra.manifest["config"]["device"], rc.manifest["config"]["device"]) == ("auto", "cpu")


def test_generation_keeps_every_tensor_on_the_models_device():
    """`generate` (the hf engine's sampler) on a model on another device than the CPU (tests/devsim.py: any op that
    mixes it with a CPU tensor raises, as CUDA does): the batch goes to the model's device, the tokens and log-probs
    come back, and they are what the same model gives on the CPU. The model is a stand-in whose `generate` checks its
    inputs' device and emits fixed tokens with logits made on that device (transformers' own generate builds
    tensors the harness cannot follow)."""
    from types import SimpleNamespace as NS

    import torch
    from devsim import SecondDevice

    from rlkit.engines.generation import generate
    from rlkit.tiny import build_tokenizer

    class StandIn(torch.nn.Module):
        def __init__(self, vocab: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-1, 1, vocab))

        def generate(self, input_ids, attention_mask, generation_config):
            dev = self.w.device
            assert input_ids.device == attention_mask.device == dev, (input_ids.device, dev)
            b, steps = input_ids.shape[0], generation_config.max_new_tokens
            new = torch.full((b, steps), 7, dtype=torch.long, device=dev)
            logits = tuple(self.w.unsqueeze(0).expand(b, -1) * (k + 1) for k in range(steps))
            return NS(sequences=torch.cat([input_ids, new], 1), logits=logits)

    tok = build_tokenizer()
    model = StandIn(len(tok))
    prompts = [tok("1+2=")["input_ids"], tok("13+4=")["input_ids"]]
    kw = dict(max_new_tokens=3, n=2, greedy=False, temperature=0.7, seed=1, logprobs=True, batch_tokens=16)
    want = generate(model, tok, prompts, **kw)
    with SecondDevice() as dev:
        model.to(dev)
        got = generate(model, tok, prompts, **kw)
    assert got.completion_ids == want.completion_ids == [[7, 7, 7]] * 4
    assert got.logprobs == want.logprobs and got.finish_reasons == want.finish_reasons


def test_generation_stops_at_the_models_context():
    """A batch generates at most what the model's context leaves after its longest prompt: a response is cut there
    (finish reason "length", as at max_new_tokens), never run into positions past max_position_embeddings; where
    the context leaves more than max_new_tokens, max_new_tokens is the limit, as before."""
    import logging

    from rlkit import tiny
    from rlkit.engines.generation import generate

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.TinyConfig(layers=1, hidden=32, heads=4, intermediate=64, max_positions=24), tok,
                             seed=0)
    model.generation_config.eos_token_id = None  # an untrained model may say eos anywhere: never stop early here
    tok_eos = tok.eos_token_id
    tok.eos_token_id = None
    long, short = tok("12+34+56=")["input_ids"], tok("1=")["input_ids"]
    said = []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Catch()
    logging.getLogger("transformers").addHandler(handler)
    try:
        got = generate(model, tok, [long, short], max_new_tokens=100, n=2, greedy=False, seed=0, batch_tokens=10**6)
        few = generate(model, tok, [long], max_new_tokens=3, greedy=True)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        tok.eos_token_id = tok_eos
    room = 24 - len(long)  # one batch: its longest prompt decides
    assert [len(c) for c in got.completion_ids] == [room] * 4 and got.finish_reasons == ["length"] * 4
    assert [len(c) for c in few.completion_ids] == [3] and few.finish_reasons == ["length"]
    assert not [m for m in said if "maximum length" in m], said
