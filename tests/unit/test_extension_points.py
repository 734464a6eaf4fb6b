"""Each extension point is one file and one registry line: a toy of each, added through only that place (its file
written to a temporary directory on sys.path, its line added with `monkeypatch`, so nothing outlives the test), and
rlkit then uses it.

The toys that live beside their own subject elsewhere (not repeated here):
  a task: `tests/unit/test_tasks.py::test_a_builtin_task_is_a_taskbase_class_and_one_registry_line` (a `TaskBase`
      file and one line of `rlkit.tasks.registry.TASKS`);
  a rubric kind: `tests/unit/test_rubrics.py::test_a_rubric_kind_is_one_registry_entry` (`rlkit.rubrics.KINDS`);
  a sandbox backend: `tests/unit/test_sandbox_backends.py` (`rlkit.sandbox.backends.BACKENDS`);
  an engine through the real rollout stage and `--engine auto`: `tests/unit/test_engines.py`
      (`test_a_registered_toy_engine_runs_the_real_rollout_stage`, `test_auto_prefers_the_highest_ranked_available_engine`).

Here: an algorithm (`rlkit.algorithms.registry.REGISTRY`), an engine as the sampling driver reads it
(`rlkit.engines.base.register`: its `Capabilities`), an environment (`rlkit.envs.registry.ENVS`, or a FILE.py:CLASS
spec), a tool-call format (`rlkit.envs.tools.CALL_FORMATS`) and a scorer (a `rlkit.scorers.base.Scorer` subclass;
its one line is in `rlkit.scorers.sources.from_options`' list, which score-ref's scoring loop runs as it is given).
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest


def _module(tmp_path, monkeypatch, name: str, source: str) -> None:
    """The toy's file, importable as `name` for this test only: imported afresh, and gone from sys.modules after."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, name, None)  # recorded as absent: the test's teardown removes the module
    del sys.modules[name]


# -- an algorithm: a module with an Algorithm subclass and one REGISTRY entry ----------------------------------------

TOY_ALGO = '''
from rlkit.algorithms.grpo import GRPO


class Toy(GRPO):
    """GRPO with a fixed baseline: the advantage is the reward minus 0.5, no group statistics."""

    name = "toy"

    def advantages(self, trainer, batch, old_logp, kl_tok, kl_coef, cfg, metrics, host=None):
        adv = batch.rewards - 0.5
        metrics["advantage_abs_mean"] = float(adv.abs().mean())
        return adv, {}
'''


def test_an_algorithm_is_a_module_and_one_registry_entry(tmp_path, monkeypatch):
    import torch

    from rlkit.algorithms import registry
    from rlkit.algorithms.base import Context
    from rlkit.algorithms.batch import RLBatch
    from rlkit.algorithms.config import RLConfig, resolve
    from rlkit.algorithms.registry import AlgoDefaults, Entry

    _module(tmp_path, monkeypatch, "toyalgo", TOY_ALGO)
    monkeypatch.setitem(registry.REGISTRY, "toy", Entry("toyalgo:Toy", "the reward minus a fixed baseline of 0.5",
                                                        AlgoDefaults(beta=0.0, clip_high=0.3)))
    cls = registry.get("toy")
    assert cls.__module__ == "toyalgo" and cls.name == "toy" and "toy" in registry.names()
    assert "toy: the reward minus a fixed baseline of 0.5" in registry.help_text()  # --algo's help
    cfg = resolve(RLConfig(algo="toy"))  # its registry line's defaults, the rest everyone's
    assert (cfg.beta, cfg.clip_high, cfg.clip_low, cfg.loss_agg, cfg.kl_in) == (0.0, 0.3, 0.2, "token-mean", "loss")
    cfg.check()

    # a batch of 2 groups of 2 (2 prompt tokens, 2 completion tokens): the plan the trainer runs holds its advantages
    n, C = 4, 2
    ids = torch.tensor([[1, 20, 21, 22], [1, 20, 23, 2], [1, 24, 25, 26], [1, 24, 27, 2]])
    batch = RLBatch(input_ids=ids, attn=torch.ones_like(ids), targets=ids[:, 2:], mask=torch.ones(n, C, dtype=torch.bool),
                    start=torch.full((n,), 1), old_logp=torch.full((n, C), -4.0), ref_logp=None,
                    rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), groups=torch.tensor([0, 0, 1, 1]))
    plan = cls(cfg).prepare(None, batch, cfg, Context())  # the engine's pi_old: no trainer forward pass
    assert plan.adv.tolist() == [0.5, -0.5, 0.5, 0.5] and plan.rows.tolist() == [0, 1, 2, 3]
    grpo = registry.get("grpo")(cfg).prepare(None, batch, cfg, Context())  # the built-in it subclasses differs
    assert grpo.adv[2:].tolist() == [0.0, 0.0] and grpo.adv[0] > 0.5

    # `update`'s trainer runs it by its name: one optimizer step on the embedded model (untrained, small)
    from rlkit import tiny
    from rlkit.algorithms.trainer import Trainer

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.TinyConfig(layers=1, hidden=32, heads=4, intermediate=64), tok, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, RLConfig(algo="toy", epochs=1), tokenizer=tok)
    assert type(trainer.algo) is cls
    metrics = trainer.train(batch, recompute=True)
    assert metrics["advantage_abs_mean"] == 0.5 and metrics["optimizer_steps"] == 1
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


