"""`rlkit sft --data ROLLOUTS --min-reward R [--best-of]` (rejection-sampling SFT) on rollouts the real tiny policy
sampled: the rows kept are the table's that reach R (one a group with --best-of), trained on as the token ids they
were sampled as, a multi-turn row with its loss_mask; the checkpoint names the table as its input; bad input is one
line, exit 2, nothing at --out."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlkit.io import checkpoints, fingerprints, manifests, streams

from conftest import one_error_line, run_cli, run_cli_inproc, stage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rollouts(sft_dir, tmp_path_factory):
    """16 prompts x 4 completions of the arithmetic task, sampled by the session's tiny SFT policy."""
    out = tmp_path_factory.mktemp("rejection") / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "16", "--n", "4", "--max-new-tokens", "8", "--seed", "1",
          "--out", str(out))
    return out


def _rows(path):
    return streams.read_table(path, ["rollouts", "scored"])[0].to_pylist()


def _manifest(d):
    return json.loads((d / "rlkit.json").read_text())


def test_min_reward_trains_on_the_rows_that_reach_it(sft_dir, rollouts, tmp_path):
    rows = _rows(rollouts)
    reaching = [r for r in rows if r["reward/verifier"] >= 1]
    assert 0 < len(reaching) < len(rows)  # the filter has something to keep and something to drop
    out = tmp_path / "rs"
    r = run_cli("sft", "--model", str(sft_dir), "--data", str(rollouts), "--min-reward", "1", "--lr", "1e-4",
                "--eval-num", "10", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert f"{len(reaching)} of {len(rows)} completions kept" in r.stderr.decode()
    m = _manifest(out)
    got = m["metrics"]
    assert (got["rows_read"], got["rows_kept"], got["examples"]) == (len(rows), len(reaching), len(reaching))
    assert got["groups_kept"] == len({r["group_id"] for r in reaching}) and got["groups_read"] == 16
    assert got["min_reward"] == 1.0 and got["best_of"] is False and got["reward_mean_kept"] == 1.0
    # lineage: the table is the input; the held-out evaluation ran on the task the rollout sampled
    assert m["inputs"]["data"] == fingerprints.fingerprint(rollouts)
    assert m["inputs"]["model"] == fingerprints.fingerprint(sft_dir)
    assert m["config"]["task"] == manifests.read_manifest(rollouts)["config"]["task"]
    assert got["heldout_n"] == 10 and m["reward_weights"] == {"verifier": 1.0}
    # it trained: from the policy's weights, not a fresh model
    before = checkpoints.load_weights(sft_dir)
    after = checkpoints.load_weights(out)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert max(float((before[k] - after[k]).abs().max()) for k in before) < 0.05


def test_the_training_rows_are_the_sampled_token_ids(sft_dir, rollouts):
    """No re-tokenising: each kept row is its prompt_ids + completion_ids, the prompt its first len(prompt_ids)."""
    from rlkit.algorithms.inputs import Limits
    from rlkit.training import rejection

    table, _ = streams.read_table(rollouts, ["rollouts"])
    model, _ = checkpoints.load_policy(sft_dir)
    kept = rejection.reject(table, min_reward=1.0, best_of=False, weights=None, label="r")
    ids, plens, masks = rejection.training_rows(table, kept, 256, Limits.of(model), "r")
    rows = table.to_pylist()
    assert kept.rows == [i for i, r in enumerate(rows) if r["reward/verifier"] >= 1]
    assert ids == [rows[i]["prompt_ids"] + rows[i]["completion_ids"] for i in kept.rows]
    assert plens == [len(rows[i]["prompt_ids"]) for i in kept.rows] and masks is None


def test_best_of_keeps_one_completion_a_group(sft_dir, rollouts, tmp_path):
    rows = _rows(rollouts)
    stage("sft", "--model", str(sft_dir), "--data", str(rollouts), "--best-of", "--min-reward", "1", "--lr", "1e-5",
          "--eval-num", "5", "--out", str(tmp_path / "b1"))
    got = _manifest(tmp_path / "b1")["metrics"]
    groups = {r["group_id"] for r in rows if r["reward/verifier"] >= 1}
    assert got["rows_kept"] == got["groups_kept"] == len(groups) and got["best_of"] is True
    # --best-of alone: every group's best, whatever its reward (RAFT)
    stage("sft", "--model", str(sft_dir), "--data", str(rollouts), "--best-of", "--lr", "1e-5", "--eval-num", "5",
          "--out", str(tmp_path / "b0"))
    got = _manifest(tmp_path / "b0")["metrics"]
    assert got["rows_kept"] == got["groups_kept"] == 16 and got["min_reward"] is None


def test_a_multi_turn_table_keeps_its_loss_mask(sft_dir, tmp_path):
    """Trajectories against `guess`: the environment's feedback lines are in the rows (loss_mask 0), and sft trains on
    them with those masks (its objective leaves them out: tests/unit/test_rejection.py)."""
    from rlkit.algorithms.inputs import Limits
    from rlkit.training import rejection

    g = tmp_path / "g.arrow"
    stage("rollout", "--policy", str(sft_dir), "--env", "guess", "--num-prompts", "3", "--n", "2", "--max-turns", "3",
          "--out", str(g))
    table, _ = streams.read_table(g, ["rollouts"])
    rows = table.to_pylist()
    assert any(0 in r["loss_mask"] for r in rows)
    kept = rejection.reject(table, min_reward=0.0, best_of=False, weights=None, label="g")
    model, _ = checkpoints.load_policy(sft_dir)
    ids, plens, masks = rejection.training_rows(table, kept, 256, Limits.of(model), "g")
    assert kept.rows == list(range(len(rows)))
    assert masks == [r["loss_mask"] for r in rows]
    assert ids == [r["prompt_ids"] + r["completion_ids"] for r in rows]
    out = tmp_path / "gs"
    r = run_cli_inproc("sft", "--model", str(sft_dir), "--data", str(g), "--min-reward", "0", "--lr", "1e-5",
                       "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert "no held-out evaluation: the rollouts' prompts came from env:guess" in r.stderr.decode()
    assert _manifest(out)["metrics"]["rows_kept"] == len(rows)


def test_bad_input_is_one_line_and_nothing_is_written(sft_dir, rollouts, tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    # a rollouts table without a reward column: prompts without gold answers, so no verifier scores them
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"<{i}+1>="}) + "\n" for i in range(2)))
    bare = tmp_path / "bare.arrow"
    stage("rollout", "--policy", str(sft_dir), "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "4",
          "--out", str(bare))
    # a model whose tokenizer maps ids to other text (two tokens swapped; the weights intact)
    other = tmp_path / "other"
    shutil.copytree(sft_dir, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    best = max(r["reward/verifier"] for r in _rows(rollouts))
    data = ("--data", str(rollouts))
    cases = [
        ((("--min-reward", "1")), "--min-reward/--best-of filter a rollouts or scored table"),
        (("--data", str(text), "--best-of"), f"--data {text} is not one"),
        (data, "is a 'rollouts' table: sft trains on its completions through a reward filter"),
        (("--data", str(bare), "--min-reward", "0"), "has no reward/<component> columns"),
        ((*data, "--min-reward", "2"), f"no completion reaches --min-reward 2 (best reward {best:g})"),
        ((*data, "--min-reward", "1", "--model", str(other)), "has a different tokenizer from the one that sampled"),
        ((*data, "--min-reward", "1", "--max-length", "6"), "more than --max-length 6; sft trains on a kept completion "
                                                            "whole, never cut: raise --max-length to"),
        ((*data, "--min-reward", "1", "--reward", "rm=1"), "--reward names ['rm']"),
    ]
    for args, want in cases:
        out = tmp_path / "out"
        r = run_cli_inproc("sft", "--eval-num", "5", *args, "--out", str(out))
        assert r.returncode == 2, (args, r.stderr.decode())
        assert want in one_error_line(r), (args, r.stderr.decode())
        assert not out.exists(), args
    # the same as a process of its own: exit 2, one line, no traceback
    r = run_cli("sft", *data, "--min-reward", "2", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "no completion reaches" in one_error_line(r) and not (tmp_path / "out").exists()
