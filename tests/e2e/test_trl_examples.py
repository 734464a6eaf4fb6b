"""TRL's own example scripts under `rlkit rollout`, as TRL ships them: examples/scripts/grpo_2048.py's environment
class and its reward function (tests/data/trl/grpo_2048.py: only the trainer setup stripped), on the real tiny model
through the real CLI, and the same class played move by move through rlkit's adapter and scored by the same
function."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlkit.io import streams

from conftest import run_cli, run_cli_inproc

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "trl" / "grpo_2048.py"
SCORE = re.compile(r"score=(\d+(?:\.\d+)?)")


def _prompts(tmp_path: Path, n: int) -> Path:
    """The example's dataset, scaled down: its one PROMPT, n times (TRL's rows carry it as the user message)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_2048_copy", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": mod.PROMPT}) + "\n" for _ in range(n)))
    return path


def _last_score(row: dict) -> float:
    """The game's score as the environment last showed it to the model: reset's text (appended to the prompt), then
    each `move` result (a tool message), each `score=X\\n<board>\\ndone=...`."""
    texts = [row["prompt"], *(m["content"] for m in row["messages"] or () if m["role"] == "tool")]
    return float(SCORE.findall("\n".join(texts))[-1])


def test_the_2048_example_runs_as_trl_ships_it(sft_dir, tmp_path):
    """`--env grpo_2048.py:Game2048Env --reward-fn grpo_2048.py:reward_score`: the class keeps its reward in
    `env.score` (no get_reward(), no reward attribute) and its reward function reads `environments`; each row's
    reward/reward_score is the function's value, the game's score, and reward/env is 0 (counted once)."""
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", f"{EXAMPLE}:Game2048Env", "--reward-fn",
                f"{EXAMPLE}:reward_score", "--prompts", str(_prompts(tmp_path, 2)), "--n", "2", "--max-turns", "2",
                "--max-new-tokens", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = streams.read_table(out, ["rollouts"])[0].to_pylist()
    assert len(rows) == 4
    for row in rows:
        assert re.search(r"Maximize the score\.score=0\.0\n( +\d+ ){3} +\d+\n.*done=False$", row["prompt"], re.S)
        assert row["reward/reward_score"] == _last_score(row)
        assert row["reward/env"] == 0.0


def test_the_2048_reward_is_the_functions_on_the_instances_it_played(tmp_path):
    """The same class and function through rlkit's adapter, moved by real tool calls until the games score: the
    function gets the class's own instances (not rlkit's adapter) and its values are their `score`s; the episode's
    end (a turn without a call) gives reward/env 0."""
    import random

    from rlkit.envs import get_env
    from rlkit.scorers import reward_fns
    from rlkit.tasks import Example

    fn = reward_fns.load(f"{EXAMPLE}:reward_score")
    spec = get_env(f"{EXAMPLE}:Game2048Env").read_by([fn])
    random.seed(0)
    envs = [spec.make() for _ in range(3)]
    for k, env in enumerate(envs):
        assert env.reset(Example(f"p{k}", "Play.", None, "train")).startswith("Play.score=0.0\n")
        for i in range(8 * (k + 1)):
            direction = ("left", "up", "right", "down")[i % 4]
            step = env.step(f'<tool_call>{{"name": "move", "arguments": {{"direction": "{direction}"}}}}</tool_call>')
            assert step.observation[0]["role"] == "tool" and not step.terminated
        end = env.step("done")
        assert end.terminated and end.reward == 0.0
    games = [env.wrapped for env in envs]
    assert {type(g).__name__ for g in games} == {"Game2048Env"}
    scores = [g.score for g in games]
    assert len(set(scores)) > 1 and min(scores) > 0  # merges happened, differently in each game
    cols = {"prompt": ["Play."] * 3, "completion": ["done"] * 3}
    assert fn.score(cols, environments=games) == scores


