"""DAPO's dynamic sampling (`rollout --min-informative-groups K`) on the real tiny model: only groups whose rewards
differ are written, sampling goes on past --num-prompts until K of them are, within --max-refill-rounds, the
first round's rows are those a plain rollout of the same seed samples and later chunks only the groups still
missing, and `prompts_drawn` counts what was sampled for the groups kept; under --follow each batch is K groups,
which `update --follow` takes as its steps."""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict

import pytest

from rlkit.io import streams

from conftest import fast_rlkit_cmd, one_error_line, run_cli_inproc, stage

pytestmark = pytest.mark.slow

# a user reward with variety inside a group: the completion's length parity (the tiny test policy is rarely right)
PARITY = "def parity(completion, row):\n    return float(len(completion) % 2)\n"


def _groups(path):
    t, _ = streams.read_table(path, ["rollouts", "scored"])
    rows = t.to_pylist()
    by = defaultdict(list)
    for r in rows:
        by[r["group_id"]].append(r)
    return rows, by


def _total(r):
    return sum(v for k, v in r.items() if k.startswith("reward/"))


def test_refill_samples_only_the_groups_missing_and_counts_what_it_sampled(sft_dir, tmp_path):
    """The first round's rows are a plain rollout's of --num-prompts at the same seed; after it, only as many prompts
    as groups are missing are sampled (no tail), and a first round with more informative groups than K drops the
    rest of its chunk, outside every `prompts_drawn` and update's `prompts_sampled`."""
    (tmp_path / "rw.py").write_text(PARITY)
    fn = ("--reward-fn", f"parity={tmp_path}/rw.py:parity", "--max-new-tokens", "6", "--seed", "3")
    plain = tmp_path / "plain.arrow"  # the first round, unfiltered
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "12", "--n", "4", *fn, "--out", str(plain))
    _, pgroups = _groups(plain)
    informative = [g for g, rows in pgroups.items() if len({_total(r) for r in rows}) > 1]
    assert 4 < len(informative) < 12, "K 12 must need a refill and K 4 leave informative groups after it"

    def refilled(k: int, out):
        r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--num-prompts", "12", "--n", "4", *fn,
                           "--min-informative-groups", str(k), "--max-refill-rounds", "3", "--out", str(out))
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        _, groups = _groups(out)
        assert len(groups) == k and all(len({_total(x) for x in rs}) > 1 for rs in groups.values())
        for g in (g for g in groups if g < 12):  # the first round: each row exactly as the plain rollout sampled it
            assert [x["completion_ids"] for x in groups[g]] == [x["completion_ids"] for x in pgroups[g]]
            assert [x["old_logprobs"] for x in groups[g]] == [x["old_logprobs"] for x in pgroups[g]]
        return groups, {g: rs[0]["prompts_drawn"] for g, rs in groups.items()}, r.stderr.decode()

    # K 12: the first round's informative groups, then prompts 12.. until 12 are written; the last one sampled is
    # the last group kept, and every prompt up to it is counted once
    groups, drawn, err = refilled(12, tmp_path / "r.arrow")
    assert [g for g in groups if g < 12] == informative and min(g for g in groups if g >= 12) == 12
    last = max(groups)
    assert sum(drawn.values()) == last + 1
    assert f"informative 12 of {last + 1} sampled ({12 / (last + 1):.0%}); kept 12; {last + 1 - 12} sampled after the " \
           "first round's 12" in err
    # K 4: the first round alone; the prompts after the 4th informative group, sampled in its chunk, are dropped and
    # counted apart
    groups, drawn, err = refilled(4, tmp_path / "r4.arrow")
    assert list(groups) == informative[:4]
    tail = 11 - informative[3]
    assert tail > 0 and sum(drawn.values()) == informative[3] + 1
    assert (f"informative {len(informative)} of 12 sampled ({len(informative) / 12:.0%}); kept 4; {tail} sampled "
            "after the last group kept") in err
    u = run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(tmp_path / "r4.arrow"), "--out",
                       str(tmp_path / "u"), "--beta", "0", "--metrics", str(tmp_path / "m.jsonl"))
    assert u.returncode == 0, u.stderr.decode()[-2000:]
    m = json.loads((tmp_path / "m.jsonl").read_text())
    assert m["prompts_sampled"] == informative[3] + 1 and m["extra_prompts"] == informative[3] + 1 - 4
    assert m["informative_group_fraction"] == 1.0


def test_refill_stops_at_the_cap_and_fills_the_batch(sft_dir, tmp_path):
    """The verifier alone: the tiny test policy is almost never right, so few groups are informative; with no
    refill round allowed the batch is filled up with uninformative groups, a warning says so, and every prompt
    sampled is counted."""
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "4", "--seed", "3",
                       "--max-new-tokens", "6", "--min-informative-groups", "8", "--max-refill-rounds", "0",
                       "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rows, groups = _groups(out)
    informative = sum(len({_total(x) for x in rs}) > 1 for rs in groups.values())
    assert len(groups) == 8 and informative < 8
    assert sum(rs[0]["prompts_drawn"] for rs in groups.values()) == 8
    assert "--max-refill-rounds reached" in r.stderr.decode()
    # refusals: one line, nothing written
    for extra, says in ((("--n", "1"), "--n >= 2"), (("--min-informative-groups", "9"), "more than --num-prompts 8"),
                        (("--shard", "0/2"), "--shard")):
        args = ["rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "4", "--min-informative-groups", "8",
                *extra, "--out", str(tmp_path / "bad.arrow")]
        line = one_error_line(run_cli_inproc(*args))
        assert says in line and not (tmp_path / "bad.arrow").exists()


def test_refill_under_follow_gives_update_k_groups_a_step(sft_dir, tmp_path):
    (tmp_path / "rw.py").write_text(PARITY)
    cmd = " ".join(fast_rlkit_cmd())
    root = tmp_path / "run"
    script = (
        "set -euo pipefail\n"
        f"{cmd} rollout --follow {root} --policy {sft_dir} --n 4 --batch-prompts 8 --max-lag 0 --seed 7 "
        f"--max-new-tokens 6 --reward-fn parity={tmp_path}/rw.py:parity --min-informative-groups 4 "
        f"| {cmd} update --follow --policy {sft_dir} --out {root} --max-steps 2 --max-lag 0 --beta 0 "
        f"--minibatch-size 16 --metrics {tmp_path}/m.jsonl\n"
    )
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RLKIT_DEBUG": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:
        assert s["sequences"] == 4 * 4 and s["informative_group_fraction"] == 1.0 and s["prompts_sampled"] >= 4
