"""The engine registry (`rlkit.engines`): the names and capabilities the stages rely on, `--engine auto`'s
resolution, and a toy engine registered here for the length of one test, run through the real rollout stage
(no model: it samples fixed tokens), so the stage provably talks to the protocol only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlkit import engines
from rlkit.engines import Capabilities, Generated
from rlkit.errors import RlkitError


def test_builtin_engines_and_their_capabilities():
    assert engines.names() == ("auto", "hf", "vllm")  # --engine's choices, auto first
    # update trusts pi_old from hf (the trainer's own fp32 forward pass) and recomputes it for vllm
    assert engines.capabilities("hf") == Capabilities(logprobs_match_trainer=True, supports_lora=False,
                                                      supports_sleep=False)
    # vllm runs a LoRA checkpoint as base + adapter; no engine has a sleep mode yet (and vLLM has none on CPU)
    assert engines.capabilities("vllm") == Capabilities(logprobs_match_trainer=False, supports_lora=True,
                                                        supports_sleep=False)
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
    monkeypatch.setattr(engines, "ENGINES", {"hf": engines.ENGINES["hf"]})
    assert engines.choose("auto") == ("hf", "auto: no other engine is registered")
    engines.register("slow")(_toy("Slow", 5, None))
    engines.register("gone")(_toy("Gone", 20, "gone is not installed"))
    assert engines.choose("auto") == ("slow", "auto: Slow is here")  # gone ranks higher but is unavailable
    engines.ENGINES.pop("slow")
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
    from rlkit.io import artifacts
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
    table, reader = artifacts.read_table(out, ["rollouts"])
    assert reader.manifest["engine"] == "toy"
    assert table.num_rows == 15
    assert table.column("group_id").to_pylist() == [g for g in range(5) for _ in range(3)]
    assert table.column("sample_idx").to_pylist() == [0, 1, 2] * 5
    assert table.column("completion").to_pylist() == ["1", "11", "111"] * 5
    assert table.column("finish_reason").to_pylist() == ["eos", "eos", "length"] * 5
    assert table.column("old_logprobs").to_pylist()[:3] == [[-0.25, -0.5], [-0.25, -0.5, -0.75],
                                                             [-0.25, -0.5, -0.75]]
