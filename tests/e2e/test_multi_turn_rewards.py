"""A multi-turn reward is exactly what was asked (`rollout --env`, then `score-ref` and `update`), on the real tiny
model, real Arrow tables and the real CLI: the reward's composition with and without `--task` (and with `--prompts
FILE`), an errored trajectory's components all 0, `token_rewards` at each turn's last sampled token and counted
once, what each scorer reads of a trajectory (`--reads`), and reward functions that read the environment instances.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rlkit.io import manifests, streams

from conftest import one_error_line, run_cli_inproc

pytestmark = pytest.mark.slow

ENVS = '''
from rlkit.envs.base import Step


class Echo:
    """Three model turns: rewards 0.25, 0.25, then 1.0 (terminated); `fail=PROMPT_ID`: that prompt's trajectories
    raise at their second step."""

    def __init__(self, fail: str = ""):
        self.fail = fail

    def reset(self, example):
        self.turn, self.prompt_id = 0, example.prompt_id
        return example.prompt

    def step(self, action):
        self.turn += 1
        if self.turn == 2 and self.prompt_id == self.fail:
            raise ValueError("no such move")
        if self.turn >= 3:
            return Step(None, 1.0, terminated=True)
        return Step(" more=", 0.25)


class Counter:
    """A TRL environment class (reset(**row), no step; its public methods the tools, its reward an attribute)."""

    def reset(self, **kwargs):
        self.reward, self.bumps = 0.5, 0

    def bump(self) -> str:
        """Count one."""
        self.bumps += 1
        return str(self.bumps)
'''

FNS = '''
def one(completion):
    return 1.0


def length(completion):
    return float(len(completion))


def turns_seen(environments, **kwargs):  # TRL's reward_funcs(..., environments=)
    return [float(e.turn) for e in environments]


def trl_style(completions, **kwargs):  # TRL's functions read the instances from kwargs
    return [float(e.turn) * 10 for e in kwargs["environments"]]


def trl_class(environments):  # the user's own TRL class instance, not rlkit's adapter around it
    return [float(type(e).__name__ == "Counter") + e.reward for e in environments]
'''
P, N = 3, 2


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mtr")
    (d / "envs.py").write_text(ENVS)
    (d / "fns.py").write_text(FNS)
    return d


@pytest.fixture(scope="module")
def rm_dir(sft_dir, tmp_path_factory) -> Path:
    """A reward model trained on a few written pairs (a right sum over a wrong one): a real one, not a good one."""
    import pyarrow as pa

    d = tmp_path_factory.mktemp("rm")
    rows = [{"prompt_id": f"p{i}", "prompt": f"<{i}+1>=", "chosen": str(i + 1), "rejected": str(i + 7),
             "split": "heldout" if i % 4 == 0 else "train"} for i in range(16)]
    with pa.OSFile(str(d / "prefs.arrow"), "wb") as f, pa.ipc.new_stream(f, pa.Table.from_pylist(rows).schema) as w:
        w.write_table(pa.Table.from_pylist(rows))
    r = run_cli_inproc("train-rm", "--model", str(sft_dir), "--prefs", str(d / "prefs.arrow"), "--epochs", "1",
                       "--out", str(d / "rm"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return d / "rm"


def _rollout(sft_dir: Path, out: Path, *args: str):
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--num-prompts", str(P), "--n", str(N), "--out",
                       str(out), *args)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    table, _ = streams.read_table(out, ["rollouts"])
    return table, manifests.read_manifest(out), r.stderr.decode()


def _rewards(table) -> list[str]:
    return [c for c in table.column_names if c.startswith("reward/")]


def test_the_reward_is_the_environments_unless_a_task_is_named(sft_dir, files, tmp_path):
    """Without --task (arithmetic's prompts, or --prompts FILE with gold answers) the environment's rewards alone
    are the reward; --task NAME adds its verifier. The composition is said on stderr and in the manifest."""
    env = f"{files / 'envs.py'}:Echo"
    t, m, err = _rollout(sft_dir, tmp_path / "a.arrow", "--env", env)
    assert _rewards(t) == ["reward/env"] and set(t.column("reward/env").to_pylist()) == {1.5}
    assert m["reward"]["composition"] == "env" and m["config"]["task"] is None
    assert "rollout: reward = env (on task arithmetic's prompts; --task NAME adds that task's verifier)" in err

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"<{i}+1>=", "answer": str(i + 1)}) + "\n" for i in range(P)))
    t, m, err = _rollout(sft_dir, tmp_path / "f.arrow", "--env", env, "--prompts", str(prompts))
    assert _rewards(t) == ["reward/env"] and m["reward"]["composition"] == "env"
    assert f"rollout: reward = env (on --prompts {prompts};" in err

    t, m, err = _rollout(sft_dir, tmp_path / "b.arrow", "--env", env, "--task", "arithmetic")
    assert _rewards(t) == ["reward/env", "reward/verifier"]
    assert m["reward"] == {"composition": "env + verifier (task arithmetic)", "reads": {"verifier": "final"},
                           "token_rewards": "env"}
    assert m["config"]["task"].startswith("arithmetic:")
    assert "rollout: reward = env + verifier (task arithmetic); verifier reads the final model turn" in err


def test_an_errored_trajectory_has_every_component_0(sft_dir, files, rm_dir, tmp_path):
    """--env-errors end: the trajectories of the failing prompt have reward/env, the verifier's, each reward
    function's and reward model's (at rollout and at score-ref) and every token reward 0, with their end_reason;
    the others are scored."""
    from rlkit.tasks import get_task

    fail = get_task("arithmetic").examples("train", P, 0)[1].prompt_id
    t, _, _ = _rollout(sft_dir, tmp_path / "r.arrow", "--env", f"{files / 'envs.py'}:Echo:fail={fail}",
                       "--env-errors", "end", "--task", "arithmetic", "--reward-fn", f"one={files / 'fns.py'}:one")
    rows = t.to_pylist()
    bad = [r for r in rows if r["prompt_id"] == fail]
    assert len(bad) == N and all(r["end_reason"].startswith("error: step raised ValueError") for r in bad)
    for r in bad:
        assert r["reward/env"] == r["reward/verifier"] == r["reward/one"] == 0.0
        assert r["token_rewards"] == [0.0] * len(r["completion_ids"])
    assert all(r["reward/one"] == 1.0 and r["reward/env"] == 1.5 for r in rows if r["prompt_id"] != fail)

    scored = tmp_path / "s.arrow"
    r = run_cli_inproc("score-ref", "--in", str(tmp_path / "r.arrow"), "--reward-fn", f"two={files / 'fns.py'}:one",
                       "--rm", f"q={rm_dir}", "--out", str(scored))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    s, _ = streams.read_table(scored, ["rollouts"])
    assert s.column("reward/two").to_pylist() == [0.0 if x["prompt_id"] == fail else 1.0 for x in rows]
    rm = s.column("reward/rm:q").to_pylist()
    assert [v for v, x in zip(rm, rows, strict=True) if x["prompt_id"] == fail] == [0.0] * N
    assert all(v != 0.0 for v, x in zip(rm, rows, strict=True) if x["prompt_id"] != fail)


def _turn_ends(mask: list[int]) -> list[int]:
    """The last index of each run of 1s (a model turn) in a loss_mask."""
    return [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]


def test_token_rewards_sit_at_turn_ends_and_count_once(sft_dir, files, tmp_path):
    """Each step's reward at its turn's last sampled token, their sum reward/env, marked as its share; through
    score-ref unchanged; update (GRPO's sequence reward, PPO's per-token rewards) counts them once."""
    import torch

    from rlkit.algorithms.inputs import build_batch
    from rlkit.io.schemas import token_rewards_part_of
    from rlkit.ops.gae import kl_penalised_token_rewards

    t, _, _ = _rollout(sft_dir, tmp_path / "r.arrow", "--env", f"{files / 'envs.py'}:Echo")
    assert token_rewards_part_of(t.schema) == "env"
    for row in t.to_pylist():
        placed = [(i, v) for i, v in enumerate(row["token_rewards"]) if v]
        assert [i for i, _ in placed] == _turn_ends(row["loss_mask"]) and len(placed) == row["turns"] == 3
        assert [v for _, v in placed] == row["turn_rewards"] == [0.25, 0.25, 1.0]
        assert sum(row["token_rewards"]) == row["reward/env"] == 1.5

    scored = tmp_path / "s.arrow"
    r = run_cli_inproc("score-ref", "--in", str(tmp_path / "r.arrow"), "--reward-fn", f"one={files / 'fns.py'}:one",
                       "--out", str(scored))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    s, _ = streams.read_table(scored, ["rollouts"])
    assert token_rewards_part_of(s.schema) == "env" and s.column("token_rewards") == t.column("token_rewards")

    batch, used = build_batch(s, pad_id=0)
    assert used == {"env": 1.0, "one": 1.0}  # no `token_rewards` component beside env
    assert batch.rewards.tolist() == [2.5] * s.num_rows
    batch, used = build_batch(s, pad_id=0, weights={"env": 2.0})
    per_token = kl_penalised_token_rewards(batch.rewards, torch.zeros_like(batch.old_logp), batch.mask, 0.0,
                                           batch.token_rewards)
    for i, row in enumerate(s.to_pylist()):  # PPO: each turn credited at its end, the row summing to 2 x 1.5
        ends = _turn_ends(row["loss_mask"])
        got = per_token[i, : len(row["loss_mask"])]
        assert [i for i, v in enumerate(got.tolist()) if v] == ends
        assert got[ends].tolist() == pytest.approx([0.5, 0.5, 2.0]) and float(got.sum()) == pytest.approx(3.0)

    out = tmp_path / "u"
    metrics = tmp_path / "m.jsonl"
    r = run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(scored), "--beta", "0", "--out", str(out),
                       "--metrics", str(metrics))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    row = json.loads(metrics.read_text().splitlines()[-1])
    assert row["reward_mean"] == pytest.approx(2.5) and "reward/token_rewards" not in row
    assert "update: reward = 1*env + 1*one" in r.stderr.decode()


def test_each_scorer_reads_its_documented_text(sft_dir, files, rm_dir, tmp_path):
    """The same function under three readings (--reads): the final model turn, the row's model turns, the whole
    conversation (the default); rollout and score-ref give it the same text, and the manifests record it; a reward
    model reads the prompt and its reading's text."""
    fn = f"{files / 'fns.py'}:length"
    args = [a for name in ("conv", "fin", "mod") for a in ("--reward-fn", f"{name}={fn}")]
    t, m, err = _rollout(sft_dir, tmp_path / "r.arrow", "--env", f"{files / 'envs.py'}:Echo", *args,
                         "--reads", "fin=final", "--reads", "mod=model")
    assert m["reward"]["reads"] == {"conv": "conversation", "fin": "final", "mod": "model"}
    assert "conv reads the whole conversation, fin reads the final model turn, mod reads the model's turns" in err
    for row in t.to_pylist():
        said = [x["content"] for x in row["messages"] if x["role"] == "assistant"]
        assert len(said) == 3
        assert row["reward/conv"] == len(row["completion"])  # the environment's " more=" included
        assert row["reward/fin"] == len(said[-1]) and row["reward/mod"] == len("".join(said))
    assert any(row["reward/mod"] < row["reward/conv"] for row in t.to_pylist())

    scored = tmp_path / "s.arrow"
    args = [a for name in ("conv2", "fin2", "mod2") for a in ("--reward-fn", f"{name}={fn}")]
    r = run_cli_inproc("score-ref", "--in", str(tmp_path / "r.arrow"), *args, "--reads", "fin2=final", "--reads",
                       "mod2=model", "--out", str(scored))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    s, _ = streams.read_table(scored, ["rollouts"])
    for name in ("conv", "fin", "mod"):
        assert s.column(f"reward/{name}2").to_pylist() == t.column(f"reward/{name}").to_pylist()
    assert manifests.read_manifest(scored)["reads"] == {"conv2": "conversation", "fin2": "final", "mod2": "model"}

    from rlkit.scorers.reward_model import load_reward_model, score_texts

    r = run_cli_inproc("score-ref", "--in", str(tmp_path / "r.arrow"), "--rm", f"q={rm_dir}", "--rm", f"c={rm_dir}",
                       "--reads", "rm:q=final", "--out", str(tmp_path / "rm.arrow"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    s, _ = streams.read_table(tmp_path / "rm.arrow", ["rollouts"])
    model, tok = load_reward_model(rm_dir)
    rows = t.to_pylist()
    finals = [[x["content"] for x in row["messages"] if x["role"] == "assistant"][-1] for row in rows]
    prompts = [row["prompt"] for row in rows]
    assert s.column("reward/rm:q").to_pylist() == pytest.approx(score_texts(model, tok, prompts, finals), abs=1e-5)
    assert s.column("reward/rm:c").to_pylist() == pytest.approx(
        score_texts(model, tok, prompts, [row["completion"] for row in rows]), abs=1e-5)

    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{files / 'envs.py'}:Echo", "--reads",
                       "verifier=final", "--out", str(tmp_path / "x.arrow"))
    assert "--reads 'verifier=final': rollout scores no reward component 'verifier' here (it scores: none)" in \
        one_error_line(r)
    r = run_cli_inproc("score-ref", "--in", str(tmp_path / "r.arrow"), "--reward-fn", f"a={fn}", "--reads",
                       "a=first", "--out", str(tmp_path / "y.arrow"))
    assert "'first' is not a reading; expected one of final, model, conversation" in one_error_line(r)
    assert not (tmp_path / "x.arrow").exists() and not (tmp_path / "y.arrow").exists()


def test_reward_functions_read_the_environment_instances(sft_dir, files, tmp_path):
    """`environments` (TRL's reward_funcs(..., environments=)) and TRL's **kwargs get each row's instance as the
    episode left it (a TRL class: the user's own instance); score-ref and rollout without --env refuse such a
    function in one line."""
    fns = files / "fns.py"
    t, _, _ = _rollout(sft_dir, tmp_path / "r.arrow", "--env", f"{files / 'envs.py'}:Echo", "--reward-fn",
                       f"seen={fns}:turns_seen", "--reward-fn", f"trl={fns}:trl_style")
    assert t.column("reward/seen").to_pylist() == [3.0] * P * N
    assert t.column("reward/trl").to_pylist() == [30.0] * P * N

    t, _, _ = _rollout(sft_dir, tmp_path / "c.arrow", "--env", f"{files / 'envs.py'}:Counter", "--max-turns", "1",
                       "--reward-fn", f"cls={fns}:trl_class")
    assert t.column("reward/cls").to_pylist() == [1.5] * P * N

    for args in (("score-ref", "--in", str(tmp_path / "r.arrow")), ("rollout", "--policy", str(sft_dir))):
        r = run_cli_inproc(*args, "--reward-fn", f"seen={fns}:turns_seen", "--out", str(tmp_path / "x.arrow"))
        assert "takes the trajectories' environment instances (environment/environments), which exist only while " \
               "`rollout --env` runs" in one_error_line(r)
        assert r.returncode == 2 and not (tmp_path / "x.arrow").exists()


def test_sft_on_tool_transcripts_trains_on_the_models_tokens_only(sft_dir, tmp_path):
    """`sft --task calc`: one optimizer step over 8 transcripts, whose loss is the starting model's mean NLL over
    the model's tokens (the call, the answer, eos) and not over the tool's result, which a rollout appends
    (loss_mask 0)."""
    from rlkit.io import checkpoints
    from rlkit.tasks import get_task

    out = tmp_path / "c"
    r = run_cli_inproc("sft", "--model", str(sft_dir), "--task", "calc", "--num-examples", "8", "--batch-tokens",
                       "4096", "--eval-num", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    got = manifests.read_manifest(out)["metrics"]
    assert got["steps"] == 1 and got["examples"] == 8
    model, tok = checkpoints.load_policy(sft_dir)
    nll = {True: [], False: []}  # per completion token, by whether the model wrote it
    task = get_task("calc")
    for ex in task.examples("train", 8, 0):
        call, result, answer = re.fullmatch(r"(<call>.*</call>)(<tool>\d+</tool>)(\d+)", task.completion(ex)).groups()
        prompt = tok(ex.prompt)["input_ids"]
        parts = [(tok(t, add_special_tokens=False)["input_ids"], w) for t, w in ((call, 1), (result, 0), (answer, 1))]
        comp = [(t, w) for ids, w in parts for t in ids] + [(tok.eos_token_id, True)]
        seq = torch.tensor([prompt + [t for t, _ in comp]])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0].double(), -1)
        for i, (t, w) in enumerate(comp):
            nll[w].append(-float(logp[len(prompt) + i - 1, t]))
    assert nll[False]  # the tool results
    want = sum(nll[True]) / len(nll[True])
    unmasked = (sum(nll[True]) + sum(nll[False])) / (len(nll[True]) + len(nll[False]))
    assert got["train_loss"] == pytest.approx(want, rel=1e-4) and abs(unmasked - want) > 1e-2
