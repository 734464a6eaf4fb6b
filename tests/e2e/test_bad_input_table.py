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

from rlkit.io import fingerprints, manifests, schemas, streams

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
    return {str(p.relative_to(w)): fingerprints.sha256_file(p) if p.is_file() else "dir"
            for p in sorted(w.rglob("*"))}


USAGE = [pytest.param([s, "--no-such-flag"], "No such option: --no-such-flag", id=f"{s}-unknown-option")
         for s in STAGES] + [
    pytest.param(["rollout", "--policy", "{pol}", "--n", "many"], "Invalid value for '--n'", id="rollout-bad-int"),
    pytest.param(["update", "--policy", "{pol}", "--out", "{out}", "--lr", "nan"], "'--lr'", id="update-nan-lr"),
    pytest.param(["train-rm", "--model", "{pol}", "--out", "{out}"], "Missing option '--prefs'", id="train-rm-missing"),
    pytest.param(["no-such-stage"], "No such command", id="unknown-stage"),
    pytest.param(["prompts", "--task", "reasoning-gym:dataset=basic_arithmetic,size=5", "--out", "{out}"],
                 "size is set by rlkit (how many examples a stage draws: its --num-prompts, sft's --num-examples; the "
                 "generator makes them in chunks of 500); leave it out", id="reasoning-gym-size"),
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


# --config files, integer bounds and range checks: (argv with {cfg} for the config file, the file's name and
# text, or None, the line expected). File values are checked as typed ones; a range error names the flag and value.
UPDATE = ["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{out}"]
ROLLOUT = ["rollout", "--policy", "{pol}", "--out", "{out}"]
_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "reward: *i\n"
CONFIG_ROWS = [
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.toml", "n = true\n"), "--n takes an integer, not true",
                 id="config-bool-for-int"),
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.yaml", "n: 2.5\n"), "--n takes an integer, not 2.5",
                 id="config-float-for-int"),
    pytest.param([*UPDATE, "--config", "{cfg}"], ("c.toml", "lr = [1e-5, 2e-5]\n"), "--lr takes a number, not a list",
                 id="config-list-for-scalar"),
    pytest.param([*UPDATE, "--config", "{cfg}"], ("c.toml", 'drop_degenerate = "yes"\n'),
                 "--drop-degenerate takes true or false", id="config-string-for-flag"),
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.toml", 'n = "many"\n'), "(from --config", id="config-bad-string"),
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.yaml", "1: 2\n"), "key 1 (an integer)", id="config-int-key"),
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.yaml", "~: 2\n"), "key null", id="config-null-key"),
    pytest.param([*UPDATE, "--config", "{cfg}"], ("c.yaml", _BOMB), "YAML aliases expanded", id="config-yaml-bomb"),
    pytest.param([*UPDATE, "--config", "{cfg}"], ("c.toml", "# " + "x" * 2**20 + "\n"), "larger than 1 MiB",
                 id="config-too-large"),
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.toml", "n = 99999999999999999999999\n"),
                 "99999999999999999999999 is larger than 2147483647", id="config-huge-int"),
    pytest.param([*ROLLOUT, "--n", "99999999999999999999999"], None, "'--n': 99999999999999999999999 is larger",
                 id="cli-huge-int"),
    pytest.param([*UPDATE, "--seed", "-99999999999999999999999"], None, "is smaller than -2147483648",
                 id="cli-huge-negative-int"),
    pytest.param([*UPDATE, "--lr", "-1"], None, "'--lr': -1 is not a learning rate in (0, 1]", id="update-negative-lr"),
    pytest.param([*UPDATE, "--clip-high", "-0.5"], None, "'--clip-high': -0.5 is not a ratio clip above 1 in [0, 100]",
                 id="update-negative-clip"),
    pytest.param([*UPDATE, "--algo", "ppo", "--lam", "2"], None, "'--lam': 2 is not a GAE lambda in [0, 1]",
                 id="update-lam-range"),
    pytest.param(["train-rm", "--model", "{pol}", "--prefs", "{w}/prefs.arrow", "--out", "{out}", "--lr", "0"], None,
                 "'--lr': 0 is not a learning rate in (0, 1]", id="train-rm-zero-lr"),
    pytest.param([*ROLLOUT, "--top-p", "1.5"], None, "'--top-p': 1.5 is not a probability mass in (0, 1]", id="rollout-top-p"),
    pytest.param([*UPDATE, "--dist-timeout", "0"], None, "'--dist-timeout': 0 is not a number of minutes in (0, 1e+07]",
                 id="update-dist-timeout"),
    pytest.param(["sft", "--out", "{out}", "--dist-timeout", "-5"], None,
                 "'--dist-timeout': -5 is not a number of minutes in (0, 1e+07]", id="sft-dist-timeout"),
    pytest.param(["sft", "--out", "{out}", "--dist-timeout", "1e300"], None,
                 "'--dist-timeout': 1e+300 is not a number of minutes in (0, 1e+07]", id="sft-huge-dist-timeout"),
    pytest.param([*UPDATE, "--config", "{cfg}"], ("c.toml", "[update]\ndist_timeout = 1e300\n"),
                 "1e+300 is not a number of minutes in (0, 1e+07] (from --config", id="config-huge-dist-timeout"),
    pytest.param([*ROLLOUT, "--config", "{cfg}"], ("c.yaml", "temperature: 1.0e+300\n"),
                 "'--temperature': 1e+300 is not a sampling temperature in (0, 100] (from --config", id="config-huge-float"),
    pytest.param([*ROLLOUT, "--reward-timeout", "1e12"], None, "'--reward-timeout': 1e+12 is not a number of seconds",
                 id="rollout-huge-reward-timeout"),
    pytest.param(["train-rm", "--model", "{pol}", "--prefs", "{w}/prefs.arrow", "--out", "{out}", "--dist-timeout",
                  "nan"], None, "'--dist-timeout': 'nan' is not a finite number", id="train-rm-dist-timeout"),
]


