"""`rlkit inspect` and `rlkit report` on multi-turn rollouts: trajectories sampled by `rlkit.sampling.run_episodes`
from the tiny policy against a toy environment, written with the real table writer; single-turn tables show what
they always showed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli_inproc, stage

TOY_ENV = '''
from rlkit.envs import Step


class Feedback:
    """A calculator-ish toy: each turn gets a tool result back; prompts answered "stop" end after two turns,
    the others run into --max-turns."""

    def reset(self, example):
        self.answer, self.n, self.tool_calls = example.answer, 0, 0
        return example.prompt

    def step(self, action):
        self.n += 1
        reward = 1.0 if any(c.isdigit() for c in action) else 0.25
        if self.answer == "stop" and self.n >= 2:
            return Step(None, reward, terminated=True)
        self.tool_calls += 1
        return Step(f"<tool>{7 * self.n}</tool>", reward)
'''

PROMPTS = (("p0", "12+3=", "stop"), ("p1", "7*8=", "go on"))


def _write(path: Path, cols: dict, multi_turn: bool, config: dict | None = None, **recorded) -> Path:
    """A rollouts table through rlkit's own writer: the multi-turn columns as extra fields (absent: single-turn);
    `config` and `recorded` (e.g. the tokenizer's fingerprint) as the manifest records a rollout's."""
    import pyarrow as pa

    from rlkit.io import manifests, schemas, streams

    n = len(cols["prompt_id"])
    columns = {**{k: cols[k] for k in ("prompt_id", "sample_idx", "prompt", "prompt_ids", "completion_ids",
                                       "old_logprobs", "finish_reason", "reward/env")},
               "completion": cols["completion"], "group_id": [int(p[1:]) for p in cols["prompt_id"]],
               "policy_fingerprint": ["sha256:toy"] * n, "policy_step": [0] * n}
    extra = [pa.field("reward/env", pa.float64())]
    if multi_turn:
        extra += list(schemas.MULTI_TURN_FIELDS)
        columns.update({f.name: cols[f.name] for f in schemas.MULTI_TURN_FIELDS})
    manifest = manifests.make_manifest("rollouts", "rollout", config or {"env": "toy.py:Feedback"}, {}, **recorded)
    with streams.write_table("rollouts", path, manifest, extra) as w:
        w.write(columns)
    return path


@pytest.fixture(scope="module")
def episodes(sft_dir, tmp_path_factory):
    """Four trajectories (two prompts x 2) from the tiny SFT policy against the toy environment, max 3 turns."""
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.envs import get_env
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes

    d = tmp_path_factory.mktemp("mt")
    (d / "toy.py").write_text(TOY_ENV)
    eng = engines.create("hf", sft_dir, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    ids, texts, answers = zip(*PROMPTS, strict=True)
    prompts = Prompts(0, list(ids), list(answers), list(texts), [tok(t)["input_ids"] for t in texts])
    ep = run_episodes(eng, tok, get_env(f"{d / 'toy.py'}:Feedback"), prompts,
                      Sampling(n=2, max_new_tokens=8, max_turns=3), seed=3)
    cols = dict(ep.columns)
    cols["completion"] = [tok.decode(c, skip_special_tokens=True) for c in cols["completion_ids"]]
    return d, cols


def test_inspect_shows_a_multi_turn_tables_figures_and_conversations(episodes):
    d, cols = episodes
    assert sorted(cols["end_reason"]) == ["max_turns", "max_turns", "terminated", "terminated"]
    assert any(0 in m for m in cols["loss_mask"]) and any(1 in m for m in cols["loss_mask"])
    table = _write(d / "mt.arrow", cols, multi_turn=True)

    info = json.loads(run_cli_inproc("inspect", str(table), "--json").stdout)
    fig = info["multi_turn"]
    n = len(cols["prompt_id"])
    sampled = [sum(m) for m in cols["loss_mask"]]
    total = sum(len(c) for c in cols["completion_ids"])
    assert fig["trajectories"] == n
    assert fig["mean_turns"] == pytest.approx(sum(cols["turns"]) / n)
    assert fig["mean_tool_calls"] == pytest.approx(sum(cols["tool_calls"]) / n) and fig["mean_tool_calls"] > 0
    assert fig["end_reasons"] == {"max_turns": 2, "terminated": 2}
    assert fig["mean_response_tokens"] == pytest.approx(sum(sampled) / n)  # response length: loss_mask 1 only
    assert fig["mean_response_tokens"] < total / n
    assert fig["mean_environment_tokens"] == pytest.approx((total - sum(sampled)) / n)
    assert fig["environment_token_fraction"] == pytest.approx(1 - sum(sampled) / total)
    assert fig["mean_reward_env"] == pytest.approx(sum(cols["reward/env"]) / n)

    r = run_cli_inproc("inspect", str(table), "--rows", "2", env={"COLUMNS": "160"})
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "multi-turn trajectories" in err
    assert "turns per trajectory (mean)" in err and f"{sum(cols['turns']) / n:.3g}" in err
    assert "end reasons" in err and "max_turns 2" in err and "terminated 2" in err
    assert f"{1 - sum(sampled) / total:.1%}" in err
    assert "first 2 of 4 rows" in err and "schema (4 rows)" in err
    # each shown row: its figures, then its conversation, roles marked (the prompt, the model's turns, the
    # environment's tool results)
    for i in range(2):
        m = cols["loss_mask"][i]
        head = (f"row {i} · prompt {cols['prompt_id'][i]!r} · sample {cols['sample_idx'][i]} · {cols['turns'][i]} "
                f"turns · {cols['tool_calls'][i]} tool call{'' if cols['tool_calls'][i] == 1 else 's'} · ended: "
                f"{cols['end_reason'][i]} · reward/env {cols['reward/env'][i]:g} · tokens: {sum(m)} sampled + "
                f"{len(m) - sum(m)} from the environment")
        assert head in " ".join(err.split())  # a terminal narrower than the line wraps it
        assert f"\n  [user] {cols['prompt'][i]}\n" in err
        said = [x["content"] for x in cols["messages"][i] if x["role"] == "assistant"]
        assert len(said) == cols["turns"][i]
        for text in said:
            assert f"\n  [assistant] {text}\n" in err
    assert "\n  [user, from the environment] <tool>7</tool>\n" in err
    assert "row 2 ·" not in err  # --rows 2


def test_inspect_shows_the_observations_the_model_saw(sft_dir, episodes):
    """With the policy that sampled the table (its manifest names it, and its tokenizer is the one recorded), a row's
    completion is shown decoded from its tokens: the model's turns, and each observation exactly as appended, so one
    that --max-env-tokens cut shows what was kept ("<tool" of "<tool>7</tool>"), marked; without that policy, the
    messages as before, saying why."""
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.envs import get_env
    from rlkit.io import checkpoints
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes

    d, _ = episodes
    eng = engines.create("hf", sft_dir, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    ids, texts, answers = zip(*PROMPTS, strict=True)
    prompts = Prompts(0, list(ids), list(answers), list(texts), [tok(t)["input_ids"] for t in texts])
    cols = dict(run_episodes(eng, tok, get_env(f"{d / 'toy.py'}:Feedback"), prompts,
                             Sampling(n=1, max_new_tokens=8, max_turns=3, max_env_tokens=5), seed=3).columns)
    cols["completion"] = [tok.decode(c, skip_special_tokens=True) for c in cols["completion_ids"]]
    config = {"env": f"{d / 'toy.py'}:Feedback", "policy": str(sft_dir), "max_env_tokens": 5}
    table = _write(d / "cut.arrow", cols, multi_turn=True, config=config,
                   tokenizer=checkpoints.tokenizer_fingerprint(tok))

    err = run_cli_inproc("inspect", str(table), "--rows", "2", env={"COLUMNS": "200"}).stderr.decode()
    assert "\n  [environment, as appended] <tool [cut at 5 tokens]\n" in err, err  # the row records the length
    # a table without each observation's length (an older rollout): the cut is only said to be possible
    nolen = _write(d / "nolen.arrow", {**cols, "observation_tokens": [None] * len(cols["prompt_id"])},
                   multi_turn=True, config=config, tokenizer=checkpoints.tokenizer_fingerprint(tok))
    err = run_cli_inproc("inspect", str(nolen), "--rows", "2", env={"COLUMNS": "200"}).stderr.decode()
    mark = "[5 tokens: --max-env-tokens, it may have been cut at 5 tokens]"
    assert f"[environment, as appended] <tool {mark}" in " ".join(err.split()), err  # however the console wraps
    assert "<tool>7</tool>" not in err  # the environment's own text: not what the model saw
    for i in range(2):
        assert f"\n  [user] {cols['prompt'][i]}\n" in err
        for m in cols["messages"][i]:
            if m["role"] == "assistant":
                assert f"\n  [assistant] {m['content']}\n" in err
    # the policy gone: the messages, and a line saying why
    table = _write(d / "gone.arrow", cols, multi_turn=True, config={**config, "policy": str(d / "gone")},
                   tokenizer=checkpoints.tokenizer_fingerprint(tok))
    err = run_cli_inproc("inspect", str(table), "--rows", "2", env={"COLUMNS": "200"}).stderr.decode()
    flat = " ".join(err.split())  # however the console wraps the line (it names the table's path)
    assert "the policy that sampled them" in flat and "[user, from the environment] <tool>7</tool>" in flat


def test_a_cut_observation_is_marked_where_the_row_records_its_length():
    """Where a row records each observation's tokens before the cut (`observation_tokens`), the mark is exact:
    `[cut at N tokens]` on an observation that lost tokens, none on one that fit."""
    from rlkit.sampling.conversations import Seen as _Seen
    from rlkit.sampling.conversations import conversations as _conversations
    from rlkit.tiny import build_tokenizer

    tok = build_tokenizer()
    turn, obs = tok("12", add_special_tokens=False)["input_ids"], tok("<tool", add_special_tokens=False)["input_ids"]
    row = {"prompt_id": "p0", "sample_idx": 0, "prompt": "7*8=", "completion_ids": turn + obs + turn + obs,
           "loss_mask": [1, 1] + [0] * 5 + [1, 1] + [0] * 5, "observation_tokens": [14, 5],
           "messages": [{"role": "user", "content": "7*8="}]}
    (text,) = _conversations([row], _Seen(tok, 5))
    lines = text.plain.splitlines()
    assert lines[1:] == ["  [user] 7*8=", "  [assistant] 12", "  [environment, as appended] <tool [cut at 5 tokens]",
                         "  [assistant] 12", "  [environment, as appended] <tool"]


def test_single_turn_tables_show_no_multi_turn_figures(episodes):
    d, cols = episodes
    table = _write(d / "single.arrow", cols, multi_turn=False)
    info = json.loads(run_cli_inproc("inspect", str(table), "--json").stdout)
    assert "multi_turn" not in info and "loss_mask" not in info["schema"]
    err = run_cli_inproc("inspect", str(table), env={"COLUMNS": "160"}).stderr.decode()
    assert "multi-turn" not in err and "conversation" not in err and "[assistant]" not in err


def test_figures_count_a_null_loss_mask_row_as_sampled(episodes):
    """A row whose loss_mask is null (a single-turn row among multi-turn ones) counts every token as sampled and
    one turn; a table without multi-turn values has no figures."""
    import pyarrow as pa

    from rlkit.io.trajectories import figures as multi_turn_figures

    _, cols = episodes
    masks = [None, *cols["loss_mask"][1:]]
    t = pa.table({"completion_ids": pa.array(cols["completion_ids"], pa.list_(pa.int32())),
                  "loss_mask": pa.array(masks, pa.list_(pa.int8())), "turns": [None, *cols["turns"][1:]]})
    fig = multi_turn_figures(t)
    sampled = len(cols["completion_ids"][0]) + sum(sum(m) for m in masks[1:])
    assert fig["trajectories"] == 4 and fig["mean_response_tokens"] == pytest.approx(sampled / 4)
    assert fig["mean_turns"] == pytest.approx((1 + sum(cols["turns"][1:])) / 4)
    assert fig["mean_tool_calls"] is None and fig["mean_reward_env"] is None and "end_reasons" not in fig
    assert multi_turn_figures(t.drop_columns(["loss_mask", "turns"])) is None
    assert multi_turn_figures(pa.table({"completion_ids": t["completion_ids"],
                                        "loss_mask": pa.nulls(4, pa.list_(pa.int8()))})) is None


def test_a_trajectory_cut_into_rows_counts_once():
    """A chat template that re-renders history cuts a trajectory into rows (all but its last "continued"): the
    figures are per trajectory (turns and tokens summed over its rows, reward and tool calls from its last)."""
    import pyarrow as pa

    from rlkit.io.trajectories import figures as multi_turn_figures

    t = pa.table({"completion_ids": pa.array([[5, 6, 7, 8], [5, 6], [5, 6, 7]], pa.list_(pa.int32())),
                  "loss_mask": pa.array([[1, 1, 0, 0], [1, 1], [1, 0, 1]], pa.list_(pa.int8())),
                  "turns": pa.array([2, 1, 2], pa.int32()), "tool_calls": pa.array([0, 2, 1], pa.int32()),
                  "end_reason": ["continued", "terminated", "max_turns"], "reward/env": [1.0, 1.0, 0.5]})
    fig = multi_turn_figures(t)
    assert fig["trajectories"] == 2 and fig["continued_rows"] == 1
    assert fig["end_reasons"] == {"max_turns": 1, "terminated": 1}
    assert fig["mean_turns"] == 2.5 and fig["mean_tool_calls"] == 1.5 and fig["mean_reward_env"] == 0.75
    assert fig["mean_response_tokens"] == 3.0 and fig["mean_environment_tokens"] == 1.5
    assert fig["environment_token_fraction"] == pytest.approx(3 / 9)


def _metrics(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_shows_turns_and_tool_calls_per_round(tmp_path):
    from rlkit.stages.report import draw, load_run

    mt = _metrics(tmp_path / "mt.jsonl", [
        {"stage": "update", "step": s, "reward_mean": 0.2 * s, "kl_per_seq": 0.01 * s, "mean_response_tokens": 9.0,
         "mean_turns": 1.5 + s, "mean_tool_calls": 0.5 * s, "environment_token_fraction": 0.4} for s in (1, 2, 3)]
        # eval --env's rows: the held-out trajectories' figures
        + [{"stage": "eval", "step": s, "mean_reward": 0.1 * s, "mean_turns": 2.0, "mean_tool_calls": 1.0} for s in (0, 3)])
    st = _metrics(tmp_path / "st.jsonl", [
        {"stage": "update", "step": s, "reward_mean": 0.1 * s, "kl_per_seq": 0.02 * s} for s in (1, 2)])

    panels = {ax.get_title(): ax for ax in draw([load_run("mt", mt), load_run("st", st)], None).axes
              if ax.get_visible()}
    lines = panels["turns and tool calls per trajectory"].get_lines()
    assert [ln.get_label() for ln in lines] == ["mt: mean_turns", "mt: mean_tool_calls", "mt: held-out mean_turns",
                                                "mt: held-out mean_tool_calls"]
    assert list(lines[2].get_xdata()) == [0, 3] and list(lines[2].get_ydata()) == [2.0, 2.0]
    assert list(lines[0].get_ydata()) == [2.5, 3.5, 4.5] and list(lines[1].get_xdata()) == [1, 2, 3]
    assert "environment tokens" in panels
    (held,) = panels["held-out mean reward (environment)"].get_lines()  # eval --env's mean trajectory reward
    assert held.get_label() == "mt" and list(held.get_ydata()) == pytest.approx([0.0, 0.3])
    assert "held-out accuracy" not in panels
    assert not {"turns and tool calls per trajectory", "environment tokens"} & {
        ax.get_title() for ax in draw([load_run("st", st)], None).axes if ax.get_visible()}

    r = run_cli_inproc("report", str(mt), str(st), "--out", str(tmp_path / "r.html"), env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "tool calls" in err and "2.5 → 4.5" in err and "0.5 → 1.5" in err
    page = (tmp_path / "r.html").read_text()
    assert "<th>held-out mean reward</th><th>turns</th><th>tool calls</th>" in page and "2.5 → 4.5" in page
    assert "0 → 0.3" in page
    # single-turn runs alone: the summary has no multi-turn columns
    r = run_cli_inproc("report", str(st), "--out", str(tmp_path / "s.html"))
    assert r.returncode == 0, r.stderr
    assert "tool calls" not in r.stderr.decode() and "<th>turns</th>" not in (tmp_path / "s.html").read_text()


def test_rollout_env_to_report_shows_turns_per_round(episodes, sft_dir, ref_dir, tmp_path):
    """The pipeline: `rollout --env` -> `score-ref` -> `update --metrics` -> `report`: inspect shows the scored
    table's figures, update records turns and tool calls per trajectory, report draws and tabulates them."""
    from rlkit.io import streams, trajectories
    from rlkit.stages.report import draw, load_run

    d, _ = episodes
    roll, scored, metrics = tmp_path / "roll.arrow", tmp_path / "scored.arrow", tmp_path / "m.jsonl"
    stage("rollout", "--policy", str(sft_dir), "--env", f"{d / 'toy.py'}:Feedback", "--n", "2", "--num-prompts", "3",
          "--max-turns", "3", "--max-new-tokens", "8", "--out", str(roll))
    stage("score-ref", "--ref", str(ref_dir), "--in", str(roll), "--out", str(scored))
    stage("update", "--policy", str(sft_dir), "--in", str(scored), "--out", str(tmp_path / "u1"),
          "--metrics", str(metrics))
    table, _ = streams.read_table(scored, ["scored"])
    fig = trajectories.figures(table)
    assert fig["trajectories"] == 6 and fig["mean_turns"] > 1 and fig["environment_token_fraction"] > 0
    info = json.loads(run_cli_inproc("inspect", str(scored), "--json").stdout)
    assert info["kind"] == "scored" and info["multi_turn"] == fig

    row = json.loads(metrics.read_text().splitlines()[-1])
    assert row["mean_turns"] == fig["mean_turns"] and row["mean_tool_calls"] == fig["mean_tool_calls"]
    assert row["mean_response_tokens"] == pytest.approx(fig["mean_response_tokens"])  # sampled tokens only
    panels = {ax.get_title() for ax in draw([load_run("mt", metrics)], None).axes if ax.get_visible()}
    assert "turns and tool calls per trajectory" in panels
    r = run_cli_inproc("report", str(metrics), "--out", str(tmp_path / "r.png"))
    assert r.returncode == 0, r.stderr
    assert "tool calls" in r.stderr.decode() and f"{fig['mean_turns']:.3g} → {fig['mean_turns']:.3g}" in r.stderr.decode()


DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _doc_example() -> str:
    """The example environment of docs/environments.md, as the page shows it."""
    import re

    blocks = re.findall(r"```python\n(# two_tries\.py.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/environments.md lost its two_tries.py example"
    return blocks[0]


def test_the_docs_example_environment_runs(sft_dir, tmp_path):
    """docs/environments.md's example, loaded from the page and sampled on the tiny policy: through the driver
    (the tokens it appends, the rewards it gives) and through the command line the page shows."""
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.envs import get_env
    from rlkit.io import streams
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes
    from rlkit.tasks import get_task

    src = _doc_example()
    assert len(src.strip().splitlines()) <= 22
    (tmp_path / "two_tries.py").write_text(src)
    env = get_env(f"{tmp_path / 'two_tries.py'}:TwoTries:bonus=2")
    assert env.options == {"bonus": 2.0} and env.attribute("max_new_tokens") == 8
    eng = engines.create("hf", sft_dir, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    exs = get_task("arithmetic").examples("train", 6, seed=0)
    prompts = Prompts(0, [e.prompt_id for e in exs], [e.answer for e in exs], [e.prompt for e in exs],
                      [tok(e.prompt)["input_ids"] for e in exs])
    ep = run_episodes(eng, tok, env, prompts, Sampling(n=2, max_new_tokens=8, max_turns=2), seed=0)
    c = ep.columns
    assert set(c["end_reason"]) == {"terminated"} and set(c["turns"]) <= {1, 2} and 2 in c["turns"]
    for i in range(len(c["turns"])):
        said = [m["content"] for m in c["messages"][i] if m["role"] == "assistant"]
        answer = exs[i // 2].answer
        want = ([2.0] if said[0].strip() == answer else [0.0, 0.5 if said[1].strip() == answer else 0.0])
        assert c["turn_rewards"][i] == want and c["reward/env"][i] == sum(want)
        env_tokens = [t for t, m in zip(c["completion_ids"][i], c["loss_mask"][i], strict=True) if m == 0]
        if c["turns"][i] == 2:  # the feedback, appended as its tokens, off the loss
            assert env_tokens == tok(f"\nwrong, again: {exs[i // 2].prompt}", add_special_tokens=False)["input_ids"]
        else:
            assert env_tokens == []

    out = tmp_path / "tt.arrow"
    stage("rollout", "--policy", str(sft_dir), "--env", f"{tmp_path / 'two_tries.py'}:TwoTries:bonus=2",
          "--max-turns", "2", "--num-prompts", "8", "--out", str(out))
    table, manifest = streams.read_table(out, ["rollouts"])
    assert table.num_rows == 8 * 8 and set(table.column("turns").to_pylist()) <= {1, 2}
    assert "multi-turn trajectories" in run_cli_inproc("inspect", str(out)).stderr.decode()
