"""The verifier check (`rlkit.tasks.trust`) on real verifiers: reasoning-gym's own scorers (game_of_life_halting pays
any non-empty answer, gsm_symbolic rejects its negative gold answers), user tasks from a file, every built-in task;
the stages that refuse, warn and record it; and the held-out split rule (a smaller split is evaluated whole)."""

from __future__ import annotations

import json

import pytest

from rlkit.io import manifests
from rlkit.tasks import get_task
from rlkit.tasks.trust import SAMPLE, check_targets, check_verifier

from conftest import one_error_line, run_cli, run_cli_inproc

GOL = "reasoning-gym:dataset=game_of_life_halting"
GSM = "reasoning-gym:dataset=gsm_symbolic"
USER = '''
from rlkit.tasks import Example


class Doubles:
    """n -> 2n; `lenient` pays every answer."""

    def __init__(self, lenient: bool = False):
        self.lenient = lenient

    def iter_examples(self, split, seed):
        for n in range(1, 100):
            if (n % 10 == 0) == (split == "heldout"):
                yield Example(f"{split}-{n}", f"double {n}:", str(2 * n), split)

    def reward(self, response, answer):
        return 1.0 if self.lenient or response.strip() == answer else 0.0
'''


def test_game_of_life_halting_pays_junk_and_its_gold_answers_pass():
    out = check_verifier(get_task(GOL))
    assert (out.examples, out.golds, out.rejected) == (SAMPLE, SAMPLE, 0)
    paid = {(p.junk, p.text) for p in out.paid}
    assert ("the nonsense word", "xyzzy") in paid  # the library's scorer: 1.0 for any non-empty answer
    assert any(junk == "another example's gold answer" for junk, _ in paid)
    assert not any(junk == "the empty answer" for junk, _ in paid)  # the one answer it does not pay
    line = out.refusal("rollout")
    assert line.startswith(f"rollout: task {GOL},heldout=0.1's verifier pays junk: ")
    assert "the nonsense word 'xyzzy' scored 1 on the example \"Question: This is a 'Game of Life' grid." in line
    assert line.endswith("pass --trust-verifier to use it anyway")


@pytest.mark.parametrize("spec", ["arithmetic", "arithmetic:prose=0.5", "math", "calc", "calc:tool=0.5", "guess",
                                  "code", "code:data=sample", "judge", "reasoning-gym:dataset=basic_arithmetic",
                                  GSM, "reasoning-gym:dataset=tower_of_hanoi"])
def test_the_built_in_tasks_pass(spec, tmp_path):
    if spec == "judge":
        rubric = tmp_path / "yn.toml"
        rubric.write_text('kind = "yes-no"\ntemplate = "{prompt}{response} ok? "\nchoices = ["Y", "N"]\n')
        spec = f"judge:task=arithmetic,rubric={rubric}"
    task = get_task(spec)
    sandbox = None
    if getattr(task, "runs_code", False):
        from rlkit.tasks import task_sandbox

        sandbox = task_sandbox(task, None)
    out = check_verifier(task, sandbox)
    assert out.skipped is None and out.examples >= 2 and not out.paid and not out.rejected, out
    if spec == "guess":  # the noisy player's games are demonstrations (some lost): not held to full marks
        assert out.golds == 0 and "demonstrations" in out.notes[0]
    else:
        assert out.golds == out.examples


def test_a_generator_without_gold_answers_is_checked_on_junk_alone():
    out = check_verifier(get_task("reasoning-gym:dataset=rush_hour"))
    assert out.golds == 0 and not out.paid and out.examples == SAMPLE
    assert out.notes == ("no gold answer: task reasoning-gym:dataset=rush_hour,heldout=0.1: generator rush_hour has "
                         "no single gold answer (its scorer checks each solution), so it has no SFT targets; train on "
                         "it with rollout/update only",)


def test_a_user_task_that_pays_everything_is_found_and_a_good_one_passes(tmp_path):
    (tmp_path / "doubles.py").write_text(USER)
    good = check_verifier(get_task(f"{tmp_path}/doubles.py:Doubles"))
    assert (good.golds, good.rejected, good.paid) == (SAMPLE, 0, ())
    bad = check_verifier(get_task(f"{tmp_path}/doubles.py:Doubles:lenient=1"))
    assert {p.junk for p in bad.paid} == {"the empty answer", "the nonsense word", "another example's gold answer"}
    assert len(bad.paid) == 3 * SAMPLE


def test_gsm_symbolic_rejects_its_negative_gold_answers():
    # the library's scorer reads a number with r"\b-?\d+", which skips the sign of "-1" at the start of the answer
    task = get_task(GSM)
    ex = task.examples("train", 60, 22)
    targets = [task.completion(e) for e in ex]
    assert targets[29] == " -1"
    kept = check_targets(task, ex, targets, "drop", None)
    assert len(kept.keep) == 59 and 29 not in kept.keep
    assert kept.entry == {"checked": True, "distinct": 60, "rejected": 1, "rows_rejected": 1, "action": "drop"}