# -- an engine: a class registered with `register`, its capabilities read by the sampling driver -----------------

TOY_ENGINE = '''
from rlkit.engines.base import Capabilities, Generated, register


@register("toy")
class Toy:
    """Sample j of every prompt: the token "7" j + 1 times, then eos; every log-prob 0."""

    capabilities = Capabilities(streams_tickers=True, optional_logprobs=True, continuous_batching=True)
    auto_rank = 0
    auto_reason = "never"
    dtype = "fp32"
    device = None

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    @classmethod
    def unavailable(cls):
        return None

    @classmethod
    def check_options(cls, opts):
        pass

    @classmethod
    def start(cls, policy, opts):
        from rlkit.io import checkpoints

        return cls(checkpoints.load_tokenizer(policy))

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed, stop=(), ticker=None,
               logprobs=True):
        self.calls.append({"prompts": len(prompt_ids), "n": n, "ticker": ticker is not None, "logprobs": logprobs})
        seven, eos = self.tokenizer.convert_tokens_to_ids("7"), self.tokenizer.eos_token_id
        ids = [([seven] * (j + 1) + [eos])[:max_new_tokens] for _ in prompt_ids for j in range(n)]
        if ticker is not None:
            ticker.advance(len(prompt_ids))
        return Generated(ids, ["eos" if ids_[-1] == eos else "length" for ids_ in ids],
                         [[0.0] * len(i) for i in ids] if logprobs else None)

    def reload(self, model_dir):
        return 0.0

    def close(self):
        pass
'''


@pytest.fixture
def toy_engine(tmp_path, monkeypatch):
    """The toy engine's module, registered for this test only (the registry lives in `rlkit.engines.base`: a copy
    of it stands there while the test runs), and a policy directory it starts on (a tokenizer and a config: no
    weights it reads)."""
    import numpy as np
    from safetensors.numpy import save_file

    from rlkit.engines import base
    from rlkit.tiny import build_tokenizer

    monkeypatch.setattr(base, "ENGINES", dict(base.ENGINES))
    _module(tmp_path, monkeypatch, "toyengine", TOY_ENGINE)
    __import__("toyengine")
    policy = tmp_path / "policy"
    policy.mkdir()
    build_tokenizer().save_pretrained(policy)
    (policy / "config.json").write_text(json.dumps({"model_type": "toy"}))
    save_file({"w": np.zeros((2,), np.float32)}, str(policy / "model.safetensors"))
    return policy


class _Ticker:
    def __init__(self):
        self.n = 0

    def advance(self, k):
        self.n += k


