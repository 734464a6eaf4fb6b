"""The vllm engine's `reload` (`rlkit.engines.vllm`), for real on vLLM's CPU backend: a running engine switches
to another checkpoint's weights in place, and its log-probs are then those of the new checkpoint (the HF
forward pass, fp32).

One engine start-up in the whole file (~40 s here), so one test function: `--dist loadgroup` would keep
the tests of a module together, but with pytest 9.2 and pytest-xdist 3.8 it no longer does (xdist sets
`item._nodeid`, which pytest 9 ignores), and each xdist worker would start its own engine. The prompt is longer than one KV block (128 tokens on
vLLM's CPU backend), so its first block sits in vLLM's prefix cache before each reload and the log-probs
are read through that cache: KV kept from the old weights, or an lm_head still packed from them, would
show. Skipped, with the reason, only when `import vllm` fails; with RLKIT_REQUIRE_VLLM=1 that is a failure.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm")]  # one engine per module

TOL = 1e-4  # max abs log-prob gap vLLM vs the HF forward pass, both fp32
SHOTS = [(3, 4), (10, 5), (21, 30), (8, 8), (14, 2), (7, 6), (40, 11), (9, 9), (2, 3), (33, 12), (5, 17),
         (6, 1), (15, 15), (4, 4), (18, 20), (11, 11), (1, 2), (30, 3), (13, 5)]
PROMPT = "".join(f"{a}+{b}={a + b}\n" for a, b in SHOTS) + "12+7="
COMPLETION = "19"


@pytest.fixture(scope="module")
def perturbed_dir(sft_dir, tmp_path_factory) -> Path:
    """`sft_dir` with every parameter moved by small deterministic noise: a plain HF directory."""
    import torch

    from rlkit.io.checkpoints import load_policy

    model, tok = load_policy(sft_dir, "fp32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("follow") / "perturbed"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf(sft_dir, perturbed_dir):
    """The HF models (fp32) of both checkpoints, and the shared tokenizer."""
    from rlkit.io.checkpoints import load_policy

    sft, tok = load_policy(sft_dir, "fp32")
    pert, _ = load_policy(perturbed_dir, "fp32")
    return {sft_dir: sft, perturbed_dir: pert}, tok


@pytest.fixture(scope="module")
def ids(hf) -> tuple[list[int], list[int]]:
    """Prompt token ids (with <bos>) and completion token ids (ending in <eos>)."""
    _, tok = hf
    prompt = tok(PROMPT)["input_ids"]
    completion = tok(COMPLETION, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(prompt) > 128 and len(completion) == 3
    return prompt, completion


@pytest.fixture(scope="module")
def engine(vllm_ok, sft_dir, hf):
    from rlkit import engines

    t0 = time.perf_counter()
    eng = engines.create("vllm", sft_dir, engines.EngineOptions(dtype="float32", seed=0))
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    yield eng
    eng.close()


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) from the HF forward pass."""
    import torch

    seq = prompt + completion
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def vllm_logprobs(engine, prompt: list[int], completion: list[int]) -> tuple[list[float], int]:
    """The same from vLLM (prompt log-probs of prompt+completion), reading the prefix cache, which vLLM skips
    by default for prompt log-probs. Also: how many prompt tokens came from the cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seq = prompt + completion
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                            skip_reading_prefix_cache=False)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=seq)], params, use_tqdm=False)[0]
    # prompt_logprobs[j]: log-prob of seq[j] given seq[:j] (entry 0, the first token, is None)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(seq) and lps[0] is None
    return [float(lps[len(prompt) + i][t].logprob) for i, t in enumerate(completion)], out.num_cached_tokens


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def switch(engine, target: Path) -> float:
    secs = engine.reload(target)
    print(f"reload -> {target.name}: {secs:.3f} s", file=sys.stderr)
    return secs


def check_logprobs_follow_reloads(engine, hf, ids, sft_dir, perturbed_dir) -> None:
    """vLLM's log-probs are HF(sft)'s, then after each reload those of the checkpoint reloaded, including
    through a prefix cache filled before the reload."""
    models, _ = hf
    prompt, completion = ids
    want = {d: hf_logprobs(m, prompt, completion) for d, m in models.items()}
    assert gap(want[sft_dir], want[perturbed_dir]) > 100 * TOL  # the checks below can fail
    assert engine.policy == sft_dir

    # before: the engine is the SFT policy, and the prompt's first block is in the prefix cache
    got, _ = vllm_logprobs(engine, prompt, completion)
    got, cached = vllm_logprobs(engine, prompt, completion)
    assert cached >= 128
    before = gap(got, want[sft_dir])
    print(f"\nbefore reload: vLLM vs HF(sft) {before:.3g}, vs HF(perturbed) {gap(got, want[perturbed_dir]):.3g}",
          file=sys.stderr)
    assert before <= TOL
    assert gap(got, want[perturbed_dir]) > 100 * TOL

    secs = []
    for target, other in [(perturbed_dir, sft_dir), (sft_dir, perturbed_dir), (perturbed_dir, sft_dir),
                          (sft_dir, perturbed_dir)]:
        secs.append(switch(engine, target))
        assert engine.policy == target
        for _ in range(2):  # the first recomputes the prompt (cache reset), the second reads it from the cache
            got, cached = vllm_logprobs(engine, prompt, completion)
            after = gap(got, want[target])
            print(f"  after reload -> {target.name} (cached {cached} tokens): vLLM vs HF({target.name}) "
                  f"{after:.3g}, vs HF({other.name}) {gap(got, want[other]):.3g}", file=sys.stderr)
            assert after <= TOL, f"after reload -> {target.name}: vLLM's log-probs are off by {after:.3g}"
        assert cached >= 128
    secs.sort()
    print(f"reload seconds: median {secs[len(secs) // 2]:.3f} of {len(secs)}", file=sys.stderr)


def check_sampling_after_reload(engine, hf, ids, perturbed_dir) -> None:
    """Sampling on reloaded weights works, and the log-probs it logs (pi_old) are the new policy's."""
    models, _ = hf
    prompt, _ = ids
    engine.sample([prompt], n=1, temperature=1.0, top_p=1.0, max_new_tokens=1, seed=0)  # prompt into the cache
    switch(engine, perturbed_dir)
    g = engine.sample([prompt, prompt[:40]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=3)
    assert len(g.completion_ids) == len(g.logprobs) == 4
    for row, (p, toks, lps) in enumerate(zip([prompt, prompt, prompt[:40], prompt[:40]], g.completion_ids,
                                             g.logprobs, strict=True)):
        assert 0 < len(toks) == len(lps) <= 4
        assert all(math.isfinite(x) and x <= 0 for x in lps)
        # temperature 1, top_p 1: the logged pi_old is the perturbed policy's own log-prob
        want = hf_logprobs(models[perturbed_dir], p, toks)
        assert gap(lps, want) <= TOL, f"sample {row}: {lps} vs HF(perturbed) {want}"


def check_reload_without_weights_is_refused(engine, ids, where: Path) -> None:
    """A directory without *.safetensors (pruned meanwhile, or not a checkpoint) is refused before vLLM is
    touched: a failed reload inside vLLM would leave the engine half loaded (it crashes on the next step)."""
    from rlkit.errors import RlkitError

    prompt, _ = ids
    before = engine.policy
    where.mkdir()
    (where / "config.json").write_text("{}")
    for bad in (where / "pruned", where):
        with pytest.raises(RlkitError, match="no \\*.safetensors"):
            engine.reload(bad)
    assert engine.policy == before
    g = engine.sample([prompt], n=2, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert len(g.completion_ids) == 2 and all(math.isfinite(x) for lps in g.logprobs for x in lps)


def check_sleep_is_skipped_on_the_cpu_backend(engine, ids) -> None:
    """vLLM's CPU backend has no sleep mode: the engine, which can sleep on CUDA, reports the CPU as its device,
    `sleep` does nothing and says so (False), `wake_up` is a no-op, and sampling goes on as before (what
    `rollout --follow --max-lag 0` relies on when it skips sleeping here)."""
    import torch

    prompt, _ = ids
    assert engine.capabilities.supports_sleep and engine.device == torch.device("cpu") and engine.dtype == "fp32"
    assert engine.sleep() is False and not engine.asleep
    engine.wake_up()
    g = engine.sample([prompt], n=2, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert len(g.completion_ids) == 2 and all(math.isfinite(x) for lps in g.logprobs for x in lps)


def check_seeded_sampling_is_reproducible(engine, ids) -> None:
    """The same prompts and seed give the same samples and log-probs (each prompt's seed comes from --seed and
    its position, so a rollout rerun gives the same table); another seed gives other samples."""
    prompt, _ = ids
    prompts = [prompt, prompt[:40], prompt[:20]]
    a, b = (engine.sample(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=11) for _ in range(2))
    assert a.completion_ids == b.completion_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x == pytest.approx(y, abs=1e-6)
    c = engine.sample(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=12)
    assert c.completion_ids != a.completion_ids


def test_reload_switches_a_running_engine_to_new_weights(engine, hf, ids, sft_dir, perturbed_dir, tmp_path):
    check_seeded_sampling_is_reproducible(engine, ids)
    check_sleep_is_skipped_on_the_cpu_backend(engine, ids)
    check_logprobs_follow_reloads(engine, hf, ids, sft_dir, perturbed_dir)
    check_sampling_after_reload(engine, hf, ids, perturbed_dir)
    check_reload_without_weights_is_refused(engine, ids, tmp_path / "bad")
    switch(engine, sft_dir)
    check_logprobs_follow_reloads(engine, hf, ids, sft_dir, perturbed_dir)  # and once more, from the top