def test_a_class_without_a_reward_source_says_what_to_add(sft_dir, tmp_path):
    """The 2048 class alone (nothing reads `env.score`): when its first episode ends, one line naming the class and
    the reward sources rlkit reads, exit 2, nothing written."""
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{EXAMPLE}:Game2048Env", "--num-prompts", "1",
                       "--n", "1", "--max-turns", "1", "--max-new-tokens", "4", "--out", str(out))
    err = r.stderr.decode()
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [x for x in lines if x.startswith("rlkit: error:")] == lines[-1:], lines
    line = lines[-1]
    assert "environment Game2048Env has neither get_reward() nor a reward attribute, and no --reward-fn reads its " \
           "instances; add get_reward() or set self.reward, or pass its reward function (TRL's reward_funcs): " \
           "--reward-fn FILE.py:FUNC taking `environments`" in line, line
    assert r.returncode == 2 and not out.exists()


COUNTER = '''
class Counter:
    """TRL's docs' pattern: the episode's reward in `self.reward`, read by the reward function."""

    def reset(self, **kwargs):
        self.reward = 0.5

    def bump(self) -> str:
        """Count one."""
        return "1"


def reward_func(environments, **kwargs):  # TRL's docs: return [env.reward for env in environments]
    return [env.reward for env in environments]


def tokens(completion_ids, **kwargs):  # reads no instance: the completions' token ids, as TRL passes them
    return [float(len(ids)) for ids in completion_ids]
'''


def test_a_reward_attribute_read_by_a_function_counts_once(sft_dir, tmp_path):
    """A class whose `reward` attribute its reward function reads (TRL's docs): the function's column carries it and
    reward/env is 0, so update's sum counts it once, as TRL's; the class alone (or with a function that names no
    instances, here one taking TRL's `completion_ids`) keeps it as reward/env."""
    f = tmp_path / "counter.py"
    f.write_text(COUNTER)
    got, ids = {}, {}
    for name, fns in (("alone", ()), ("text", ("--reward-fn", f"{f}:tokens")), ("read", ("--reward-fn", f"{f}:reward_func"))):
        out = tmp_path / f"{name}.arrow"
        r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{f}:Counter", "--num-prompts", "1", "--n",
                           "2", "--max-turns", "1", "--max-new-tokens", "4", *fns, "--out", str(out))
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        t = streams.read_table(out, ["rollouts"])[0]
        got[name] = {c: t.column(c).to_pylist() for c in t.column_names if c.startswith("reward/")}
        ids[name] = t.column("completion_ids").to_pylist()
    assert got["alone"] == {"reward/env": [0.5, 0.5]}
    assert got["text"] == {"reward/env": [0.5, 0.5], "reward/tokens": [float(len(x)) for x in ids["text"]]}
    assert all(ids["text"])
    assert got["read"] == {"reward/env": [0.0, 0.0], "reward/reward_func": [0.5, 0.5]}


def test_a_function_reading_the_instances_runs_in_the_stage_under_a_sandbox(sft_dir, tmp_path):
    """`--sandbox bwrap`: a function naming `environments` cannot have them in a sandboxed worker, so it runs in the
    stage, and a warning says so; its values are the same."""
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{EXAMPLE}:Game2048Env", "--reward-fn",
                       f"{EXAMPLE}:reward_score", "--sandbox", "bwrap", "--num-prompts", "1", "--n", "2",
                       "--max-turns", "1", "--max-new-tokens", "4", "--out", str(out))
    err = r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    assert "--sandbox bwrap: --reward-fn reward_score (" in err and "takes the trajectories' environment instances, " \
           "which cannot travel to a sandboxed worker: it runs in the stage, as your own code" in err, err[-2000:]
    rows = streams.read_table(out, ["rollouts"])[0].to_pylist()
    assert [row["reward/reward_score"] for row in rows] == [_last_score(row) for row in rows]


MULTI = '''
def wordle_reward(environments, **kwargs):  # TRL's examples/scripts/openenv/multi_env.py, as it ships
    return [env.reward if env.active == "wordle" else None for env in environments]


def long_ones(completions, **kwargs):  # None: a row this function does not score
    return [float(len(c)) if len(c) > 2 else None for c in completions]
'''