def test_an_engine_is_one_registered_class_and_the_driver_reads_its_capabilities(toy_engine, monkeypatch):
    from rlkit import engines
    from rlkit.sampling.driver import Prompts, Sampling, sample, schedule

    assert "toy" in engines.names() and engines.capabilities("toy").continuous_batching
    eng = engines.create("toy", toy_engine)
    tok = eng.tokenizer
    prompts = Prompts(0, ["a", "b"], ["1", "2"], ["1+0=", "1+1="], [tok("1+0=")["input_ids"], tok("1+1=")["input_ids"]])
    ticker = _Ticker()
    gen = sample(eng, prompts, Sampling(n=2, max_new_tokens=4, logprobs=False), seed=0, ticker=ticker)
    assert [tok.decode(i, skip_special_tokens=True) for i in gen.completion_ids] == ["7", "77"] * 2
    assert gen.logprobs is None and ticker.n == 2
    # streams_tickers and optional_logprobs: the driver hands it the ticker and asks for no log-probs
    assert eng.calls == [{"prompts": 2, "n": 2, "ticker": True, "logprobs": False}]
    assert schedule(eng, "auto") == "ready"  # continuous_batching: --env-schedule auto is ready on it

    # the same class without those capabilities: the driver passes neither and advances the ticker itself
    monkeypatch.setattr(type(eng), "capabilities", engines.CONSERVATIVE)
    eng.calls.clear()
    gen = sample(eng, prompts, Sampling(n=1, max_new_tokens=4, logprobs=False), seed=0, ticker=ticker)
    assert eng.calls == [{"prompts": 2, "n": 1, "ticker": False, "logprobs": True}] and ticker.n == 4
    assert gen.logprobs == [[0.0, 0.0]] * 2 and schedule(eng, "auto") == "turns"


# -- an environment: a class in a file, by FILE.py:CLASS or by name through one ENVS line -------------------------

TOY_ENV = '''
from rlkit.envs.base import Step


class Again:
    """Two turns: after the first the observation " again:" (reward 0.25), after the second the end (reward 1)."""

    def reset(self, example):
        self.turn = 0
        return example.prompt

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return Step(" again:", 0.25)
        return Step(None, 1.0, terminated=True)
'''


def test_an_environment_is_a_file_and_one_registry_line(tmp_path, monkeypatch):
    from rlkit import tiny
    from rlkit.engines.hf import HFEngine
    from rlkit.envs import registry
    from rlkit.envs.registry import get_env
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes

    _module(tmp_path, monkeypatch, "toyenv", TOY_ENV)
    by_file = get_env(f"{tmp_path / 'toyenv.py'}:Again")
    monkeypatch.setitem(registry.ENVS, "again", "toyenv:Again")
    by_name = get_env("again")
    assert by_file.name == by_name.name == "Again" and by_name.spec == "again"
    assert by_name.fingerprint == "builtin:again"

    tok = tiny.build_tokenizer()  # the embedded model, untrained and small: what it writes does not matter here
    eng = HFEngine(tiny.build_model(tiny.TinyConfig(layers=1, hidden=32, heads=4, intermediate=64), tok, seed=0), tok)
    texts = ["1+2=", "3+4="]
    prompts = Prompts(0, ["p0", "p1"], ["3", "7"], texts, [tok(t)["input_ids"] for t in texts])
    obs = tok(" again:", add_special_tokens=False)["input_ids"]
    for env in (by_file, by_name):
        cols = run_episodes(eng, tok, env, prompts, Sampling(n=2, max_new_tokens=3, max_turns=4), seed=1).columns
        assert cols["reward/env"] == [1.25] * 4 and cols["turns"] == [2] * 4 and cols["terminated"] == [True] * 4
        assert cols["turn_rewards"] == [[0.25, 1.0]] * 4
        for ids, mask in zip(cols["completion_ids"], cols["loss_mask"], strict=True):
            k = mask.index(0)  # the observation's tokens follow the first turn's, off the loss
            assert ids[k:k + len(obs)] == obs and mask[k:k + len(obs)] == [0] * len(obs)
            assert sum(mask) == len(ids) - len(obs)


# -- a tool-call format: its parser and one CALL_FORMATS entry ------------------------------------------------------

def _parse_brackets(inner: str):
    """`[[NAME ARG]]`: a tool name and one integer argument."""
    from rlkit.envs.tools import Call

    name, _, arg = inner.strip().partition(" ")
    if not arg.strip().lstrip("-").isdigit():
        return Call(name or None, error=f"{inner.strip()!r}: expected [[NAME INTEGER]]")
    return Call(name, (int(arg),))