@pytest.mark.parametrize("argv,cfg,expect", CONFIG_ROWS)
def test_config_rows(work, argv, cfg, expect, capfd, tmp_path):
    if cfg is not None:
        (tmp_path / cfg[0]).write_text(cfg[1])
        argv = [a.replace("{cfg}", str(tmp_path / cfg[0])) for a in argv]
    _check(work, argv, capfd, expect)


# Every path a stage writes is claimed as --out is (claims.check_outputs), before any work: --metrics and
# --tensorboard pointed at each input of each stage that has them (a table, a checkpoint, a file inside one, a
# new path inside one), run and project names that are paths, two outputs on one path, symbolic links, empty
# paths and parents that are files. {places}: the module's `places` folder (links, files rlkit did not make).
_SIDE_STAGES = {
    "sft": (["sft", "--model", "{pol}", "--data", "{w}/sft.arrow", "--out", "{out}"], ["{pol}", "{w}/sft.arrow"]),
    "train-rm": (["train-rm", "--model", "{pol}", "--prefs", "{w}/prefs.arrow", "--out", "{out}"],
                 ["{pol}", "{w}/prefs.arrow"]),
    "update": (["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--ref", "{ref}", "--out", "{out}"],
               ["{pol}", "{w}/scored.arrow", "{ref}"]),
    "update-follow": (["update", "--follow", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--ref", "{ref}",
                       "--out", "{out}"], ["{pol}", "{w}/scored.arrow", "{ref}"]),
    "eval": (["eval", "--policy", "{pol}", "--prompts", "{w}/prompts.arrow"], ["{pol}", "{w}/prompts.arrow"]),
}
_IS_INPUT, _IN_INPUT = "is one of this stage's inputs", "lies inside an input directory"


def _row(argv: list[str], expect: str, id: str, rc: int = 2):  # noqa: A002 (pytest.param's name)
    return pytest.param(argv, expect, rc, id=id)


def _side_rows() -> list:
    rows = []
    for stage, (argv, inputs) in _SIDE_STAGES.items():
        for flag in ("--metrics", "--tensorboard"):
            for inp in inputs:
                name = inp.strip("{}").replace("w}/", "")
                rows.append(_row([*argv, flag, inp], f"{flag} {inp} {_IS_INPUT}", id=f"{stage}{flag}={name}"))
                if not inp.endswith(".arrow"):  # a checkpoint: a file in it, a new path in it
                    for sub in ("model.safetensors", "new/x"):
                        rows.append(_row([*argv, flag, f"{inp}/{sub}"], f"{flag} {inp}/{sub} {_IN_INPUT}",
                                         id=f"{stage}{flag}={name}/{sub}"))
        for flag, value in (("--run-name", "../../x"), ("--run-name", "/tmp/x"), ("--run-name", "a/b"),
                            ("--run-name", ".."), ("--project", "../p"), ("--project", "/tmp/p")):
            rows.append(_row([*argv, "--report-to", "tensorboard", flag, value],
                             f"{flag} {value!r}: a name is expected, not a path", id=f"{stage}{flag}={value}"))
    return rows


