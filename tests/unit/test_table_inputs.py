"""What a table must be before a model reads it (`rlkit.algorithms.inputs.check_rows`), and the resolved paths
manifests record beside the given ones (`manifests.make_manifest`, `recorded_path`, `carried_paths`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from rlkit.algorithms.inputs import Limits, check_not_all_empty, check_rows
from rlkit.errors import RlkitError
from rlkit.io import manifests


def _rows(prompts, comps) -> pa.Table:
    """A rollouts-like table of two record batches (rows 0-1 and 2-3), as a stream arrives."""
    ids = pa.list_(pa.int32())
    batches = [pa.record_batch({"prompt_id": [f"p{i}" for i in range(lo, hi)], "sample_idx": [0] * (hi - lo),
                                "prompt_ids": pa.array(prompts[lo:hi], ids),
                                "completion_ids": pa.array(comps[lo:hi], ids)}) for lo, hi in ((0, 2), (2, 4))]
    return pa.Table.from_batches(batches)


LIMITS = Limits(vocab=100, context=16, what="the model")
GOOD_P, GOOD_C = [[1, 2], [1, 3], [1, 4], [1, 5]], [[7, 8], [], [9], [10, 11]]


def test_check_rows_names_the_row_in_the_whole_table():
    check_rows(_rows(GOOD_P, GOOD_C), LIMITS, "t")  # one empty completion among others: fine
    check_not_all_empty(_rows(GOOD_P, GOOD_C), "t")
    cases = [  # (prompts, completions, budget, the line); row 3 is in the second batch
        (GOOD_P, [*GOOD_C[:3], [10, 100]], None, "t: row 3 (prompt_id 'p3', sample 0), column 'completion_ids', "
                                                 "holds token id 100, outside the model's vocabulary (0..99)"),
        ([[1, 2], [1, -5], *GOOD_P[2:]], GOOD_C, None, "row 1 (prompt_id 'p1', sample 0), column 'prompt_ids', "
                                                       "holds token id -5"),
        (GOOD_P, [*GOOD_C[:2], [9] * 15, GOOD_C[3]], None, "row 2 (prompt_id 'p2', sample 0) is 17 tokens long "
                                                           "(prompt 2 + completion 15), more than the model's context "
                                                           "of 16 tokens"),
        (GOOD_P, [*GOOD_C[:3], [9] * 7], 8, "is 9 tokens long (prompt 2 + completion 7), more than --batch-tokens 8, "
                                            "the token budget of one forward batch; raise --batch-tokens to at least 9"),
        ([*GOOD_P[:3], []], GOOD_C, None, "row 3 (prompt_id 'p3', sample 0) has an empty 'prompt_ids'"),
    ]
    for prompts, comps, budget, line in cases:
        with pytest.raises(RlkitError) as e:
            check_rows(_rows(prompts, comps), LIMITS, "t", budget=budget)
        assert line in str(e.value), str(e.value)
    check_rows(_rows(GOOD_P, [*GOOD_C[:3], [9] * 6]), LIMITS, "t", budget=8)  # 2 + 6 tokens: exactly the budget
    # a stream checked batch by batch: row0 numbers the rows of the whole input
    with pytest.raises(RlkitError, match="row 13 "):
        check_rows(_rows(GOOD_P, [*GOOD_C[:3], [100]]).to_batches()[1], LIMITS, "t", row0=12)
    with pytest.raises(RlkitError, match="every completion is empty .0 tokens in all 4 rows.: nothing to train on"):
        check_not_all_empty(_rows(GOOD_P, [[]] * 4), "t")


def test_limits_of_a_model_config():
    from transformers import GPT2Config, LlamaConfig

    from rlkit.algorithms.inputs import context_length

    assert context_length(LlamaConfig(max_position_embeddings=4096)) == 4096
    assert context_length(GPT2Config(n_positions=1024)) == 1024


@dataclass(frozen=True)
class _Cfg:
    policy: Path
    inp: str | None
    task: str = "arithmetic"
    out: Path | None = None


def test_manifests_record_resolved_paths_beside_the_given_ones(tmp_path, monkeypatch):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run_dir / "pol").mkdir(parents=True)
    (run_dir / "ref").mkdir()
    (run_dir / "roll.arrow").write_bytes(b"")
    elsewhere.mkdir()
    monkeypatch.chdir(run_dir)
    m = manifests.make_manifest("scored", "score-ref", _Cfg(Path("pol"), "roll.arrow", out=Path("s.arrow")), {},
                                reference=Path("ref"), rollout={"policy": "pol"},
                                carried_paths={"rollout": {"policy": str(run_dir / "pol")}})
    assert m["config"]["policy"] == "pol" and m["reference"] == "ref"  # as given
    assert m["paths"] == {"config": {"policy": str(run_dir / "pol"), "inp": str(run_dir / "roll.arrow"),
                                     "out": str(run_dir / "s.arrow")},  # not 'task': no such file
                          "reference": str(run_dir / "ref"), "rollout": {"policy": str(run_dir / "pol")}}
    monkeypatch.chdir(elsewhere)  # a later stage in another directory finds them
    assert manifests.recorded_path(m, "reference") == str(run_dir / "ref")
    assert manifests.recorded_path(m, "rollout", "policy") == str(run_dir / "pol")
    assert manifests.recorded_path(m, "config", "task") == "arithmetic"
    assert manifests.recorded_path(m, "config", "nothing") is None
    assert manifests.carried_paths(m) == {"rollout": {"policy": str(run_dir / "pol")}, "reference": str(run_dir / "ref")}
    old = {k: v for k, v in m.items() if k != "paths"}  # a manifest from before: the given path
    assert manifests.recorded_path(old, "reference") == "ref"
    moved = tmp_path / "moved"
    os.rename(run_dir, moved)  # the tree moved as a whole, read from its new place: the given path, which exists
    monkeypatch.chdir(moved)
    assert manifests.recorded_path(m, "reference") == "ref"
