"""Multi-turn sampling and greedy evaluation on the vllm engine, for real on vLLM's CPU backend, beside the hf engine:
`rlkit.sampling.run_episodes` against a toy environment gives trajectories whose tokens are exactly what each engine
sampled, turn by turn, and what the environment said (its text's encoding), with the loss mask and log-probs in
step; a turn's prefix goes to the engine as tokens; stop strings end a vLLM completion at the token that completed
them; vLLM's default `--env-schedule ready` sends each trajectory's turn to its running engine as the trajectory
becomes ready (continuous batching), seeded by (seed, prompt, sample, turn), token-exact as well; and `rlkit eval
--engine vllm` scores what `--engine hf` scores (greedy, the tiny policy).

One engine start per test function (see test_follow_vllm.py for why not a module fixture shared by several).
Skipped, with the reason, only when `import vllm` fails; with RLKIT_REQUIRE_VLLM=1 (CI) that is a failure.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

# A toy environment: an episode of 1 to 3 model turns (by the prompt's length), each turn ended by a "3" (the tiny
# policy writes many) or eos; after each turn but the last the environment names the turn and the length of the
# model's text, rewards 0.5, and the last step 1.0.
ENV = '''
from rlkit.envs import Step


class Turns:
    stop = ("3",)

    def reset(self, example):
        self.k, self.length = 0, 1 + len(example.prompt) % 3
        return example.prompt

    def step(self, action):
        self.k += 1
        if self.k >= self.length:
            return Step(None, 1.0, terminated=True)
        return Step(observation(self.k, action), 0.5)


def observation(k, action):
    return f"\\n<{k}+{len(action)}>="
'''


def observation(k: int, action: str) -> str:
    return f"\n<{k}+{len(action)}>="


class Recording:
    """An engine, each `sample` call's prompts and result kept (the engine does the sampling)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def sample(self, prompt_ids, **kw):
        gen = self.engine.sample(prompt_ids, **kw)
        self.calls.append(([list(p) for p in prompt_ids], gen))
        return gen

    def stream(self, **kw):
        self.calls.append(RecordingStream(self.engine.stream(**kw)))
        return self.calls[-1]


class RecordingStream:
    """An engine's stream (continuous batching), each request's prompt and seed and each result kept."""

    def __init__(self, stream) -> None:
        self.stream, self.sent, self.got = stream, [], {}

    @property
    def pending(self) -> int:
        return self.stream.pending

    def submit(self, key, prompt_ids, seed) -> None:
        self.sent.append((key, list(prompt_ids), seed))
        self.stream.submit(key, prompt_ids, seed)

    def poll(self):
        out = self.stream.poll()
        for key, ids, lps, fin in out:
            self.got.setdefault(key, []).append((ids, lps, fin))
        return out

    def abort(self) -> None:
        self.stream.abort()