UPD = _SIDE_STAGES["update"][0]
EVAL = _SIDE_STAGES["eval"][0]
SIDE_OUTPUT_ROWS = _side_rows() + [
    # two outputs of one run on one path, or one inside another
    _row([*UPD, "--metrics", "{out}"], "--metrics {out} is the same path as --out {out}", id="metrics=out"),
    _row([*UPD, "--tensorboard", "{out}/tb"], "--tensorboard {out}/tb lies inside --out {out}",
         id="tensorboard-in-out"),
    _row([*EVAL, "--metrics", "{w}/new.jsonl", "--tensorboard", "{w}/new.jsonl"],
         "--tensorboard {w}/new.jsonl is the same path as --metrics", id="tensorboard=metrics"),
    _row([*UPD, "--follow", "--metrics", "{out}/m.jsonl"], "--metrics {out}/m.jsonl lies inside --out",
         id="follow-metrics-in-out"),
    # files, tables and checkpoints the stage did not make (not its inputs)
    _row([*EVAL, "--metrics", "{w}/roll.arrow"], "is an rlkit 'rollouts' table, not a metrics file",
         id="metrics=other-table"),
    _row([*EVAL, "--metrics", "{places}/notes.txt"], "exists and is not a metrics file (line 1",
         id="metrics=text-file"),
    _row([*EVAL, "--metrics", "{places}/data.jsonl"], "exists and is not a metrics file (line 1",
         id="metrics=jsonl-data"),
    _row([*EVAL, "--metrics", "{places}"], "is a directory, expected a metrics file", id="metrics=folder"),
    _row([*EVAL, "--metrics", "{w}/badref/model.safetensors"], "lies inside the checkpoint",
         id="metrics-in-other-checkpoint"),
    _row([*EVAL, "--tensorboard", "{w}/badref"], "is an rlkit checkpoint, not a TensorBoard log directory",
         id="tensorboard=other-checkpoint"),
    _row([*EVAL, "--tensorboard", "{places}"], "which is not a TensorBoard event file",
         id="tensorboard=folder"),
    _row([*EVAL, "--tensorboard", "{w}/m.jsonl"], "exists and is not a directory", id="tensorboard=file"),
    _row(["rollout", "--policy", "{pol}", "--out", "{w}/badref/r.arrow"], "lies inside the checkpoint",
         id="out-in-other-checkpoint"),
    # symbolic links, empty paths, parents that are files
    _row([*UPD[:-1], "{places}/loop"], "--out {places}/loop is a symbolic link that leads nowhere",
         id="out=symlink-loop"),
    _row(["freeze-ref", "--policy", "{pol}", "--out", "{places}/dangling"], "is a symbolic link that leads nowhere",
         id="out=dangling-symlink"),
    _row(["rollout", "--policy", "{pol}", "--out", "{places}/loop/r.arrow"],
         "its parent {places}/loop is a symbolic link that leads nowhere", id="out-under-symlink-loop"),
    _row(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{places}/to-ref"],
         "--out {places}/to-ref is a symbolic link (to", id="out=symlink-to-checkpoint"),
    _row(["rollout", "--policy", "{pol}", "--out", "{places}/to-roll"], "is a symbolic link (to",
         id="out=symlink-to-table"),
    _row([*EVAL, "--metrics", "{places}/loop"], "--metrics {places}/loop is a symbolic link that leads nowhere",
         id="metrics=symlink-loop"),
    _row(["rollout", "--policy", "{pol}", "--out", ""], "'--out' / '-o': the path is empty", id="rollout-out-empty"),
    _row(["sft", "--out", ""], "the path is empty", id="sft-out-empty"),
    _row([*EVAL, "--metrics", ""], "the path is empty", id="metrics-empty"),
    _row([*UPD, "--tensorboard", ""], "the path is empty", id="tensorboard-empty"),
    _row(["rollout", "--policy", "{pol}", "--out", "{w}/m.jsonl/sub.arrow"],
         "its parent {w}/m.jsonl is a file, not a directory", id="out-parent-is-a-file", rc=74),
    _row([*EVAL, "--metrics", "{w}/m.jsonl/x/m.jsonl"], "its parent {w}/m.jsonl is a file",
         id="metrics-parent-is-a-file", rc=74),
    # update --follow on a table that is not a follow stream: a whole line, and no --out left behind
    _row(["update", "--follow", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{out}"],
         "is not a stream from `rlkit rollout --follow`, whose manifest records its --batch-prompts",
         id="follow-on-a-plain-table"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory, work) -> Path:
    """Paths no stage may write at or through: symbolic links (a loop, a dangling one, to a checkpoint and to a
    table of `work`), a text file and a JSON-lines data file that are not metrics files."""
    d = tmp_path_factory.mktemp("places")
    (d / "loop").symlink_to("loop")
    (d / "dangling").symlink_to("nowhere")
    (d / "to-ref").symlink_to(work / "ref")
    (d / "to-roll").symlink_to(work / "roll.arrow")
    (d / "notes.txt").write_text("notes, not metrics\n")
    (d / "data.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    return d


def _places_state(d: Path) -> dict[str, str]:
    return {e.name: os.readlink(e.path) if e.is_symlink() else fingerprints.sha256_file(Path(e.path))
            for e in os.scandir(d)}


def _fill(argv: list[str], expect: str, work: Path, **more: Path) -> tuple[list[str], str]:
    """`argv` and `expect` with the placeholders filled: {w}, {pol}, {ref}, {out} and one per `more`."""
    names = {"{w}": str(work), "{pol}": str(work / "pol"), "{ref}": str(work / "ref"), "{out}": str(work / "new-out"),
             **{f"{{{k}}}": str(v) for k, v in more.items()}}

    def fill(s: str) -> str:
        for k, v in names.items():
            s = s.replace(k, v)
        return s

    return [fill(a) for a in argv], fill(expect)


@pytest.mark.parametrize("argv,expect,rc", SIDE_OUTPUT_ROWS)
def test_side_output_rows(work, places, argv, expect, rc, capfd):
    before = _places_state(places)
    argv, expect = _fill(argv, expect, work, places=places)
    _check(work, argv, capfd, expect, rc)
    assert _places_state(places) == before


def test_a_busy_follow_directory_is_exit_75(work, capfd):
    """A second `update --follow` on a directory another one is writing: exit 75 as for a busy --out."""
    from rlkit.io import follow

    root = work / "new-out"
    with follow.writer_lock(root):
        _check(work, ["update", "--follow", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", str(root)],
               capfd, "is being written by another `rlkit update --follow`", rc_expected=75)
    assert not root.exists()  # the lock file and the directory it made went with the lock


@pytest.fixture
def full_disk(tmp_path):
    """A real 64 KiB file system (tmpfs) filled up but for 8 KiB; skipped where this process may not mount one."""
    from conftest import tmpfs

    with tmpfs(tmp_path / "full", "64k") as d:
        (d / "filler").write_bytes(b"\0" * (56 << 10))
        yield d

FULL_ROWS = [  # (argv with {full}, the metrics file's text there before or None, fill the disk up entirely)
    pytest.param(["rollout", "--policy", "{pol}", "--num-prompts", "16", "--n", "2", "--engine", "hf",
                  "--out", "{full}/r.arrow"], None, False, "writing --out {full}/r.arrow failed: no space left",
                 id="rollout-out"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{full}/next"], None, False,
                 "writing --out {full}/next failed: no space left", id="update-out"),
    pytest.param([*EVAL, "--num-prompts", "2", "--metrics", "{full}/m.jsonl"], None, True,
                 "cannot write --metrics {full}/m.jsonl: no space left", id="eval-metrics-new"),
    pytest.param([*EVAL, "--num-prompts", "2", "--metrics", "{full}/m.jsonl"], "page", True,
                 "cannot write --metrics {full}/m.jsonl: no space left", id="eval-metrics-existing"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{out}", "--metrics",
                  "{full}/m.jsonl"], None, True, "cannot write --metrics {full}/m.jsonl: no space left",
                 id="update-metrics"),  # and no checkpoint at --out: `work` is unchanged
    pytest.param(["update", "--follow", "--batch-prompts", "2", "--policy", "{pol}", "--in", "{w}/scored.arrow",
                  "--out", "{full}/steps"], None, False, "writing --follow {full}/steps failed: no space left",
                 id="update-follow"),
]


@pytest.mark.parametrize("argv,metrics,entirely,expect", FULL_ROWS)
def test_a_full_disk_is_exit_74_and_leaves_nothing(work, full_disk, argv, metrics, entirely, expect, capfd):
    """No space left for --out or --metrics: one line, exit 74, no temporary file, lock or empty metrics file
    left, an existing metrics file as it was."""
    if metrics is not None:  # rows filling its 4 KiB page exactly: the next row needs a page there is none of
        row = '{"stage": "update", "step": 1, "pad": "%s"}\n'
        (full_disk / "m.jsonl").write_text(row % ("x" * (4096 - len(row % ""))))
    if entirely:
        fd = os.open(full_disk / "filler", os.O_WRONLY | os.O_APPEND)
        try:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
    state = {p.name: fingerprints.sha256_file(p) for p in full_disk.iterdir()}
    argv, expect = _fill(argv, expect, work, full=full_disk)
    _check(work, argv, capfd, expect, rc_expected=74)
    assert {p.name: fingerprints.sha256_file(p) for p in full_disk.iterdir()} == state


def test_stdout_without_space_is_exit_74(tmp_path):
    """A table (or `eval --json`) sent to a full disk through stdout: one line, exit 74 (/dev/full)."""
    import subprocess
    import sys

    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, "-m", "rlkit", "prompts", "--num-prompts", "4"], stdout=full,
                           stderr=subprocess.PIPE, timeout=120)
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 74 and len(lines) == 1, lines
    assert lines[0].startswith("rlkit: error: cannot write to stdout: no space left on device"), lines


# Tables a model cannot take, one table twice, a reference other than the one that scored the input, and files
# that are not metrics files: each a real table of `work` rewritten with pyarrow (its manifest kept), see `tables`.
TABLE_ROWS = [
    # longer than the model's context (256 positions): the kernel's OOM killer took a 100,000-token completion
    pytest.param([*UPDATE[:4], "{w}/t-long.arrow", *UPDATE[5:]], "completion 100000), more than --policy {pol}'s "
                 "context of 256 tokens (max_position_embeddings)", id="update-longer-than-context"),
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/r-long.arrow", "--out", "{out}"],
                 "row 1 (prompt_id 'train-0-0', sample 1) is 1000", id="score-ref-longer-than-context"),
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/roll.arrow", "--out", "{out}", "--batch-tokens", "16"],
                 "more than --batch-tokens 16, the token budget of one forward batch; raise --batch-tokens",
                 id="score-ref-row-over-batch-tokens"),
    # nothing to train on; token ids outside the vocabulary (99 ids), named by row and column
    pytest.param([*UPDATE[:4], "{w}/t-empty.arrow", *UPDATE[5:]], "every completion is empty (0 tokens in all 8 "
                 "rows): nothing to train on", id="update-all-completions-empty"),
    pytest.param([*UPDATE[:4], "{w}/t-badid.arrow", *UPDATE[5:]], "row 2 (prompt_id 'train-0-1', sample 0), column "
                 "'completion_ids', holds token id 5000, outside --policy {pol}'s vocabulary (0..99)",
                 id="update-token-id-too-large"),
    pytest.param([*UPDATE[:4], "{w}/t-negid.arrow", *UPDATE[5:]], "column 'prompt_ids', holds token id -1",
                 id="update-negative-token-id"),
    # a teacher log-prob above 0, refused as a non-finite one is
    pytest.param([*UPDATE[:4], "{w}/t-teacher.arrow", *UPDATE[5:], "--algo", "distill"], "t-teacher.arrow: row 1 "
                 "(prompt_id 'train-0-0', sample 1) has 0.5 at completion token 2 in teacher_logprobs, above 0, which no "
                 "log-probability is", id="update-teacher-logprob-above-0"),
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/r-badid.arrow", "--out", "{out}"],
                 "row 2 (prompt_id 'train-0-1', sample 0), column 'completion_ids', holds token id 5000, outside "
                 "reference {ref}'s vocabulary", id="score-ref-token-id-too-large"),
    pytest.param(["score-ref", "--ref", "{ref}", "--in", "{w}/r-negid.arrow", "--out", "{out}"],
                 "holds token id -1", id="score-ref-negative-token-id"),
    # one table twice: the same path, links to it, a copy, its rows in another table (cat of it)
    *[pytest.param(["cat", "{w}/roll.arrow", f"{{w}}/{other}", "--out", "{out}"], msg, id=f"cat-twice-{name}")
      for name, other, msg in (("same-path", "roll.arrow", "are one table (given twice)"),
                               ("symlink", "roll-sym.arrow", "are one table (the same file under two names)"),
                               ("hardlink", "roll-hard.arrow", "are one table (the same file under two names)"),
                               ("copy", "roll-copy.arrow", "roll-copy.arrow is a copy of {w}/roll.arrow"),
                               ("rows", "roll-cat.arrow", "row 0 (prompt_id 'train-0-0', sample 0) is already in"))],
    # --ref other than the reference the input was scored against, either way round, or a copy of the other
    pytest.param([*UPDATE[:4], "{w}/scored2.arrow", *UPDATE[5:], "--ref", "{ref}"],
                 "--ref {ref} is not the reference {w}/scored2.arrow was scored against ({w}/ref2)", id="update-ref-mismatch"),
    pytest.param([*UPDATE, "--ref", "{w}/ref2"], "--ref {w}/ref2 is not the reference {w}/scored.arrow was scored "
                 "against ({ref})", id="update-ref-mismatch-reversed"),
    pytest.param([*UPDATE[:4], "{w}/scored2.arrow", *UPDATE[5:], "--ref", "{w}/refcopy"],
                 "is not the reference {w}/scored2.arrow was scored against", id="update-ref-copy-of-other"),
    # report on what is not a metrics file
    pytest.param(["report", "{w}/roll.arrow", "--out", "{out}.png"], "{w}/roll.arrow is an Arrow table (an rlkit "
                 "'rollouts' table), not a metrics file; expected the JSON-lines file", id="report-arrow-table"),
    pytest.param(["report", "{pol}/model.safetensors", "--out", "{out}.png"], "is a binary file, not a metrics file",
                 id="report-binary-file"),
    pytest.param(["report", "{w}/m.jsonl", "{pol}", "--out", "{out}.png"], "{pol} is a directory (an rlkit model "
                 "checkpoint), not a metrics file", id="report-checkpoint-dir"),
    pytest.param(["report", "{w}/plain-dir", "--out", "{out}.png"], "{w}/plain-dir is a directory, not a metrics "
                 "file", id="report-directory"),
    pytest.param(["report", "/dev/zero", "--out", "{out}.png"], "/dev/zero is a device or socket, not a metrics file",
                 id="report-device"),
]


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Table `src` with `edit(columns)` applied (a dict of python lists), written to `dst` with its schema and
    manifest as they were and rlkit's end marker: a table a stage made, then changed."""
    import pyarrow as pa

    t, _ = streams.read_table(src, list(schemas.KINDS))
    cols = {n: t.column(n).to_pylist() for n in t.column_names}
    edit(cols)
    added = [f for f in schemas.TOKEN_FIELDS if f.name in cols and f.name not in t.column_names]  # a column `edit` adds
    with streams.write_table(manifests.read_manifest(src)["kind"], dst, manifests.read_manifest(src),
                               [f for f in t.schema if f.name.startswith("reward/")] + added) as w:
        w.write(pa.record_batch([pa.array(cols[f.name], f.type) for f in w.schema], schema=w.schema))


