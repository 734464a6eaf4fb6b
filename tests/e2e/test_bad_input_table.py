"""Every stage against its usage errors, a corrupt input of each kind and an --out equal to each of its inputs:
one line on stderr, the exit code, no traceback, nothing written and every input's sha256 unchanged.

The cases run the real command line (`rlkit.cli`) in this process on real artifacts (the tiny SFT checkpoint,
its frozen reference, rollouts, scored and preference tables made by the stages): a subprocess per case would
spend most of its time importing torch. `tests/e2e/test_hardening.py` runs the same rules in subprocesses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rlkit.io import artifacts

STAGES = ("prompts", "sft", "build-prefs", "train-rm", "freeze-ref", "rollout", "score-ref", "update", "eval",
          "inspect", "report", "cat")


@pytest.fixture(scope="module")
def work(tmp_path_factory, sft_dir, ref_dir) -> Path:
    """A folder of real inputs: pol/ ref/ (checkpoints), roll.arrow, scored.arrow, prefs.arrow, prompts.arrow,
    sft.arrow, and damaged ones: badtab.arrow (random bytes), badck/ and badref/ (corrupt safetensors header)."""
    from rlkit.stages import build_prefs, prompts, rollout, score_ref

    w = tmp_path_factory.mktemp("bad-input")
    shutil.copytree(sft_dir, w / "pol")
    shutil.copytree(ref_dir, w / "ref")
    rollout.run(rollout.RolloutConfig(policy=w / "pol", out=w / "roll.arrow", num_prompts=4, n=2, engine="hf"))
    score_ref.run(score_ref.ScoreRefConfig(ref=w / "ref", inp=str(w / "roll.arrow"), out=w / "scored.arrow"))
    build_prefs.run(build_prefs.BuildPrefsConfig(out=w / "prefs.arrow", policy=w / "pol", num_prompts=8, n=2))
    prompts.run(prompts.PromptsConfig(out=w / "prompts.arrow", num=8))
    prompts.run(prompts.PromptsConfig(out=w / "sft.arrow", num=8, sft=True))
    (w / "badtab.arrow").write_bytes(os.urandom(4096))
    for good, bad in (("pol", "badck"), ("ref", "badref")):
        shutil.copytree(w / good, w / bad)
        with open(w / bad / "model.safetensors", "r+b") as f:
            f.seek(9)
            f.write(b"\xff\xfe")
    (w / "m.jsonl").write_text('{"stage": "update", "step": 1, "reward_mean": 0.5}\n')
    return w


def _snapshot(w: Path) -> dict[str, str]:
    return {str(p.relative_to(w)): artifacts.sha256_file(p) if p.is_file() else "dir"
            for p in sorted(w.rglob("*"))}


USAGE = [pytest.param([s, "--no-such-flag"], "No such option: --no-such-flag", id=f"{s}-unknown-option")
         for s in STAGES] + [
    pytest.param(["rollout", "--policy", "{pol}", "--n", "many"], "Invalid value for '--n'", id="rollout-bad-int"),
    pytest.param(["update", "--policy", "{pol}", "--out", "{out}", "--lr", "nan"], "'--lr'", id="update-nan-lr"),
    pytest.param(["train-rm", "--model", "{pol}", "--out", "{out}"], "Missing option '--prefs'", id="train-rm-missing"),
    pytest.param(["no-such-stage"], "No such command", id="unknown-stage"),
]

CORRUPT_TABLE = "badtab.arrow is not an"
CORRUPT_CKPT = "model.safetensors is not a valid safetensors file"
CORRUPT = [
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE,
                 id="score-ref-table"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE,
                 id="update-table"),
    pytest.param(["cat", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE, id="cat-table"),
    pytest.param(["inspect", "{w}/badtab.arrow"], "badtab.arrow is not an rlkit artifact", id="inspect-table"),
    pytest.param(["train-rm", "--model", "{pol}", "--prefs", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE,
                 id="train-rm-table"),
    pytest.param(["rollout", "--policy", "{pol}", "--prompts", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE,
                 id="rollout-table"),
    pytest.param(["sft", "--data", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE, id="sft-table"),
    pytest.param(["build-prefs", "--from", "{w}/badtab.arrow", "--out", "{out}"], CORRUPT_TABLE, id="build-prefs-table"),
    pytest.param(["rollout", "--policy", "{w}/badck", "--out", "{out}"], CORRUPT_CKPT, id="rollout-ckpt"),
    pytest.param(["update", "--policy", "{w}/badck", "--in", "{w}/scored.arrow", "--out", "{out}"], CORRUPT_CKPT,
                 id="update-ckpt"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--ref", "{w}/badref", "--out", "{out}"],
                 CORRUPT_CKPT, id="update-ref"),
    pytest.param(["freeze-ref", "--policy", "{w}/badck", "--out", "{out}"], CORRUPT_CKPT, id="freeze-ref-ckpt"),
    pytest.param(["eval", "--policy", "{w}/badck"], CORRUPT_CKPT, id="eval-ckpt"),
    pytest.param(["score-ref", "--ref", "{w}/badref", "--in", "{w}/roll.arrow", "--out", "{out}"], CORRUPT_CKPT,
                 id="score-ref-ref"),
    pytest.param(["score-ref", "--rm", "judge={w}/badck", "--in", "{w}/roll.arrow", "--out", "{out}"], CORRUPT_CKPT,
                 id="score-ref-rm"),
    pytest.param(["train-rm", "--model", "{w}/badck", "--prefs", "{w}/prefs.arrow", "--out", "{out}"], CORRUPT_CKPT,
                 id="train-rm-ckpt"),
    pytest.param(["build-prefs", "--policy", "{w}/badck", "--out", "{out}"], CORRUPT_CKPT, id="build-prefs-ckpt"),
    pytest.param(["sft", "--model", "{w}/badck", "--out", "{out}"], CORRUPT_CKPT, id="sft-ckpt"),
    pytest.param(["inspect", "{w}/badck"], CORRUPT_CKPT, id="inspect-ckpt"),
]

SELF = "one of this stage's inputs"
OUT_IS_INPUT = [
    pytest.param(["freeze-ref", "--policy", "{pol}", "--out", "{pol}"], id="freeze-ref=policy"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{pol}"], id="update=policy"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{w}/scored.arrow"],
                 id="update=in"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--ref", "{ref}", "--out", "{ref}"],
                 id="update=ref"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{w}", "--follow"],
                 id="update-follow=parent"),
    pytest.param(["rollout", "--policy", "{pol}", "--out", "{pol}"], id="rollout=policy"),
    pytest.param(["rollout", "--policy", "{pol}", "--prompts", "{w}/prompts.arrow", "--out", "{w}/prompts.arrow"],
                 id="rollout=prompts"),
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/roll.arrow", "--out", "{w}/roll.arrow"], id="score-ref=in"),
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/roll.arrow", "--out", "{ref}"], id="score-ref=ref"),
    pytest.param(["score-ref", "--rm", "judge={pol}", "--in", "{w}/roll.arrow", "--out", "{pol}"], id="score-ref=rm"),
    pytest.param(["train-rm", "--model", "{pol}", "--prefs", "{w}/prefs.arrow", "--out", "{pol}"], id="train-rm=base"),
    pytest.param(["train-rm", "--model", "{pol}", "--prefs", "{w}/prefs.arrow", "--out", "{w}/prefs.arrow"],
                 id="train-rm=prefs"),
    pytest.param(["build-prefs", "--policy", "{pol}", "--out", "{pol}"], id="build-prefs=policy"),
    pytest.param(["build-prefs", "--from", "{w}/prefs.arrow", "--out", "{w}/prefs.arrow"], id="build-prefs=from"),
    pytest.param(["sft", "--model", "{pol}", "--out", "{pol}"], id="sft=model"),
    pytest.param(["sft", "--data", "{w}/sft.arrow", "--out", "{w}/sft.arrow"], id="sft=data"),
    pytest.param(["cat", "{w}/roll.arrow", "--out", "{w}/roll.arrow"], id="cat=input"),
    pytest.param(["report", "{w}/m.jsonl", "--out", "{w}"], id="report=folder"),
]


def _run(work: Path, argv: list[str], capfd) -> tuple[int, list[str]]:
    from rlkit.cli import _main

    args = [a.format(w=work, pol=work / "pol", ref=work / "ref", out=work / "new-out") for a in argv]
    capfd.readouterr()
    rc = _main(args)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "unexpected" not in err, err
    return rc, err.strip().splitlines()


def _check(work: Path, argv: list[str], capfd, expect: str, rc_expected: int = 2) -> None:
    before = _snapshot(work)
    rc, lines = _run(work, argv, capfd)
    assert rc == rc_expected, (rc, lines)
    errors = [ln for ln in lines if "rlkit: error:" in ln or ln.startswith(("Error:", "Usage:", "Try "))
              or "No such" in ln or "Invalid value" in ln or "Missing option" in ln]
    assert expect in "\n".join(lines), lines
    assert len([ln for ln in lines if ln.startswith("rlkit: error:")]) <= 1, lines
    assert errors, lines
    assert _snapshot(work) == before, "something was written or an input changed"


@pytest.mark.parametrize("argv,expect", USAGE)
def test_usage_errors(work, argv, expect, capfd):
    _check(work, argv, capfd, expect)


@pytest.mark.parametrize("argv,expect", CORRUPT)
def test_corrupt_inputs(work, argv, expect, capfd):
    _check(work, argv, capfd, expect)
    (line,) = [ln for ln in _run(work, argv, capfd)[1] if ln.startswith("rlkit: error:")]
    assert "/" in line  # names the file


@pytest.mark.parametrize("argv", OUT_IS_INPUT)
def test_out_equal_to_an_input(work, argv, capfd):
    _check(work, argv, capfd, SELF)