@pytest.fixture(scope="module")
def doubles(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "doubles.py").write_text(USER)
    return d / "doubles.py"


def test_rollout_refuses_a_verifier_that_pays_junk_and_takes_it_when_told(sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    args = ["rollout", "--policy", str(sft_dir), "--task", GOL, "--num-prompts", "2", "--n", "2", "--out", str(out)]
    r = run_cli(*args)
    assert r.returncode == 65
    line = one_error_line(r)
    assert line.startswith(f"rlkit: error: rollout: task {GOL},heldout=0.1's verifier pays junk: the nonsense word "
                           "'xyzzy' scored 1 on the example \"Question: This is a 'Game of Life' grid.")
    assert not out.exists()
    r = run_cli_inproc(*args, "--trust-verifier", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr.decode()
    assert "pays junk: the nonsense word 'xyzzy'" in r.stderr.decode() and "used anyway (--trust-verifier)" in \
        r.stderr.decode()
    check = manifests.read_manifest(out)["verifier_check"]
    assert check["trusted_anyway"] is True and check["gold_rejected"] == 0
    assert {"junk": "the nonsense word", "answer": "xyzzy"}.items() <= check["junk_paid"][0].items()


def test_rollout_eval_and_build_prefs_refuse_a_user_task_that_pays_everything(sft_dir, doubles, tmp_path):
    lenient = f"{doubles}:Doubles:lenient=1"
    for args in (["rollout", "--num-prompts", "2", "--out", str(tmp_path / "r.arrow")],
                 ["eval", "--num-prompts", "2"],
                 ["build-prefs", "--num-prompts", "2", "--out", str(tmp_path / "p.arrow")]):
        r = run_cli_inproc(*args, "--policy", str(sft_dir), "--task", lenient)
        assert r.returncode == 65, (args, r.stderr.decode())
        assert one_error_line(r).startswith(f"rlkit: error: {args[0]}: task {lenient}'s verifier pays junk: the empty "
                                            "answer '' scored 1 on the example 'double ")
    assert not list(tmp_path.iterdir())
    # the good one runs, and its manifest records the check
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--task", f"{doubles}:Doubles", "--num-prompts", "2",
                       "--n", "2", "--out", str(tmp_path / "ok.arrow"))
    assert r.returncode == 0, r.stderr.decode()
    assert manifests.read_manifest(tmp_path / "ok.arrow")["verifier_check"] == {
        "examples": SAMPLE, "gold_scored": SAMPLE, "gold_rejected": 0, "junk_paid": []}
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", f"{doubles}:Doubles", "--num-prompts", "2")
    assert r.returncode == 0, r.stderr.decode()
    assert "verifier check" in r.stderr.decode() and "no junk paid" in r.stderr.decode()


def test_sft_refuses_targets_its_verifier_rejects_unless_told(tmp_path):
    base = ["sft", "--task", GSM, "--seed", "22", "--num-examples", "60", "--eval-num", "2", "--batch-tokens", "4096"]
    r = run_cli(*base, "--out", str(tmp_path / "refused"))
    assert r.returncode == 65
    line = one_error_line(r)
    assert line.startswith(f"rlkit: error: sft: task {GSM},heldout=0.1's verifier rejects 1 of its 60 distinct SFT "
                           "targets (1 of the 60 training rows), e.g. ' -1' scored 0 on ")
    assert line.endswith("; training on them teaches answers the verifier then marks wrong: pass --rejected-targets "
                         "drop to train without them, or keep to train on them anyway")
    assert not (tmp_path / "refused").exists()
    for mode in ("drop", "keep"):  # (which rows were dropped: test_gsm_symbolic_rejects_its_negative_gold_answers)
        out = tmp_path / mode
        r = run_cli_inproc(*base, "--rejected-targets", mode, "--out", str(out))
        assert r.returncode == 0, r.stderr.decode()
        assert f"(--rejected-targets {mode})" in r.stderr.decode()
        m = json.loads((out / "rlkit.json").read_text())
        assert m["verifier_check"]["targets"] == {"checked": True, "distinct": 60, "rejected": 1, "rows_rejected": 1,
                                                  "action": mode}


def test_a_smaller_heldout_split_is_evaluated_whole_with_a_note(sft_dir):
    # reasoning-gym's tower_of_hanoi holds 11 held-out questions at its defaults; eval asks for 300
    r = run_cli("eval", "--policy", str(sft_dir), "--task", "reasoning-gym:dataset=tower_of_hanoi", "--json",
                "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["n"] == 11
    assert ("eval: the held-out split of task reasoning-gym:dataset=tower_of_hanoi,heldout=0.1 holds 11 examples, "
            "fewer than --num-prompts 300: evaluating all 11") in r.stderr.decode()
    # a generated task with few distinct held-out prompts, the same rule
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--task", "arithmetic:terms=1-1,max=9,heldout=0.5", "--json")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["n"] == 3
    assert ("eval: the held-out split of task arithmetic:terms=1-1,max=9,heldout=0.5 holds 3 examples, fewer than "
            "--num-prompts 300: evaluating all 3") in r.stderr.decode()