@pytest.fixture(scope="module")
def tables(work) -> Path:
    """Into `work`: t-*.arrow (from scored.arrow) and r-*.arrow (from roll.arrow): long (a 100,000-token completion
    in row 1), empty (every completion), badid (id 5000 in row 2's completion), negid (-1 in row 3's prompt),
    teacher (teacher_logprobs, row 1's third above 0);
    ref2/ (the policy frozen as it is, fp32: other weights than ref/'s bf16) and scored2.arrow (roll.arrow scored
    by it), refcopy/ (a copy of ref/); roll.arrow again as roll-sym.arrow, roll-hard.arrow, roll-copy.arrow and
    roll-cat.arrow (`cat` of it: the same rows, another manifest); plain-dir/."""
    from rlkit.stages import cat, freeze_ref, score_ref

    w = work
    for src, pre in (("scored", "t"), ("roll", "r")):
        lp = [c for c in ("old_logprobs", "ref_logprobs") if src == "scored" or c == "old_logprobs"]

        def long(c, lp=lp):
            c["completion_ids"][1] = [10] * 100_000
            for k in lp:
                c[k][1] = [-1.0] * 100_000

        def empty(c, lp=lp):
            n = len(c["completion"])
            c.update(completion=[""] * n, completion_ids=[[]] * n, **{k: [[]] * n for k in lp})

        def badid(c):
            c["completion_ids"][2][0] = 5000

        def negid(c):
            c["prompt_ids"][3][1] = -1

        def teacher(c):  # teacher log-probs: the sampler's own, one of row 1's above 0
            c["teacher_logprobs"] = [list(x) for x in c["old_logprobs"]]
            c["teacher_logprobs"][1][2] = 0.5

        for name, edit in (("long", long), ("empty", empty), ("badid", badid), ("negid", negid), ("teacher", teacher)):
            _rewrite(w / f"{src}.arrow", w / f"{pre}-{name}.arrow", edit)
    freeze_ref.run(freeze_ref.FreezeRefConfig(policy=w / "pol", out=w / "ref2", link=True))
    score_ref.run(score_ref.ScoreRefConfig(ref=w / "ref2", inp=str(w / "roll.arrow"), out=w / "scored2.arrow"))
    shutil.copytree(w / "ref", w / "refcopy")
    (w / "roll-sym.arrow").symlink_to(w / "roll.arrow")
    os.link(w / "roll.arrow", w / "roll-hard.arrow")
    shutil.copy(w / "roll.arrow", w / "roll-copy.arrow")
    cat.run(cat.CatConfig(inputs=(str(w / "roll.arrow"),), out=w / "roll-cat.arrow"))
    (w / "plain-dir").mkdir()
    return w