def double(x: int) -> int:
    """Twice x.

    Args:
        x: a number
    """
    return 2 * x


def test_a_tool_call_format_is_its_parser_and_one_registry_entry(monkeypatch):
    from rlkit.envs import tools
    from rlkit.envs.base import Step
    from rlkit.envs.tools import CALL_FORMATS, Call, CallFormat, Tools, parse_call
    from rlkit.tasks.base import Example

    builtin_stop = tuple(f.close for f in CALL_FORMATS.values())
    monkeypatch.setitem(CALL_FORMATS, "brackets", CallFormat("[[", "]]", _parse_brackets))
    assert parse_call("I will ask. [[double 21]] then answer") == Call("double", (21,))
    assert parse_call("[[double many]]").error == "'double many': expected [[NAME INTEGER]]"
    # the first call of a turn counts, whatever its format
    assert parse_call("<call>double(1)</call> [[double 2]]") == Call("double", (1,))
    assert parse_call("[[double 2]] <call>double(1)</call>") == Call("double", (2,))

    env = Tools(functions=[double])
    assert env.reset(Example("p0", "Twice 21?", "42", "train")) == "Twice 21?"
    assert env.step("[[double 21]]") == Step([{"role": "tool", "content": "42"}], 0.0) and env.tool_calls == 1
    assert env.step("[[double x]]").observation[0]["content"].startswith("error: ")  # the parser's error, observed
    assert env.step("42") == Step(None, 0.0, terminated=True)  # no call of any format: the final answer
    # `Tools.stop` (a turn ends at a closing tag) is read off CALL_FORMATS when the class is made: a format's line in
    # rlkit/envs/tools.py is in it; this toy, added after the import, ends no turn (its calls are still read)
    assert tools.Tools.stop == builtin_stop and "]]" not in Tools.stop


# -- a scorer: a Scorer subclass, run by score-ref's own scoring loop ----------------------------------------------

TOY_SCORER = '''
import pyarrow as pa

from rlkit.scorers.base import Scorer


class Length(Scorer):
    """reward/len: the completion's length in characters."""

    name = "len"
    column = "reward/len"
    what = said = "the completion's length"
    kind = "length scorer"

    def manifest_entry(self):
        return {"reward_fns": {"len": "the completion's length"}}

    def score(self, rows):
        texts = rows.batch.column("completion").to_pylist()
        return {self.column: pa.array([float(len(t)) for t in texts], pa.float64())}
'''


def test_a_scorer_is_a_class_scored_by_score_refs_own_loop(tmp_path, monkeypatch, toy_engine):
    from rlkit.errors import RlkitError
    from rlkit.io import streams
    from rlkit.stages import rollout, score_ref

    rollouts = rollout.run(rollout.RolloutConfig(policy=toy_engine, out=tmp_path / "r.arrow", engine="toy",
                                                 num_prompts=2, n=2, max_new_tokens=4))  # "7", "77" per prompt
    _module(tmp_path, monkeypatch, "toyscorer", TOY_SCORER)
    from toyscorer import Length

    out = tmp_path / "s.arrow"
    cfg = score_ref.ScoreRefConfig(inp=str(rollouts), out=out)
    reader = streams.open_table(str(rollouts), ["rollouts", "scored", "prefs"]).result()
    # what `_run_loaded` does with `from_options`' list (where the scorer's one line goes)
    assert score_ref._score(cfg, [Length()], reader, out, None, {}) == out
    table, r = streams.read_table(out, ["rollouts"])
    assert table.column("reward/len").to_pylist() == [1.0, 2.0, 1.0, 2.0]
    assert table.column("completion").to_pylist() == ["7", "77", "7", "77"]
    assert r.manifest["reward_fns"] == {"len": "the completion's length"} and r.manifest["command"] == "score-ref"
    # the rules every scorer shares come with it: an input that has its column already is refused
    again = streams.open_table(str(out), ["rollouts", "scored", "prefs"]).result()
    with pytest.raises(RlkitError, match="the input already has reward component 'len'; name this length scorer"):
        score_ref._score(score_ref.ScoreRefConfig(inp=str(out), out=tmp_path / "t.arrow"), [Length()], again,
                         tmp_path / "t.arrow", None, {})

