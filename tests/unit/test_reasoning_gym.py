"""The reasoning-gym task on the real library (the `reasoning-gym` extra, installed by `make test`): rows, splits,
strict and partial scoring, answer tags, lineage, and bad specs as one line."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from rlkit.errors import RlkitError
from rlkit.tasks import get_task, verify
from rlkit.tasks.reasoning_gym import decode_entry, encode_entry

from conftest import run_cli

ARITH = "reasoning-gym:dataset=basic_arithmetic,min_terms=2,max_terms=3,max_digits=1,operators=+|-"


def test_rows_are_the_generators_entries_and_gold_answers_score_one():
    import reasoning_gym

    t = get_task(ARITH)
    assert t.spec == ARITH + ",heldout=0.1" and get_task(t.spec) == t
    ex = t.examples("train", 20, seed=3)
    for e in ex:
        entry = decode_entry(e.answer)
        assert e.prompt == f"Question: {entry['question']}\nAnswer:" and entry["metadata"]["num_terms"] in (2, 3)
        assert set(entry["question"]) <= set("Calculate0123456789+-.() ") and "*" not in entry["question"]
        assert reasoning_gym.get_score_answer_fn("basic_arithmetic")(entry["answer"], entry) == 1.0
    golds = [t.completion(e) for e in ex]
    assert all(g.startswith(" ") for g in golds)
    assert verify(t, golds, [e.answer for e in ex]).values == [1.0] * 20
    # the same seed gives the same rows; another seed others
    assert t.examples("train", 20, seed=3) == ex
    assert [e.prompt for e in t.examples("train", 20, seed=4)] != [e.prompt for e in ex]


def test_train_and_heldout_never_share_a_question_and_heldout_is_unique():
    t = get_task(ARITH.replace("max_terms=3", "max_terms=2") + ",allow_negation=0,allow_parentheses=0,heldout=0.3")
    # 200 questions in all (10 x 10 x 2), about 60 held out
    held = [e.prompt for e in t.examples("heldout", 40, seed=0)]
    assert len(set(held)) == 40
    train = {e.prompt for e in t.examples("train", 2000, seed=0)}
    assert train and not train & set(held)
    # another held-out seed: the same partition, so again none of the training questions
    assert not train & {e.prompt for e in t.examples("heldout", 40, seed=9)}
    # the held-out questions run out (asked for more, the split is taken whole), the train stream does not (endless,
    # chunk after chunk)
    whole = [e.prompt for e in t.examples("heldout", 200, seed=0)]
    assert 40 < len(whole) < 200 and len(set(whole)) == len(whole) and whole[:40] == held
    assert len(t.examples("train", 1500, seed=1)) == 1500


def test_strict_by_default_partial_when_asked():
    strict, partial = get_task(ARITH), get_task(ARITH + ",partial=1")
    entry = {"question": "Calculate 1 - 5.", "answer": "-4",
             "metadata": {"source_dataset": "basic_arithmetic", "source_index": 0}}
    ans = encode_entry(entry)
    # the library's own score gives 2/3 to a response that merely contains the gold answer
    s = strict.score_batch(["1-4", " -4 ", "4", "<answer>-4</answer>"], [ans] * 4)
    assert s.values == [0.0, 1.0, 0.0, 0.0] and s.reasons == ["partial", "passed", "wrong_answer", "partial"]
    p = partial.score_batch(["1-4", "-4"], [ans] * 2)
    assert p.values[0] == pytest.approx(2 / 3) and p.values[1] == 1.0
    assert strict.reward("1-4", ans) == 0.0 and partial.reward("1-4", ans) == pytest.approx(2 / 3)


def test_a_row_whose_answer_is_not_an_entry_is_one_line():
    with pytest.raises(RlkitError, match="the row's answer '42' is not a reasoning-gym entry"):
        get_task(ARITH).reward("42", "42")


def test_answer_tags():
    t = get_task(ARITH + ",answer_tags=1")
    (e,) = t.examples("train", 1, seed=0)
    gold = decode_entry(e.answer)["answer"]
    assert e.prompt.startswith("Give only the final answer, inside <answer></answer> tags.\nQuestion: ")
    assert t.completion(e) == f" <answer>{gold}</answer>"
    s = t.score_batch([f"I think <answer>0</answer> no, <answer>{gold}</answer>", gold, "<answer>x</answer>"],
                      [e.answer] * 3)
    assert s.values[:2] == [1.0, 0.0] and s.reasons[1:] == ["no_answer_tags", "wrong_answer"]


def test_entries_keep_their_tuples_through_json():
    """arc_agi's scorer compares tuples in the metadata: the answer column keeps them."""
    t = get_task("reasoning-gym:dataset=arc_agi")
    ex = t.examples("train", 2, seed=0)
    entry = decode_entry(ex[0].answer)
    assert isinstance(entry["metadata"]["input"], tuple)
    assert t.score_batch([decode_entry(e.answer)["answer"] for e in ex], [e.answer for e in ex]).values == [1.0, 1.0]
    assert json.loads(ex[0].answer)["metadata"]["input"]["__tuple__"]