@pytest.mark.parametrize("argv,expect", TABLE_ROWS)
def test_table_rows(tables, argv, expect, capfd):
    _check(tables, argv, capfd, expect.format(w=tables, pol=tables / "pol", ref=tables / "ref", out=tables / "new-out"))


def test_table_checks_accept_what_is_fine(tables):
    """The other side of TABLE_ROWS: a copy of the reference that scored the input (same weights, another path) is
    that reference, also for a table made before score-ref recorded the weights' digest; rows with some empty
    completions train; the same prompt sampled by two runs may share a group in `cat`."""
    import pyarrow as pa

    from rlkit.algorithms.inputs import check_not_all_empty
    from rlkit.errors import RlkitError
    from rlkit.io import shards
    from rlkit.stages.update import check_reference

    raw = manifests.read_manifest(tables / "scored.arrow")
    m = manifests.Manifest.parse(raw)
    for ref in ("ref", "refcopy"):
        check_reference(tables / ref, m, "scored", "scored.arrow")
    old = manifests.Manifest.parse({k: v for k, v in raw.items() if k not in ("reference_digest", "paths")})
    check_reference(tables / "refcopy", old, "scored", "scored.arrow")  # by the input fingerprint score-ref recorded
    with pytest.raises(RlkitError, match="is not the reference"):
        check_reference(tables / "ref", manifests.Manifest.parse({
            k: v for k, v in manifests.read_manifest(tables / "scored2.arrow").items() if k != "reference_digest"}),
            "scored", "scored2.arrow")
    check_reference(tables / "ref2", m, "rollouts", "roll.arrow")  # no reference log-probs in the input: nothing to match

    t, _ = streams.read_table(tables / "scored.arrow", ["scored"])
    some = t.set_column(t.schema.get_field_index("completion_ids"), "completion_ids",
                        pa.array([[]] * 4 + t.column("completion_ids").to_pylist()[4:], pa.list_(pa.int32())))
    check_not_all_empty(some, "some-empty")

    batch, labels = t.to_batches()[0], ["a", "b", "c"]
    d = shards.Duplicates("scored")
    d.check(batch, 0, labels, 0)
    resampled = batch.set_column(batch.schema.get_field_index("completion"), "completion",
                                 pa.array([c + "!" for c in batch.column("completion").to_pylist()]))
    d.check(resampled, 1, labels, 0)  # other samples of the same prompts: one larger group each
    other = resampled.set_column(batch.schema.get_field_index("prompt_id"), "prompt_id",
                                 pa.array([f"other-{p}" for p in batch.column("prompt_id").to_pylist()]))
    with pytest.raises(RlkitError, match="c row 0 has group_id .* update would take the two prompts' samples"):
        d.check(other, 2, labels, 0)


