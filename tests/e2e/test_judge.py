"""LLM judges on the real tiny model: a judge trained by `rlkit sft` on the judge task, its yes-probability against
a softmax computed by hand, a score rubric read from its greedy answer, `build-prefs --judge` with both orders, a
judge that always prefers the first response (only ties), and the refusals."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pytest
import torch

from rlkit.io import checkpoints, fingerprints, manifests, streams

from conftest import PAIRWISE_RUBRIC, make_pairwise_judge, one_error_line, run_cli_inproc, stage

pytestmark = pytest.mark.slow

YES_NO = 'kind = "yes-no"\ntemplate = "{prompt}{response} ok? "\nchoices = ["Y", "N"]\n'
PAIRWISE = PAIRWISE_RUBRIC.read_text()  # the recipe's, which the shared `shorter_judge` learned
SCORE = 'kind = "score"\ntemplate = "{prompt}{response} score: "\npattern = "(\\\\d+)"\nlow = 0\nhigh = 9\nmax_new_tokens = 4\n'


@pytest.fixture(scope="module")
def rubrics(tmp_path_factory):
    d = tmp_path_factory.mktemp("rubrics")
    out = {}
    for name, text in (("yes-no", YES_NO), ("pairwise", PAIRWISE), ("score", SCORE)):
        (d / f"{name}.toml").write_text(text)
        out[name] = d / f"{name}.toml"
    return out


def _rows(path):
    t, _ = streams.read_table(path, ["rollouts", "scored", "prefs"])
    return t.to_pylist()


def test_direct_scores_yes_probability_and_score_rubrics(sft_dir, shorter_judge, rubrics, tmp_path):
    judge_dir = shorter_judge  # any judge does for the arithmetic of its verdicts
    from transformers import AutoModelForCausalLM

    roll = tmp_path / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "2", "--out", str(roll))
    out = tmp_path / "s.arrow"
    stage("score-ref", "--judge", f"j={judge_dir}:rubric={rubrics['yes-no']}",
          "--judge", f"s={judge_dir}:rubric={rubrics['score']}", "--in", str(roll), "--out", str(out))
    rows = _rows(out)
    m = manifests.read_manifest(out)
    assert m["kind"] == "rollouts" and m["judges"]["j"]["fingerprint"] == fingerprints.fingerprint(judge_dir)
    assert m["judges"]["j"]["rubric_sha256"] == "sha256:" + hashlib.sha256(rubrics["yes-no"].read_bytes()).hexdigest()
    # P(Y) / (P(Y) + P(N)) after the rendered template, by hand from the model's logits
    model = AutoModelForCausalLM.from_pretrained(str(judge_dir)).eval()
    tok = checkpoints.load_tokenizer(judge_dir)
    y, n = tok.encode("Y", add_special_tokens=False)[0], tok.encode("N", add_special_tokens=False)[0]
    for r in rows:
        ids = tok(f"{r['prompt']}{r['completion']} ok? ")["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        p = torch.softmax(logits[[y, n]].double(), 0)[0].item()
        assert r["reward/j"] == pytest.approx(p, abs=1e-5)
        assert r["verdict/j"] == ("yes" if p >= 0.5 else "no")
        # a score rubric: the judge's greedy answer parsed, or 0 with the reason (never a crash)
        assert r["verdict/s"] in ("parsed", "unparseable", "out_of_range")
        assert (r["reward/s"] == 0.0) if r["verdict/s"] != "parsed" else 0.0 <= r["reward/s"] <= 1.0
    # update takes the judge as a reward component
    r = run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(out), "--out", str(tmp_path / "u"), "--beta", "0",
                       "--reward", "j=1", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads((tmp_path / "m.jsonl").read_text())["reward/j"] == pytest.approx(
        sum(x["reward/j"] for x in rows) / len(rows))
    # refusals, one line each, nothing written
    bad = tmp_path / "bad.arrow"
    (tmp_path / "multi.toml").write_text(YES_NO.replace('["Y", "N"]', '["Yes", "No"]'))
    for spec, says in ((f"j={sft_dir}:rubric={rubrics['yes-no']}", "judges its own answers"),
                       (f"j={judge_dir}", "no such rubric file"),
                       (f"j={judge_dir}:rubric={rubrics['pairwise']}", "is a pairwise rubric; this takes yes-no or score"),
                       (f"j={judge_dir}:rubric={tmp_path / 'multi.toml'}", "is 3 tokens of its tokenizer, not one"),
                       (f"verifier={judge_dir}:rubric={rubrics['yes-no']}", "another reward component has")):
        line = one_error_line(run_cli_inproc("score-ref", "--judge", spec, "--in", str(roll), "--out", str(bad)))
        assert says in line and not bad.exists(), (spec, line)
    # build-prefs' form, --judge DIR --rubric FILE: the same judge under the same rubric, named after DIR
    stage("score-ref", "--judge", str(judge_dir), "--rubric", str(rubrics["yes-no"]), "--in", str(roll), "--out",
          str(tmp_path / "dir.arrow"))
    assert [x["reward/shorter"] for x in _rows(tmp_path / "dir.arrow")] == pytest.approx([x["reward/j"] for x in rows])
    for args, says in ((["--judge", f"j={judge_dir}:rubric={rubrics['yes-no']}", "--rubric", str(rubrics["score"])],
                        "every --judge here names its own"),
                       (["--rubric", str(rubrics["yes-no"])], "--rubric is --judge's"),
                       (["--judge", str(sft_dir), "--rubric", str(rubrics["yes-no"])], "judges its own answers")):
        line = one_error_line(run_cli_inproc("score-ref", *args, "--in", str(roll), "--out", str(bad)))
        assert says in line and not bad.exists(), (args, line)


def test_build_prefs_labelled_by_a_judge_in_both_orders(sft_dir, shorter_judge, rubrics, tmp_path):
    """A judge whose preference is the shorter answer (a rubric it learned): its labels hold in both orders."""
    from rlkit.scorers.judge import Judge, load_rubric

    rubric = load_rubric(rubrics["pairwise"])
    shorter = shorter_judge
    out = tmp_path / "p.arrow"
    # score-ref's form, NAME=DIR:rubric=FILE (the other tests here give build-prefs --judge DIR --rubric FILE)
    r = run_cli_inproc("build-prefs", "--policy", str(sft_dir), "--judge", f"j={shorter}:rubric={rubrics['pairwise']}",
                       "--num-prompts", "32", "--n", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rows = _rows(out)
    j = json.loads(pa.ipc.open_stream(pa.OSFile(str(out))).schema.metadata[b"rlkit"])["judge"]
    assert j["fingerprint"] == fingerprints.fingerprint(shorter)
    assert j["rubric_sha256"] == "sha256:" + hashlib.sha256(rubrics["pairwise"].read_bytes()).hexdigest()
    assert j["pairs_judged"] == j["pairs_kept"] + j["ties"] and j["pairs_kept"] == len(rows) > 0
    assert {x["negative"] for x in rows} == {"judged"} and "agrees with the verifier" in r.stderr.decode()
    judge = Judge(shorter, rubric)
    prompts = [x["prompt"] for x in rows]
    assert judge.compare(prompts, [x["chosen"] for x in rows], [x["rejected"] for x in rows]) == [0] * len(rows)
    assert judge.compare(prompts, [x["rejected"] for x in rows], [x["chosen"] for x in rows]) == [1] * len(rows)
    assert sum(len(x["chosen"]) < len(x["rejected"]) for x in rows) > 0.8 * len(rows)
    # train-rm takes the judged pairs as they are
    rm = run_cli_inproc("train-rm", "--model", str(sft_dir), "--prefs", str(out), "--epochs", "1", "--out",
                        str(tmp_path / "rm"))
    assert rm.returncode == 0, rm.stderr.decode()[-2000:]
    for extra, says in ((["--judge", str(sft_dir), "--rubric", str(rubrics["pairwise"])], "judges its own answers"),
                        ([f"--judge={sft_dir}:rubric={rubrics['pairwise']}"], "judges its own answers"),
                        (["--judge", str(shorter), "--rubric", str(rubrics["yes-no"])],
                         "is a yes-no rubric; this takes pairwise"),
                        ([f"--judge=j={shorter}:rubric={rubrics['yes-no']}"], "is a yes-no rubric; this takes pairwise"),
                        (["--judge", str(shorter)], "no such rubric file"),  # DIR/rubric.toml, the default
                        ([f"--judge=j={shorter}:rubric={rubrics['pairwise']},colour=red"], "unknown option 'colour=red'")):
        line = one_error_line(run_cli_inproc("build-prefs", "--policy", str(sft_dir), *extra, "--num-prompts", "8",
                                             "--out", str(tmp_path / "bad.arrow")))
        assert says in line and not (tmp_path / "bad.arrow").exists(), (extra, line)
    line = one_error_line(run_cli_inproc("build-prefs", "--policy", str(sft_dir), "--rubric", str(rubrics["pairwise"]),
                                         "--out", str(tmp_path / "bad.arrow")))
    assert "--rubric is --judge's" in line


def test_a_judge_that_always_prefers_the_first_response_gives_only_ties(sft_dir, rubrics, tmp_path):
    from rlkit.scorers.judge import Judge, load_rubric
    from rlkit.tasks import get_task

    rubric = load_rubric(rubrics["pairwise"])
    biased = tmp_path / "biased"
    make_pairwise_judge(biased, rubric, lambda a, b: "A")
    judge = Judge(biased, rubric)
    texts = [rubric.render(prompt="<3+4>=", response_a=x, response_b=y) for x, y in (("7", "8"), ("8", "7"))]
    p, _ = judge.first_choice(texts)
    assert min(p) > 0.5  # "A" whichever answer comes first
    prompts = [e.prompt for e in get_task("arithmetic").examples("train", 16, 3)]
    assert judge.compare(prompts, ["1"] * 16, ["22"] * 16) == [None] * 16
    r = run_cli_inproc("build-prefs", "--policy", str(sft_dir), "--judge", str(biased), "--rubric",
                       str(rubrics["pairwise"]), "--num-prompts", "6", "--out", str(tmp_path / "p.arrow"))
    last = r.stderr.decode().strip().splitlines()[-1]  # after the sampling engine's line: the pairs come from samples
    assert r.returncode == 2 and "Traceback" not in r.stderr.decode() and not (tmp_path / "p.arrow").exists()
    assert last.startswith("rlkit: error: the judge labelled no pair: all") and "were ties" in last
