"""Sharded rollouts and scoring across jobs, joined by `rlkit cat` into the table one job gives."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rlkit.errors import RlkitError
from rlkit.io import schemas, shards, streams

from conftest import one_error_line, run_cli, run_cli_inproc


def test_shard_arithmetic():
    assert shards.parse("0/1") == shards.Shard(0, 1) and shards.parse(" 2 / 3 ") == shards.Shard(2, 3)
    for bad in ("3/3", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(RlkitError, match="expected I/N"):
            shards.parse(bad)
    # 150 prompts in chunks of 64 -> chunks [0,64) [64,128) [128,150), dealt to 3 and to 2 jobs
    assert [shards.prompt_span(shards.Shard(i, 3), 150, 64) for i in range(3)] == [range(0, 64), range(64, 128),
                                                                                    range(128, 150)]
    assert [shards.prompt_span(shards.Shard(i, 2), 150, 64) for i in range(2)] == [range(0, 64), range(64, 150)]
    assert shards.prompt_span(shards.Shard(0, 4), 10, 64) == range(0, 0)  # more jobs than chunks: empty shards
    assert shards.prompt_span(shards.Shard(3, 4), 10, 64) == range(0, 10)
    groups = [0, 0, 1, 1, 1, 2, 3, 3]  # four groups, cut between them: never inside one
    assert [shards.group_span(shards.Shard(i, 2), groups) for i in range(2)] == [range(0, 5), range(5, 8)]
    assert [shards.group_span(shards.Shard(i, 3), groups) for i in range(3)] == [range(0, 2), range(2, 5),
                                                                                 range(5, 8)]


def _rollout(policy, out, **kw):
    from rlkit.stages.rollout import RolloutConfig, run

    run(RolloutConfig(policy=policy, out=out, num_prompts=150, n=2, seed=3, **kw))
    return out


def _table(path) -> pa.Table:
    t, _ = streams.read_table(path, list(schemas.KINDS))
    return t.replace_schema_metadata(None)


@pytest.mark.slow
def test_sharded_rollouts_and_scoring_join_into_the_single_job_table(sft_dir, ref_dir, tmp_path):
    from rlkit.stages.score_ref import ScoreRefConfig
    from rlkit.stages.score_ref import run as score

    whole = _table(_rollout(sft_dir, tmp_path / "whole.arrow"))
    parts = [_rollout(sft_dir, tmp_path / f"part{i}.arrow", shard=f"{i}/3") for i in range(3)]
    assert [_table(p).num_rows for p in parts] == [128, 128, 44]  # whole chunks of 64 prompts x 2 samples
    joined = tmp_path / "joined.arrow"
    r = run_cli("cat", str(parts[2]), str(parts[0]), str(parts[1]), "--out", str(joined))  # any order
    assert r.returncode == 0, r.stderr
    assert _table(joined).equals(whole)  # every column, every row, in order: the same samples and log-probs
    t, reader = streams.read_table(joined, ["rollouts"])
    assert reader.manifest["command"] == "cat" and reader.manifest["temperature"] == 1.0

    # score-ref: each shard streamed through its own job, or one file cut between groups by --shard
    sw = tmp_path / "scored-whole.arrow"
    score(ScoreRefConfig(ref=ref_dir, inp=str(tmp_path / "whole.arrow"), out=sw))
    piped = [tmp_path / f"scored{i}.arrow" for i in range(3)]
    for p, o in zip(parts, piped, strict=True):
        score(ScoreRefConfig(ref=ref_dir, inp=str(p), out=o))
    cut = [tmp_path / f"cut{i}.arrow" for i in range(2)]
    for i, o in enumerate(cut):
        score(ScoreRefConfig(ref=ref_dir, inp=str(tmp_path / "whole.arrow"), out=o, shard=f"{i}/2"))
    ref_whole = _table(sw)
    for name, files in (("piped", piped), ("cut", cut)):
        out = tmp_path / f"{name}.arrow"
        r = run_cli("cat", *map(str, reversed(files)), "--out", str(out))
        assert r.returncode == 0, r.stderr
        got = _table(out)
        assert got.drop(["ref_logprobs"]).equals(ref_whole.drop(["ref_logprobs"])), name
        for a, b in zip(got.column("ref_logprobs").to_pylist(), ref_whole.column("ref_logprobs").to_pylist(),
                        strict=True):
            assert a == pytest.approx(b, abs=1e-5)  # other batch shapes: float rounding only
    g = _table(cut[0]).column("group_id").to_pylist()
    assert set(g).isdisjoint(_table(cut[1]).column("group_id").to_pylist())  # no group cut in two

    # the shards of other runs, incomplete sets, duplicates: one line each, nothing written
    other = _rollout(sft_dir, tmp_path / "other1.arrow", shard="1/3", temperature=0.7)
    bad = tmp_path / "bad.arrow"
    for args, msg in (((parts[0], parts[1]), "2/3 missing"), ((parts[0], parts[0], parts[1]), "both shard 0/3"),
                      ((parts[0], other, parts[2]), "different runs"), ((parts[0], tmp_path / "whole.arrow"),
                                                                          "is not a shard")):
        line = one_error_line(run_cli("cat", *map(str, args), "--out", str(bad)))
        assert msg in line and not bad.exists(), line
    line = one_error_line(run_cli_inproc("cat", str(parts[0]), str(sw), "--out", str(bad)))
    assert "different kinds" in line or "not a shard" in line
    line = one_error_line(run_cli_inproc("score-ref", "--ref", str(ref_dir), "--in", str(parts[0]), "--shard", "0/2",
                                         "--out", str(bad)))
    assert "already shard 0/3" in line and not bad.exists()
    line = one_error_line(run_cli_inproc("score-ref", "--ref", str(ref_dir), "--shard", "0/2", "--out", str(bad),
                                         input=(tmp_path / "whole.arrow").read_bytes()))
    assert "--in FILE" in line
    line = one_error_line(run_cli_inproc("rollout", "--policy", str(sft_dir), "--shard", "2/2", "--out", str(bad)))
    assert "expected I/N" in line and not bad.exists()