# The process side: paths that are not files (opening a named pipe waits for a writer that may never come)
# and a tracker that calls sys.exit(). A closed pipe, signals and torchrun need real processes: those are in
# tests/unit/test_cli.py and tests/e2e/test_distributed.py.


@pytest.fixture
def specials(tmp_path) -> Path:
    """A named pipe no process writes to, a Unix socket, and a folder holding a named pipe as its config.json."""
    import socket

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ck").mkdir()
    os.mkfifo(tmp_path / "ck" / "config.json")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    yield tmp_path
    sock.close()


FIFO = "fifo is a named pipe (FIFO); expected an Arrow table file or a model directory"
PROCESS_ROWS = [
    pytest.param(["inspect", "{w}/fifo"], FIFO, id="inspect-fifo"),
    pytest.param(["inspect", "{w}/fifo", "--json"], FIFO, id="inspect-fifo-json"),
    pytest.param(["inspect", "{w}/fifo", "--check"], FIFO, id="inspect-fifo-check"),
    pytest.param(["inspect", "{w}/fifo", "--config"], FIFO, id="inspect-fifo-config"),
    pytest.param(["inspect", "/dev/null"], "/dev/null is a character device", id="inspect-char-device"),
    pytest.param(["inspect", "{w}/sock"], "sock is a socket", id="inspect-socket"),
    pytest.param(["inspect", "{w}/ck"], "config.json is a named pipe (FIFO); expected the regular files of a model",
                 id="inspect-folder-holding-a-fifo"),
]


@pytest.mark.parametrize("argv,expect", PROCESS_ROWS)
def test_process_rows(specials, argv, expect, capfd):
    _check(specials, argv, capfd, expect)


# A named pipe as --out ({out} is made one): refused before it is opened (opening a pipe no process reads blocks,
# deaf to Ctrl-C and SIGTERM); streaming into a pipe is what stdout is for.
FIFO_OUT_ROWS = [
    pytest.param(["prompts", "--out", "{out}"], id="prompts"),
    pytest.param(["cat", "{w}/roll.arrow", "--out", "{out}"], id="cat"),
    pytest.param(["rollout", "--policy", "{pol}", "--out", "{out}"], id="rollout"),
    pytest.param(["update", "--policy", "{pol}", "--in", "{w}/scored.arrow", "--out", "{out}"], id="update"),
    pytest.param(["freeze-ref", "--policy", "{pol}", "--out", "{out}"], id="freeze-ref"),
]


@pytest.mark.parametrize("argv", FIFO_OUT_ROWS)
def test_a_named_pipe_as_out(work, argv, capfd):
    os.mkfifo(work / "new-out")
    try:
        _check(work, argv, capfd, "new-out is a named pipe")
    finally:
        (work / "new-out").unlink()


