"""LoRA checkpoints on the vLLM engine, for real on vLLM's CPU backend: the engine runs the adapter with vLLM's
LoRA support (base weights + a LoRARequest per call), swaps adapters in place, falls back to merged weights
for an adapter on another base, and its log-probs are those of the HF forward pass of the merged model.

One engine start-up in the whole file (~25 s here), so one test function (see test_follow_vllm.py for why).
Skipped, with the reason, only when `import vllm` fails; with RLKIT_REQUIRE_VLLM=1 that is a failure.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

from conftest import make_lora_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

TOL = 1e-3  # max abs log-prob gap vLLM (LoRA kernels) vs the HF forward pass of the merged model, both fp32
PROMPT = "".join(f"{a}+{b}={a + b}\n" for a, b in [(3, 4), (10, 5), (21, 30), (8, 8), (14, 2)]) + "12+7="


@pytest.fixture(scope="module")
def dirs(sft_dir, tmp_path_factory) -> dict[str, Path]:
    """sft (plain), lora_a and lora_a2 (adapters on sft), perturbed (plain) and lora_b (an adapter on it)."""
    import torch

    from rlkit.io.checkpoints import load_policy

    root = tmp_path_factory.mktemp("lora-vllm")
    model, tok = load_policy(sft_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(root / "perturbed", safe_serialization=True)
    tok.save_pretrained(root / "perturbed")
    return {"sft": sft_dir, "lora_a": make_lora_checkpoint(sft_dir, root / "lora_a", 1),
            "lora_a2": make_lora_checkpoint(sft_dir, root / "lora_a2", 2), "perturbed": root / "perturbed",
            "lora_b": make_lora_checkpoint(root / "perturbed", root / "lora_b", 3)}


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def vllm_prompt_logprobs(engine, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion | prompt) from vLLM's prompt log-probs, under the engine's current adapter."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt + completion)], params, use_tqdm=False,
                              lora_request=engine.lora_request)[0]
    return [float(out.prompt_logprobs[len(prompt) + i][t].logprob) for i, t in enumerate(completion)]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def check(engine, hf_model, prompt, completion, label: str) -> None:
    """Prompt log-probs and sampled pi_old of the engine are the HF model's."""
    got = vllm_prompt_logprobs(engine, prompt, completion)
    want = hf_logprobs(hf_model, prompt, completion)
    print(f"  {label}: vLLM vs HF {gap(got, want):.2g}", file=sys.stderr)
    assert gap(got, want) <= TOL, f"{label}: {got} vs {want}"
    g = engine.sample([prompt, prompt[:12]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=3)
    for p, toks, lps in zip([prompt, prompt, prompt[:12], prompt[:12]], g.completion_ids, g.logprobs, strict=True):
        assert 0 < len(toks) == len(lps) <= 4 and all(math.isfinite(x) and x <= 0 for x in lps)
        assert gap(lps, hf_logprobs(hf_model, p, toks)) <= TOL, f"{label}: sampled pi_old"


def test_vllm_runs_lora_checkpoints_as_adapters_and_merges_when_it_must(vllm_ok, dirs):
    from rlkit import engines
    from rlkit.io.checkpoints import load_policy, load_tokenizer

    tok = load_tokenizer(dirs["sft"])
    hf = {k: load_policy(d, merged=True)[0] for k, d in dirs.items()}
    prompt = tok(PROMPT)["input_ids"]
    completion = tok("19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # the adapters matter: the checks below can fail
    assert gap(hf_logprobs(hf["lora_a"], prompt, completion), hf_logprobs(hf["sft"], prompt, completion)) > 10 * TOL
    assert gap(hf_logprobs(hf["lora_a"], prompt, completion), hf_logprobs(hf["lora_a2"], prompt, completion)) > 10 * TOL

    t0 = time.perf_counter()
    engine = engines.create("vllm", dirs["lora_a"], engines.EngineOptions(dtype="float32", seed=0))
    print(f"\nvLLM engine start (LoRA): {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:
        assert engine.capabilities.supports_lora  # what the assertions below exercise
        # vLLM's LoRA: the base's weights, the adapter per request
        assert engine.weights == dirs["sft"].absolute() and engine.lora_request is not None
        assert engine.max_lora_rank == 8  # rank 4, rounded up to a rank vLLM's kernels take
        check(engine, hf["lora_a"], prompt, completion, "lora_a (vLLM LoRA)")
        # another adapter on the same base: the request is swapped, no weights move
        secs = engine.reload(dirs["lora_a2"])
        assert engine.lora_request.lora_path == str(dirs["lora_a2"].absolute()) and engine._tmp is None
        print(f"  adapter swap: {secs:.3f} s", file=sys.stderr)
        check(engine, hf["lora_a2"], prompt, completion, "lora_a2 (adapter swapped)")
        # an adapter on another base: merged weights from a temporary directory
        engine.reload(dirs["lora_b"])
        tmp = engine._tmp
        assert engine.lora_request is None and tmp is not None and tmp.is_dir() and engine.weights == tmp
        check(engine, hf["lora_b"], prompt, completion, "lora_b (merged)")
        # a plain checkpoint: its weights; the temporary directory goes
        engine.reload(dirs["sft"])
        assert engine.lora_request is None and engine._tmp is None and not tmp.exists()
        check(engine, hf["sft"], prompt, completion, "sft (plain)")
        # and back to an adapter on the weights now held: vLLM's LoRA again
        engine.reload(dirs["lora_a"])
        assert engine.lora_request is not None and engine.weights == dirs["sft"].absolute()
        check(engine, hf["lora_a"], prompt, completion, "lora_a (vLLM LoRA again)")
    finally:
        engine.close()
