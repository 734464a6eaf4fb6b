"""A judge's score rubric generated on vLLM (its CPU backend, for real) gives what the hf engine gives: the judge's
greedy answers through the sampling driver, parsed the same way (`score-ref --judge NAME=DIR:rubric=FILE,engine=vllm`).
Skipped, with the reason, only when `import vllm` fails; with RLKIT_REQUIRE_VLLM=1 (CI) that is a failure."""

from __future__ import annotations

import pytest

from rlkit.io import streams

from conftest import run_cli, stage

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

SCORE = 'kind = "score"\ntemplate = "{prompt}{response} <1+2>="\npattern = "(\\\\d+)"\nlow = 0\nhigh = 60\nmax_new_tokens = 6\n'


def test_a_score_rubric_on_vllm_scores_what_hf_scores(vllm_ok, sft_dir, tmp_path):
    (tmp_path / "score.toml").write_text(SCORE)
    roll, judge = tmp_path / "r.arrow", tmp_path / "judge"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "2", "--out", str(roll))
    # a judge that is not the policy: the SFT checkpoint after one update
    stage("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(judge), "--beta", "0", "--lr", "1e-3",
          "--length-penalty", "0.1")
    rows = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.arrow"
        # in a process of its own, as every vLLM test runs it: vLLM installs signal handlers in the process it
        # starts in, which would outlive it in this test worker
        r = run_cli("score-ref", "--judge", f"s={judge}:rubric={tmp_path / 'score.toml'},engine={engine}", "--in",
                    str(roll), "--out", str(out))
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        t, _ = streams.read_table(out, ["rollouts"])
        rows[engine] = t.to_pylist()
    got = [(r["reward/s"], r["verdict/s"]) for r in rows["vllm"]]
    assert got == [(r["reward/s"], r["verdict/s"]) for r in rows["hf"]]
    assert any(v == "parsed" for _, v in got)  # the template ends with a sum to do: the judge writes a number