@pytest.mark.parametrize("where", ["init", "log", "finish"])
def test_a_tracker_that_exits_is_warned_about_and_dropped(work, where, monkeypatch, capfd):
    """A tracker that calls sys.exit() when it starts, logs or finishes (a stand-in `trackio` module: the
    third-party failure is the point) is warned about once and dropped: eval finishes, exit 0, and its
    --json on stdout is whole."""
    import importlib.machinery
    import json
    import sys
    import types

    from rlkit.cli import _main

    def call(name: str):
        def fn(*args, **kwargs):
            if name == where:
                raise SystemExit(3)
        return fn

    fake = types.ModuleType("trackio")
    fake.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
    fake.init, fake.log, fake.finish = call("init"), call("log"), call("finish")
    monkeypatch.setitem(sys.modules, "trackio", fake)
    capfd.readouterr()
    rc = _main(["eval", "--policy", str(work / "pol"), "--num-prompts", "2", "--report-to", "trackio", "--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert json.loads(out)["n"] == 2
    warned = [ln for ln in err.splitlines() if "tracker trackio failed (SystemExit: 3)" in ln]
    assert len(warned) == 1 and "Traceback" not in err, err


# Micro-batches (--micro-batch-size, --micro-batch-tokens) on the three training stages: out of range, both given,
# larger than the optimizer step, or a token budget some row (or preference pair, both sides in one forward pass)
# does not fit. {w}/sprefs.arrow: prefs.arrow scored by the reference (what `update --algo dpo` reads).
SFT = ["sft", "--model", "{pol}", "--data", "{w}/sft.arrow", "--out", "{out}"]
RM = ["train-rm", "--model", "{pol}", "--prefs", "{w}/prefs.arrow", "--out", "{out}"]
DPO = ["update", "--algo", "dpo", "--policy", "{pol}", "--in", "{w}/sprefs.arrow", "--out", "{out}"]
_TRAINING = {"sft": SFT, "train-rm": RM, "update": UPDATE}
MICRO_ROWS = [
    *[pytest.param([*argv, flag, value], f"{flag} {value}: expected an integer >= 1", id=f"{stage}{flag}={value}")
      for stage, argv in _TRAINING.items() for flag in ("--micro-batch-size", "--micro-batch-tokens")
      for value in ("0", "-3")],
    *[pytest.param([*argv, "--micro-batch-size", "2", "--micro-batch-tokens", "64"],
                   "--micro-batch-size and --micro-batch-tokens both cut the optimizer step into micro-batches; give "
                   "one of them", id=f"{stage}-both-micro-flags") for stage, argv in _TRAINING.items()],
    pytest.param([*UPDATE, "--minibatch-size", "4", "--micro-batch-size", "5"], "--micro-batch-size 5 is larger than "
                 "--minibatch-size 4, the rows of one optimizer step; expected at most 4", id="update-micro-over-minibatch"),
    pytest.param([*DPO, "--minibatch-size", "2", "--micro-batch-size", "3"], "--micro-batch-size 3 is larger than "
                 "--minibatch-size 2", id="dpo-micro-over-minibatch"),
    pytest.param([*RM, "--batch-size", "3", "--micro-batch-size", "8"], "--micro-batch-size 8 is larger than "
                 "--batch-size 3, the rows of one optimizer step; expected at most 3", id="train-rm-micro-over-batch"),
    # a row the token budget cannot hold: refused, naming it (never dropped)
    pytest.param([*UPDATE, "--micro-batch-tokens", "5"], "scored.arrow: row 0 (prompt_id 'train-0-0', sample 0) is",
                 id="update-row-over-micro-tokens"),
    pytest.param([*UPDATE, "--micro-batch-tokens", "5"], "more than --micro-batch-tokens 5, the token budget of one "
                 "forward batch; raise --micro-batch-tokens to at least", id="update-row-over-micro-tokens-fix"),
    pytest.param([*DPO, "--micro-batch-tokens", "9"], "sprefs.arrow: row 0 (prompt_id", id="dpo-pair-over-micro-tokens"),
    pytest.param([*DPO, "--micro-batch-tokens", "9"], "which run in one forward pass, more than --micro-batch-tokens 9",
                 id="dpo-pair-over-micro-tokens-fix"),
    pytest.param([*SFT, "--micro-batch-tokens", "3"], "sft: example 0 is", id="sft-example-over-micro-tokens"),
    pytest.param([*SFT, "--micro-batch-tokens", "3"], "more than --micro-batch-tokens 3; raise --micro-batch-tokens to "
                 "at least", id="sft-example-over-micro-tokens-fix"),
    pytest.param([*RM, "--micro-batch-tokens", "7"], "which run in one forward pass) is longer than "
                 "--micro-batch-tokens 7; raise --micro-batch-tokens to at least", id="train-rm-pair-over-micro-tokens"),
]


@pytest.fixture(scope="module")
def sprefs(work) -> Path:
    from rlkit.stages import score_ref

    score_ref.run(score_ref.ScoreRefConfig(ref=work / "ref", inp=str(work / "prefs.arrow"), out=work / "sprefs.arrow"))
    return work


@pytest.mark.parametrize("argv,expect", MICRO_ROWS)
def test_micro_batch_rows(sprefs, argv, expect, capfd):
    _check(sprefs, argv, capfd, expect)


# Damaged data files through every stage and task that reads one (rlkit.io.data), and a damaged rubric: (the file,
# its bytes, the command line with {f} for it, what the one error line says). The same reader serves --prompts,
# --data, --from and `data=`.
_JUNK = bytes(range(256)) * 8
DATA_FILES = [
    pytest.param("empty.jsonl", b"", ["eval", "--policy", "{pol}", "--task", "code:data={f}"],
                 "empty.jsonl is empty: expected one JSON object a line", id="eval-code-empty"),
    pytest.param("blank.jsonl", b" \n\n", ["eval", "--policy", "{pol}", "--task", "math:data={f}"],
                 "blank.jsonl is empty: expected one JSON object a line", id="eval-math-blank"),
    pytest.param("notests.jsonl", b'{"question": "def f(): pass"}\n',
                 ["eval", "--policy", "{pol}", "--task", "code:data={f}"],
                 "no column 'tests' for task code (columns: question)", id="eval-code-no-tests"),
    pytest.param("noanswer.jsonl", b'{"question": "1+1"}\n', ["eval", "--policy", "{pol}", "--task", "math:data={f}"],
                 "no column 'answer' for task math (columns: question)", id="eval-math-no-answer"),
    pytest.param("bad.jsonl", b'{"question": "a", "tests": "[]"}\n{"question": \n',
                 ["eval", "--policy", "{pol}", "--task", "code:data={f}"],
                 "bad.jsonl: line 2 is not valid JSON", id="eval-code-bad-line"),
    pytest.param("junk.jsonl", _JUNK, ["rollout", "--policy", "{pol}", "--prompts", "{f}", "--out", "{out}"],
                 "junk.jsonl: line 2 is not UTF-8 text", id="rollout-binary-prompts"),
    pytest.param("empty.json", b"", ["eval", "--policy", "{pol}", "--prompts", "{f}"],
                 "empty.json is empty", id="eval-empty-prompts"),
    pytest.param("header.csv", b"prompt,completion\n", ["sft", "--data", "{f}", "--out", "{out}"],
                 "header.csv: the table has no rows", id="sft-header-only-csv"),
    pytest.param("cut.parquet", b"PAR1" + _JUNK[:100], ["sft", "--data", "{f}", "--out", "{out}"],
                 "cut.parquet is not a Parquet file", id="sft-truncated-parquet"),
    pytest.param("empty.arrow", b"", ["build-prefs", "--from", "{f}", "--out", "{out}"],
                 "empty.arrow is empty: expected an Arrow table", id="build-prefs-empty-arrow"),
    pytest.param("list.jsonl", b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n[]\n',
                 ["build-prefs", "--from", "{f}", "--out", "{out}"], "list.jsonl: line 2 is a JSON list",
                 id="build-prefs-not-an-object"),
    # a string that is not UTF-8 in a later line of a file that is otherwise text (pyarrow reads its bytes as they are)
    pytest.param("str.jsonl", b'{"prompt": "<1+1>="}\n{"prompt": "<2+\xff\xfe>="}\n',
                 ["rollout", "--policy", "{pol}", "--prompts", "{f}", "--out", "{out}"],
                 "str.jsonl: line 2 is not UTF-8 text", id="rollout-prompts-string-not-utf8"),
    pytest.param("str.jsonl", b'{"prompt": "<1+1>=", "completion": "2"}\n{"prompt": "<2+2>=", "completion": "\xff4"}\n',
                 ["sft", "--data", "{f}", "--out", "{out}"], "str.jsonl: line 2 is not UTF-8 text",
                 id="sft-data-string-not-utf8"),
    pytest.param("str.jsonl", b'{"question": "a", "tests": "[]"}\n{"question": "b", "tests": "[]"}\n'
                              b'{"question": "<\xff\xfe>", "tests": "[]"}\n',
                 ["eval", "--policy", "{pol}", "--task", "code:data={f}"], "str.jsonl: line 3 is not UTF-8 text",
                 id="eval-code-string-not-utf8"),
    pytest.param("str.csv", b"prompt,answer\n<1+1>=,2\n<2+\xff\xfe>=,4\n",
                 ["rollout", "--policy", "{pol}", "--prompts", "{f}", "--out", "{out}"],
                 "str.csv: line 3 is not UTF-8 text", id="rollout-csv-field-not-utf8"),
    # a judge's rubric file (rlkit.rubrics.load_rubric) whose score pattern does not compile
    pytest.param("score.toml", b'kind = "score"\ntemplate = "{prompt}{response}"\npattern = "Score: (\\\\d+"\n',
                 ["score-ref", "--judge", "j={ref}:rubric={f}", "--in", "{w}/roll.arrow", "--out", "{out}"],
                 "score.toml: 'pattern' `Score: (\\d+` is not a regular expression (missing ), unterminated subpattern "
                 "at position 7)", id="score-ref-rubric-pattern-does-not-compile"),
]


@pytest.mark.parametrize("name,content,argv,expect", DATA_FILES)
def test_data_file_rows(work, tmp_path, name, content, argv, expect, capfd):
    f = tmp_path / name
    f.write_bytes(content)
    _check(work, [a.replace("{f}", str(f)) for a in argv], capfd, expect)
    (line,) = [ln for ln in _run(work, [a.replace("{f}", str(f)) for a in argv], capfd)[1] if "rlkit: error:" in ln]
    assert str(f) in line and f.read_bytes() == content and list(tmp_path.iterdir()) == [f]


def test_a_data_file_the_library_cannot_parse_is_one_line_in_a_process(work, tmp_path):
    """In a real process: datasets' own error about the file (logged before it raises) is not printed, only
    rlkit's line naming the file and the line; no traceback."""
    from tests.conftest import one_error_line, run_cli

    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"question": "a", "tests": "[]"}\n\x00\xff\n')
    r = run_cli("eval", "--policy", str(work / "pol"), "--task", f"code:data={f}")
    assert r.returncode == 2
    assert one_error_line(r) == f"rlkit: error: {f}: line 2 is not UTF-8 text (a binary file?); expected one JSON " \
                                "object a line"