def check_trajectories(engine, env_file: Path, tok, prompts: list[str]) -> list[str]:
    """run_episodes on `engine` (2 trajectories a prompt, sampled); each row rebuilt from the engine's per-turn
    outputs and the environment's observations. -> the finish reasons of every turn."""
    from rlkit import sampling
    from rlkit.envs import get_env

    rec = Recording(engine)
    batch = sampling.Prompts(0, [str(i) for i in range(len(prompts))], [None] * len(prompts), prompts,
                             [tok(p)["input_ids"] for p in prompts])
    s = sampling.Sampling(n=2, temperature=1.0, max_new_tokens=8, max_turns=3, env_schedule="turns")
    ep = sampling.run_episodes(rec, tok, get_env(f"{env_file}:Turns"), batch, s, seed=5)
    c = ep.columns
    rows = len(c["completion_ids"])
    assert rows == 2 * len(prompts) and ep.trajectory == list(range(rows))  # no chat template: a row a trajectory
    lengths = [1 + len(prompts[r // 2]) % 3 for r in range(rows)]
    assert c["turns"] == lengths and len(rec.calls) == max(lengths)
    fins = []
    for r in range(rows):
        comp, mask, lps = c["completion_ids"][r], c["loss_mask"][r], c["old_logprobs"][r]
        assert c["prompt_ids"][r] == tok(prompts[r // 2])["input_ids"]
        assert len(comp) == len(mask) == len(lps)
        pos = 0
        for t in range(lengths[r]):
            sent, gen = rec.calls[t]
            i = sum(1 for q in range(r) if lengths[q] > t)  # its place among the trajectories still running
            assert len(sent) == sum(1 for q in range(rows) if lengths[q] > t)
            # token in: the engine got the prompt and the trajectory so far as the very tokens it holds
            assert sent[i] == c["prompt_ids"][r] + comp[:pos]
            out = gen.completion_ids[i]
            assert out and comp[pos:pos + len(out)] == out and mask[pos:pos + len(out)] == [1] * len(out)
            assert lps[pos:pos + len(out)] == gen.logprobs[i]
            fin = gen.finish_reasons[i]
            fins.append(fin)
            text = tok.decode(out, skip_special_tokens=True)
            if fin == "stop":  # ends with the token that completed the stop string, not one more
                assert "3" in text and "3" not in tok.decode(out[:-1], skip_special_tokens=True)
            elif fin == "eos":
                assert out[-1] == tok.eos_token_id and "3" not in text
            else:
                assert fin == "length" and len(out) == 8 and "3" not in text
            pos += len(out)
            if t < lengths[r] - 1:  # the environment's observation: its text's encoding, mask 0, log-prob 0.0
                obs = tok(observation(t + 1, text), add_special_tokens=False)["input_ids"]
                assert comp[pos:pos + len(obs)] == obs
                assert mask[pos:pos + len(obs)] == [0] * len(obs) and lps[pos:pos + len(obs)] == [0.0] * len(obs)
                pos += len(obs)
        assert pos == len(comp)
        assert c["turn_rewards"][r] == [0.5] * (lengths[r] - 1) + [1.0]
        assert c["reward/env"][r] == 0.5 * (lengths[r] - 1) + 1.0
        assert c["end_reason"][r] == "terminated" and c["terminated"][r] and not c["truncated"][r]
        assert [m["role"] for m in c["messages"][r]] == ["user"] + ["assistant", "user"] * (lengths[r] - 1) + ["assistant"]
    return fins


def check_continuous(engine, env_file: Path, tok, prompts: list[str]) -> None:
    """vLLM's default schedule (ready): each trajectory's turns go to the engine's stream one request at a time, its
    prefix as the very tokens it holds, seeded by (seed, prompt, sample, turn); each row is what the stream returned,
    turn by turn, with the environment's observations between, masked."""
    from rlkit import sampling
    from rlkit.envs import get_env
    from rlkit.sampling.driver import trajectory_seed

    rec = Recording(engine)
    batch = sampling.Prompts(0, [str(i) for i in range(len(prompts))], [None] * len(prompts), prompts,
                             [tok(p)["input_ids"] for p in prompts])
    s = sampling.Sampling(n=2, temperature=1.0, max_new_tokens=8, max_turns=3)
    ep = sampling.run_episodes(rec, tok, get_env(f"{env_file}:Turns"), batch, s, seed=5)
    (stream,) = rec.calls  # no engine.sample call: one stream
    c = ep.columns
    lengths = [1 + len(prompts[r // 2]) % 3 for r in range(len(c["completion_ids"]))]
    assert c["turns"] == lengths and len(stream.sent) == sum(lengths)
    for r, comp in enumerate(c["completion_ids"]):
        sent = [(p, seed) for k, p, seed in stream.sent if k == r]
        assert [seed for _, seed in sent] == [trajectory_seed(5, r, 2, t) for t in range(lengths[r])]
        pos, mask, lps = 0, c["loss_mask"][r], c["old_logprobs"][r]
        for t, ((prefix, _), (out, out_lps, _)) in enumerate(zip(sent, stream.got[r], strict=True)):
            assert prefix == c["prompt_ids"][r] + comp[:pos]
            assert comp[pos:pos + len(out)] == out and mask[pos:pos + len(out)] == [1] * len(out)
            assert lps[pos:pos + len(out)] == out_lps
            pos += len(out)
            if t < lengths[r] - 1:
                obs = tok(observation(t + 1, tok.decode(out, skip_special_tokens=True)),
                          add_special_tokens=False)["input_ids"]
                assert comp[pos:pos + len(obs)] == obs and mask[pos:pos + len(obs)] == [0] * len(obs)
                pos += len(obs)
        assert pos == len(comp) and c["end_reason"][r] == "terminated"


def check_stop_strings(engine, tok, ids: list[list[int]]) -> None:
    """The same seed with and without stop strings: a stopped completion is the unstopped one up to and including
    the token that completed a stop string, and its text holds that string."""
    stop = ("2", "5")
    free = engine.sample(ids, n=4, temperature=1.5, top_p=1.0, max_new_tokens=24, seed=3)
    cut = engine.sample(ids, n=4, temperature=1.5, top_p=1.0, max_new_tokens=24, seed=3, stop=stop)
    stopped = 0
    for a, fa, la, b, fb, lb in zip(free.completion_ids, free.finish_reasons, free.logprobs, cut.completion_ids,
                                    cut.finish_reasons, cut.logprobs, strict=True):
        text = tok.decode(a, skip_special_tokens=True)
        if any(s in text for s in stop):
            k = min(j for j in range(1, len(a) + 1) if any(s in tok.decode(a[:j], skip_special_tokens=True)
                                                          for s in stop))
            assert (b, fb) == (a[:k], "stop")
            assert any(s in tok.decode(b, skip_special_tokens=True) for s in stop)
            assert lb == pytest.approx(la[:k], abs=1e-5)
            stopped += 1
        else:
            assert (b, fb) == (a, fa) and fa in ("eos", "length")
    assert stopped >= 4  # the check saw stops (16 completions of random characters at temperature 1.5)


def test_multiturn_trajectories_and_stop_strings_on_vllm_and_hf(vllm_ok, sft_dir, tmp_path):
    from rlkit import engines
    from rlkit.tasks import get_task

    env_file = tmp_path / "turns_env.py"
    env_file.write_text(ENV)
    prompts = [e.prompt for e in get_task("arithmetic").examples("heldout", 6, 0)]
    assert {1 + len(p) % 3 for p in prompts} == {1, 2, 3}  # episodes of each length
    hf = engines.create("hf", sft_dir)
    tok = hf.tokenizer
    t0 = time.perf_counter()
    vllm = engines.create("vllm", sft_dir, engines.EngineOptions(dtype="fp32", seed=0))
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:
        assert vllm.context == hf.context == 256
        fins = {name: check_trajectories(e, env_file, tok, prompts) for name, e in (("hf", hf), ("vllm", vllm))}
        for name, f in fins.items():
            assert "stop" in f and "eos" in f, (name, f)  # both ways a turn ends were seen on both engines
        check_continuous(vllm, env_file, tok, prompts)
        check_stop_strings(vllm, tok, [tok(p)["input_ids"] for p in prompts[:4]])
        # greedy (temperature 0) is each engine's own argmax decoding: the same responses
        ids = [tok(e.prompt)["input_ids"] for e in get_task("arithmetic").examples("heldout", 40, 1)]
        g_hf = hf.sample(ids, n=1, temperature=0, top_p=1.0, max_new_tokens=12, seed=0)
        g_vllm = vllm.sample(ids, n=1, temperature=0, top_p=1.0, max_new_tokens=12, seed=7)
        assert g_vllm.completion_ids == g_hf.completion_ids
        assert g_vllm.finish_reasons == g_hf.finish_reasons
    finally:
        vllm.close()
        hf.close()


def test_eval_on_vllm_scores_what_hf_scores(vllm_ok, sft_dir, tmp_path):
    args = ["eval", "--policy", str(sft_dir), "--num-prompts", "40", "--json", "--seed", "2"]
    r_hf = run_cli(*args, "--engine", "hf", cwd=tmp_path)
    assert r_hf.returncode == 0, r_hf.stderr.decode()[-2000:]
    r_vllm = run_cli(*args, "--engine", "vllm", cwd=tmp_path, timeout=600)
    assert r_vllm.returncode == 0, r_vllm.stderr.decode()[-3000:]
    assert "eval: engine vllm (asked for)" in r_vllm.stderr.decode()
    a, b = json.loads(r_hf.stdout), json.loads(r_vllm.stdout)
    assert (a["engine"], b["engine"]) == ("hf", "vllm")
    for k in ("accuracy", "n", "n_scored", "mean_response_tokens", "truncated_fraction", "samples"):
        assert a[k] == b[k], k


def test_vllm_finish_reasons():
    """vLLM's (finish_reason, stop_reason) as rlkit's finish reason: a stop string (vLLM names it) is "stop"; the
    tokenizer's eos, or another eos id of the model's generation_config (vLLM names its id), "eos"; else "length"."""
    from rlkit.engines.vllm import finish_reason

    assert finish_reason("stop", "</tool>", [5, 6], eos=2) == "stop"
    assert finish_reason("stop", None, [5, 2], eos=2) == "eos"
    assert finish_reason("stop", 151643, [5, 151643], eos=2) == "eos"
    assert finish_reason("length", None, [5, 6], eos=2) == "length"
    assert finish_reason(None, None, [5, 2], eos=2) == "eos"  # a completion without vLLM's reasons: by its tokens