def test_none_is_a_row_the_function_does_not_score(tmp_path):
    """TRL's convention for a reward function's list (multi_env.py's functions return None for the other
    environment's rows; TRL leaves them out of its sum): the row's value is 0.0, in the stage and in a sandboxed
    worker alike; a one-row function's None is still an error (a missing return)."""
    from types import SimpleNamespace

    from rlkit.errors import RlkitError
    from rlkit.sandbox import Sandbox
    from rlkit.sandbox.bwrap import bwrap_path
    from rlkit.scorers import reward_fns

    f = tmp_path / "multi.py"
    f.write_text(MULTI + "\n\ndef one(completion):\n    return None\n")
    cols = {"prompt": ["p"] * 3, "completion": ["abcd", "x", "abc"]}
    envs = [SimpleNamespace(active=a, reward=r) for a, r in (("wordle", 1.0), ("catch", 1.0), ("wordle", 0.5))]
    assert reward_fns.load(f"{f}:wordle_reward").score(cols, environments=envs) == [1.0, 0.0, 0.5]
    assert reward_fns.load(f"{f}:long_ones").score(cols) == [4.0, 0.0, 3.0]
    with pytest.raises(RlkitError, match="returned None for row 0; expected a finite number"):
        reward_fns.load(f"{f}:one").score(cols)
    if bwrap_path() is not None:
        with reward_fns.closing(reward_fns.load_all([f"{f}:long_ones"], sandbox=Sandbox("bwrap", workers=1))) as fns:
            assert fns[0].workers is not None and fns[0].score(cols) == [4.0, 0.0, 3.0]


HOOKS = '''
def reward_func(completions, ground_truth=None, log_extra=None, log_metric=None, **kwargs):  # TRL's docs, Example 6
    rewards = [float(len(c) > 0) for c in completions]
    if log_extra:
        log_extra("golden_answer", list(kwargs["answer"]))
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def curriculum(completions, trainer_state, **kwargs):  # TRL's dynamic reward shaping on the training step
    assert callable(kwargs["log_metric"]) and callable(kwargs["log_extra"])  # TRL's **kwargs carry them too
    return [float(trainer_state.global_step) + 0.5 for _ in completions]
'''


def test_trls_trainer_hooks_reach_the_functions(sft_dir, tmp_path):
    """TRL passes every reward function `trainer_state`, `log_extra` and `log_metric`: a function naming them runs
    (the step is the sampling policy's, the metrics' means are said at the end, log_extra's columns are named as not
    kept); in a sandboxed worker, which cannot receive them, one without a default is refused in one line."""
    from rlkit.errors import RlkitError
    from rlkit.sandbox import Sandbox
    from rlkit.scorers import reward_fns

    f = tmp_path / "hooks.py"
    f.write_text(HOOKS)
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--max-new-tokens", "4",
                       "--reward-fn", f"docs={f}:reward_func", "--reward-fn", f"step={f}:curriculum", "--out", str(out))
    err = r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    t = streams.read_table(out, ["rollouts"])[0]
    steps = t.column("policy_step").to_pylist()
    assert t.column("reward/step").to_pylist() == [s + 0.5 for s in steps]
    docs = t.column("reward/docs").to_pylist()
    assert f"rollout: --reward-fn docs logged accuracy {sum(docs) / len(docs):.4g} (each the mean over its calls)" in err
    assert "rollout: --reward-fn docs's log_extra columns golden_answer are not kept" in err
    with pytest.raises(RlkitError, match="takes trainer_state, which a sandboxed worker cannot receive"):
        reward_fns.load(f"{f}:curriculum", sandbox=Sandbox("bwrap"))
    boxed = reward_fns.load(f"{f}:reward_func", sandbox=Sandbox("bwrap"))  # its defaults stand in for them there
    assert boxed.workers is not None and boxed.hooks == ("log_metric", "log_extra")
    boxed.close()