def test_a_generator_without_a_gold_answer_samples_but_has_no_sft_target():
    t = get_task("reasoning-gym:dataset=rush_hour")
    (e,) = t.examples("train", 1, seed=0)
    assert decode_entry(e.answer)["answer"] is None
    assert t.reward("garbage", e.answer) == 0.0
    with pytest.raises(RlkitError, match="rush_hour has no single gold answer .* no SFT targets"):
        t.completion(e)


@pytest.mark.parametrize("spec, message", [
    ("reasoning-gym", "which generator\\? expected dataset=NAME"),
    ("reasoning-gym:dataset=basic_arithmetc", "unknown dataset 'basic_arithmetc' \\(did you mean basic_arithmetic"),
    ("reasoning-gym:dataset=basic_arithmetic,digits=2", "unknown option 'digits' .* its config takes min_terms"),
    ("reasoning-gym:dataset=basic_arithmetic,seed=1", "seed is set by rlkit \\(the stage's --seed\\)"),
    ("reasoning-gym:dataset=basic_arithmetic,size=5", "size is set by rlkit \\(how many examples a stage draws: its "
                                                      "--num-prompts, sft's --num-examples"),
    ("reasoning-gym:dataset=basic_arithmetic,min_terms=two", "min_terms='two': expected an int"),
    ("reasoning-gym:dataset=basic_arithmetic,format_style=fancy", "expected one of simple, natural"),
    ("reasoning-gym:dataset=basic_arithmetic,min_terms=5,max_terms=2", "the generator refused its config: "),
    ("reasoning-gym:dataset=basic_arithmetic,heldout=1", "heldout=1: expected 0 < heldout < 1"),
    ("reasoning-gym:dataset=basic_arithmetic,partial=maybe", "partial: 'maybe' is not a boolean"),
])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(RlkitError, match=message) as e:
        get_task(spec)
    assert "\n" not in str(e.value)


def test_prompts_writes_the_rows_and_records_the_library(tmp_path):
    out = tmp_path / "p.arrow"
    r = run_cli("prompts", "--task", ARITH, "--num-prompts", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()
    with pa.memory_map(str(out)) as f:
        t = pa.ipc.open_file(f).read_all() if f.read(6) == b"ARROW1" else None
    if t is None:
        with pa.OSFile(str(out)) as f:
            t = pa.ipc.open_stream(f).read_all()
    assert t.num_rows == 8 and all(decode_entry(a)["question"] in p for a, p in
                                   zip(t.column("answer").to_pylist(), t.column("prompt").to_pylist(), strict=True))
    from importlib.metadata import version

    manifest = json.loads((tmp_path / "p.arrow.rlkit.json").read_text()) if (tmp_path / "p.arrow.rlkit.json").exists() \
        else json.loads(t.schema.metadata[b"rlkit"])
    assert manifest["inputs"]["task"] == f"reasoning-gym=={version('reasoning-gym')}"
    assert manifest["config"]["task"] == ARITH + ",heldout=0.1"
    bad = tmp_path / "bad.arrow"
    r = run_cli("prompts", "--task", "reasoning-gym:dataset=nope", "--out", str(bad))
    assert r.returncode == 2 and not bad.exists() and len(r.stderr.decode().strip().splitlines()) == 1


def test_sft_on_a_generator_without_gold_answers_is_one_line(tmp_path):
    out = tmp_path / "sft"
    r = run_cli("sft", "--task", "reasoning-gym:dataset=rush_hour", "--num-examples", "10", "--out", str(out))
    (line,) = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and not out.exists()
    assert "generator rush_hour has no single gold answer" in line and "no SFT targets" in line
