"""The CLI as users run it: flags map into configs, and bad input gives one clear line, a non-zero
exit code, nothing written at --out and nothing existing damaged."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlkit import algorithms
from rlkit.cli import app

from conftest import (
    default_signals,
    fast_rlkit_cmd,
    fork_server_ready,
    one_error_line,
    rlkit_cmd,
    run_cli,
    run_cli_inproc,
)

runner = CliRunner()


def _capture(monkeypatch, module):
    seen = []
    monkeypatch.setattr(module, "run", lambda cfg: seen.append(cfg))
    return seen


def test_sft_flags_map_into_the_config(monkeypatch, tmp_path):
    from rlkit.stages import sft

    seen = _capture(monkeypatch, sft)
    r = runner.invoke(app, ["sft", "--out", str(tmp_path / "o"), "--num-examples", "123", "--lr", "0.01",
                            "--layers", "2", "--hidden", "64", "--batch-tokens", "777", "--seed", "5", "--force"])
    assert r.exit_code == 0, r.output
    (cfg,) = seen
    assert (cfg.num_examples, cfg.lr, cfg.batch_tokens, cfg.seed, cfg.force) == (123, 0.01, 777, 5, True)
    assert (cfg.tiny.layers, cfg.tiny.hidden, cfg.tiny.heads, cfg.tiny.intermediate) == (2, 64, 2, 256)
    assert cfg.model == "tiny" and cfg.task is None and cfg.data is None


def test_sft_rejection_sampling_flags_map_into_the_config(monkeypatch, tmp_path):
    from rlkit.stages import sft

    seen = _capture(monkeypatch, sft)
    r = runner.invoke(app, ["sft", "--out", str(tmp_path / "o"), "--data", "r.arrow", "--min-reward", "-0.5",
                            "--best-of", "--reward", "verifier=1", "--reward", "rm=0.5"])
    assert r.exit_code == 0, r.output
    (cfg,) = seen
    assert (cfg.data, cfg.min_reward, cfg.best_of, cfg.reward) == ("r.arrow", -0.5, True, ("verifier=1", "rm=0.5"))
    assert runner.invoke(app, ["sft", "--out", str(tmp_path / "o")]).exit_code == 0
    assert (seen[-1].min_reward, seen[-1].best_of, seen[-1].reward) == (None, False, ())


def test_freeze_ref_and_eval_flags(monkeypatch, tmp_path):
    from rlkit.stages import eval as eval_stage
    from rlkit.stages import freeze_ref

    seen = _capture(monkeypatch, freeze_ref)
    assert runner.invoke(app, ["freeze-ref", "--policy", "p", "--out", "r", "--dtype", "fp16"]).exit_code == 0
    assert seen[0].dtype == "fp16" and str(seen[0].policy) == "p"
    seen = _capture(monkeypatch, eval_stage)
    r = runner.invoke(app, ["eval", "--policy", "p", "--task", "arithmetic:terms=2-2", "--num-prompts", "7", "--json"])
    assert r.exit_code == 0, r.output
    assert seen[0].num == 7 and seen[0].as_json and seen[0].task == "arithmetic:terms=2-2"


def test_update_flags_map_into_the_rl_config(monkeypatch, tmp_path):
    from rlkit.stages import update

    seen = _capture(monkeypatch, update)
    base = ["update", "--policy", "p", "--out", str(tmp_path / "o")]
    assert runner.invoke(app, base).exit_code == 0
    rl = update.resolve(seen[-1]).rl  # what `run` trains with and records
    assert (rl.kl_in, rl.kl_estimator, rl.dual_clip) == ("loss", "k3+", 3.0)  # the forward KL's gradient in the loss
    assert runner.invoke(app, [*base, "--algo", "ppo"]).exit_code == 0
    rl = update.resolve(seen[-1]).rl
    assert (rl.kl_in, rl.kl_estimator) == ("reward", "k1")
    assert runner.invoke(app, [*base, "--dual-clip", "0", "--kl-estimator", "k2"]).exit_code == 0
    assert (seen[-1].rl.dual_clip, seen[-1].rl.kl_estimator) == (None, "k2")
    assert runner.invoke(app, [*base, "--dual-clip", "2.5", "--algo", "dpo", "--beta", "0.3"]).exit_code == 0
    assert (seen[-1].rl.dual_clip, update.resolve(seen[-1]).rl.beta) == (2.5, 0.3)  # a flag beats the default
    r = runner.invoke(app, ["update", "--help"], env={"COLUMNS": "400"})
    assert "k3+" in r.output and "nats per sequence" in r.output


@pytest.mark.parametrize("algo", algorithms.names())
def test_update_from_python_gets_the_cli_defaults(monkeypatch, tmp_path, algo):
    """`run(UpdateConfig(...))` trains with exactly what `rlkit update --algo NAME` does: the command adds no
    default of its own, and both resolve to the algorithm's registry defaults (what the manifest records)."""
    from rlkit.algorithms.config import RLConfig
    from rlkit.stages import update

    seen = _capture(monkeypatch, update)
    assert runner.invoke(app, ["update", "--policy", "p", "--out", str(tmp_path / "o"), "--algo", algo]).exit_code == 0
    api = update.UpdateConfig(policy=Path("p"), out=tmp_path / "o", rl=RLConfig(algo=algo))
    assert seen[-1] == api
    cli, py = update.resolve(seen[-1]), update.resolve(api)
    assert cli == py and update.resolve(py) == py  # resolving twice changes nothing
    d = algorithms.defaults(algo)
    assert (py.rl.beta, py.rl.kl_in, py.rl.loss_agg, py.rl.clip_low, py.rl.clip_high) == (
        d.beta, d.kl_in, d.loss_agg, d.clip_low, d.clip_high)
    assert None not in (py.rl.kl_estimator, py.rl.beta, py.rl.kl_in, py.rl.loss_agg, py.rl.clip_low, py.rl.clip_high)


def test_unknown_task(tmp_path):
    line = one_error_line(run_cli("prompts", "--task", "chess", "--out", str(tmp_path / "p.arrow")))
    assert "unknown task 'chess'" in line and "arithmetic" in line
    assert not os.listdir(tmp_path)


def test_missing_file_and_missing_policy(tmp_path):
    line = one_error_line(run_cli("inspect", str(tmp_path / "nothing.arrow")))
    assert "no such file" in line
    line = one_error_line(run_cli("freeze-ref", "--policy", str(tmp_path / "nope"), "--out", str(tmp_path / "r")))
    assert "policy directory" in line and "not found" in line
    assert not (tmp_path / "r").exists()


def test_wrong_kind_missing_column_and_empty_table(tmp_path, sft_dir):
    import pyarrow as pa

    from rlkit.io import manifests, streams

    prefs = tmp_path / "prefs.arrow"
    with streams.write_table("prefs", prefs, manifests.make_manifest("prefs", "build-prefs", {}, {})) as w:
        w.write({"prompt_id": ["a"], "prompt": ["<1+1>="], "chosen": ["2"], "rejected": ["3"], "split": ["train"]})
    line = one_error_line(run_cli("eval", "--policy", str(sft_dir), "--prompts", str(prefs)))
    assert "is a 'prefs' table, expected a 'prompts' table" in line

    nocol = tmp_path / "nocol.arrow"
    with pa.ipc.new_stream(str(nocol), pa.schema([("prompt_id", pa.string()), ("text", pa.string())])) as w:
        w.write_table(pa.table({"prompt_id": ["a"], "text": ["x"]}))
    line = one_error_line(run_cli_inproc("eval", "--policy", str(sft_dir), "--prompts", str(nocol)))
    assert "missing column 'prompt'" in line

    empty = tmp_path / "empty.arrow"
    r = run_cli_inproc("prompts", "--num-prompts", "1", "--out", str(empty))
    assert r.returncode == 0
    with streams.write_table("prompts", empty, manifests.make_manifest("prompts", "prompts", {}, {})):
        pass
    line = one_error_line(run_cli_inproc("eval", "--policy", str(sft_dir), "--prompts", str(empty)))
    assert "has no rows" in line
    line = one_error_line(run_cli_inproc("sft", "--data", str(empty), "--out", str(tmp_path / "s")))
    assert "expected a 'sft' table" in line
    assert not (tmp_path / "s").exists()


def test_out_pointing_at_a_foreign_file_is_left_alone(tmp_path, sft_dir):
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    line = one_error_line(run_cli("prompts", "--out", str(notes)))
    assert "not an rlkit table; refusing to overwrite" in line
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("precious")
    line = one_error_line(run_cli("freeze-ref", "--policy", str(sft_dir), "--out", str(d)))
    assert "not an rlkit checkpoint" in line
    assert notes.read_text() == "precious" and os.listdir(d) == ["thesis.tex"]


def test_debug_shows_the_traceback(tmp_path):
    r = run_cli("prompts", "--task", "chess", "--out", str(tmp_path / "p.arrow"), "--debug")
    assert r.returncode != 0 and b"Traceback" in r.stderr


def test_refuses_to_write_a_table_to_a_terminal(monkeypatch):
    import sys as _sys

    from rlkit.errors import RlkitError
    from rlkit.io import streams

    monkeypatch.setattr(_sys.stdout, "isatty", lambda: True)
    with pytest.raises(RlkitError, match="refusing to write an Arrow table to the terminal"):
        streams.resolve_out(None)


def test_prompts_stream_through_a_pipe_into_eval(tmp_path, sft_dir):
    p1 = subprocess.Popen([*fast_rlkit_cmd(), "prompts", "--split", "heldout", "--num-prompts", "40"], stdout=subprocess.PIPE)
    r = subprocess.run([*fast_rlkit_cmd(), "eval", "--policy", str(sft_dir), "--prompts", "-", "--json"],
                       stdin=p1.stdout, capture_output=True)
    p1.stdout.close()
    assert p1.wait() == 0
    assert r.returncode == 0, r.stderr
    import json

    res = json.loads(r.stdout)
    assert res["n"] == 40 and res["n_scored"] == 40 and 0.0 <= res["accuracy"] <= 1.0


def test_a_failed_upstream_fails_the_downstream(tmp_path, sft_dir):
    p1 = subprocess.Popen([*fast_rlkit_cmd(), "prompts", "--task", "chess"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    r = subprocess.run([*fast_rlkit_cmd(), "eval", "--policy", str(sft_dir), "--prompts", "-", "--json"],
                       stdin=p1.stdout, capture_output=True)
    p1.stdout.close()
    assert p1.wait() != 0
    line = one_error_line(r)
    assert "stdin holds no Arrow stream" in line


@pytest.mark.parametrize("start", ["fresh", "fork-server"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_a_write_leaves_nothing(tmp_path, sig, start):
    """In a process of its own, and through the tests' fork server, which hands the signal on."""
    out = tmp_path / "big.arrow"
    if start == "fork-server":
        fork_server_ready()  # else its client would start a fresh interpreter, and this case test nothing new
    cmd = rlkit_cmd() if start == "fresh" else fast_rlkit_cmd()
    p = subprocess.Popen([*cmd, "prompts", "--task", "arithmetic:terms=3-6,max=99", "--num-prompts", "3000000",
                          "--out", str(out)], stderr=subprocess.PIPE, preexec_fn=default_signals)
    deadline = time.time() + 60
    while time.time() < deadline and not any(n.startswith(".big.arrow.tmp") for n in os.listdir(tmp_path)):
        time.sleep(0.05)
    assert any(n.startswith(".big.arrow.tmp") for n in os.listdir(tmp_path)), "writer never started"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert b"interrupted" in err and os.listdir(tmp_path) == []


def test_interrupted_sft_keeps_the_existing_checkpoint(tmp_path, sft_dir):
    import shutil

    from rlkit.io import fingerprints

    out = tmp_path / "sft"
    shutil.copytree(sft_dir, out)
    before = fingerprints.fingerprint(out)
    p = subprocess.Popen([*rlkit_cmd(), "sft", "--out", str(out), "--num-examples", "200000", "--force"],
                         stderr=subprocess.PIPE, preexec_fn=default_signals)
    time.sleep(6)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert fingerprints.fingerprint(out) == before and sorted(os.listdir(tmp_path)) == ["sft"]


@pytest.mark.parametrize("producer", ["prompts", "cat"])
def test_a_reader_that_closes_the_pipe_early_ends_the_stage_with_141(tmp_path, producer):
    """`rlkit prompts | head -c 100` (and `cat`): the shell's code for SIGPIPE and one line, not click's silent
    exit 1, and no "Exception ignored ... BrokenPipeError" at exit. The table is bigger than a pipe holds."""
    args = ["prompts", "--num-prompts", "5000"]
    if producer == "cat":
        from rlkit.stages import prompts

        prompts.run(prompts.PromptsConfig(out=tmp_path / "p.arrow", num=5000))
        args = ["cat", str(tmp_path / "p.arrow")]
    p = subprocess.Popen([*rlkit_cmd(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(p.stdout.read(100)) == 100
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert err.strip().splitlines() == ["rlkit: output pipe closed by the downstream stage"], err


def test_version():
    r = subprocess.run([sys.executable, "-m", "rlkit", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("rlkit ")


def test_stray_stdout_writes_cannot_corrupt_a_streamed_table(tmp_path):
    """Once a stage claims stdout for its table, prints from the process or from processes it starts
    (vLLM's engine workers log to stdout) go to stderr and the downstream reader gets a clean table."""
    code = (
        "import os, sys\n"
        "from rlkit.io import manifests, streams\n"
        "out = streams.resolve_out(None)\n"
        "print('noise from the stage')\n"
        "os.system('echo noise from a child process')\n"
        "m = manifests.make_manifest('prompts', 'prompts', {}, {})\n"
        "with streams.write_table('prompts', out, m) as w:\n"
        "    w.write({'prompt_id': ['a'], 'prompt': ['1+1='], 'answer': ['2'], 'split': ['train']})\n"
        "print('more noise')\n"
    )
    producer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    table, err = producer.communicate(timeout=120)
    assert producer.returncode == 0, err
    assert b"noise from the stage" in err and b"noise from a child process" in err and b"more noise" in err
    p = tmp_path / "t.arrow"
    p.write_bytes(table)
    from rlkit.io import streams

    t, _ = streams.read_table(p, ["prompts"])
    assert t.column("prompt").to_pylist() == ["1+1="]


# ---------------------------------------------------------------- usage errors: click's own message, exit 2


def _usage_error(r: subprocess.CompletedProcess) -> str:
    """A bad command line: exit 2, click's usage message (`Usage: ...`, the --help hint, `Error: ...`; click
    gives a missing option value the last line alone), no traceback."""
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert "Traceback" not in err and "unexpected" not in err and "rlkit: error" not in err, err
    assert err.startswith(("Usage: rlkit", "Error: ")) and "Error: " in err, err
    return err


@pytest.mark.parametrize("args, said", [
    (["rollout", "--num-prompt", "3"], ["No such option: --num-prompt", "Did you mean --num-prompts?",
                                        "Try 'rlkit rollout --help' for help."]),
    (["rollout", "--n", "abc"], ["Invalid value for '--n'", "valid integer", "'abc'"]),
    (["update", "--out", "o"], ["Missing option '--policy'", "Try 'rlkit update --help'"]),
    (["update", "--policy", "p", "--out", "o", "--epochs", "0"], ["Invalid value for '--epochs'", "Usage: rlkit update"]),
    (["sft", "--lr"], ["Option '--lr' requires an argument"]),
    (["rollot"], ["No such command 'rollot'", "Did you mean 'rollout'?"]),
])
def test_usage_errors_are_clicks_message_and_exit_2(tmp_path, args, said):
    err = _usage_error(run_cli(*args, cwd=tmp_path))
    for s in said:
        assert s in err, (s, err)
    assert os.listdir(tmp_path) == []


def test_choice_options_are_checked_by_click_naming_the_option():
    """--algo, --dtype, --kl-in ... are Literal choices: --help lists them, and a bad value is click's usage
    error naming the option and the choices (exit 2), before anything runs."""
    from rlkit.cli import command

    choice = {(n, p.name) for n, c in command().commands.items() for p in c.params if p.type_descriptor.is_choice}
    assert {("update", "algo"), ("update", "kl_in"), ("update", "loss_agg"), ("sft", "dtype"), ("rollout", "dtype"),
            ("score-ref", "dtype"), ("freeze-ref", "dtype"), ("prompts", "split")} <= choice
    err = _usage_error(run_cli("update", "--policy", "p", "--out", "o", "--kl-in", "both"))
    assert "Invalid value for '--kl-in'" in err and "'both' is not one of 'loss', 'reward'" in err


def test_help_and_version_exit_0():
    for args in (["--help"], ["update", "--help"], ["--version"]):
        r = run_cli(*args)
        assert r.returncode == 0 and r.stdout and not r.stderr, (args, r.stderr)


def test_typer_is_the_pinned_version():
    """The usage-error handling above follows typer's internals (0.29 raises the exceptions of its own copy of
    click): the suite must run on the typer that constraints.txt pins, so an upgrade is a deliberate change."""
    from importlib.metadata import version

    from conftest import REPO

    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert version("typer") == pins["typer"].strip()


# ---------------------------------------------------------------- NaN and inf are refused for every float option


def _float_params():
    """(command, parameter) for every option whose annotation holds a float, found apart from rlkit.cli's own test."""
    import typing

    from rlkit.cli import command

    def has_float(a):
        return a is float or any(has_float(x) for x in typing.get_args(a))

    group = command()
    for cmd in (group, *group.commands.values()):
        for p in cmd.params:
            if has_float(p.type_descriptor.annotation):
                yield cmd, p


def test_every_float_option_refuses_nan_and_inf():
    import typer

    found = list(_float_params())
    names = {(c.name, p.opts[0]) for c, p in found}
    assert len(found) >= 25 and {("update", "--lr"), ("update", "--clip-high"), ("rollout", "--temperature"),
                                 ("sft", "--lr"), ("train-rm", "--margin")} <= names, names
    for cmd, p in found:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(typer.BadParameter, match=f"'{bad}' is not a finite number"):
                p.callback(None, p, float(bad))
        assert p.callback(None, p, 0.25) == 0.25 and p.callback(None, p, None) is None, (cmd.name, p.opts)


@pytest.mark.parametrize("args, option", [
    (["update", "--policy", "p", "--out", "o", "--lr", "nan"], "--lr"),
    (["update", "--policy", "p", "--out", "o", "--clip-high", "NaN"], "--clip-high"),
    (["rollout", "--policy", "p", "--temperature", "nan"], "--temperature"),
    (["sft", "--out", "o", "--warmup-ratio", "inf"], "--warmup-ratio"),
])
def test_nan_and_inf_options_are_refused_before_any_work(tmp_path, args, option):
    """Before anything is read or written: the missing policy `p` would otherwise be the error."""
    err = _usage_error(run_cli(*args, cwd=tmp_path))
    assert f"Invalid value for '{option}'" in err and "is not a finite number" in err, err
    assert os.listdir(tmp_path) == []


def test_ranks_that_fail_together_agree_on_one_line_and_one_code(monkeypatch):
    """Under torchrun every failing rank exits with the highest code among them and rank 0 alone prints (the
    line of the rank with that code); a rank failing alone (its peers still working) prints its own line,
    marked with its rank, after a bounded wait. A real TCPStore stands in for torchrun's."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from rlkit.training import distributed

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # as torchrun sets it: its agent's store

    def ranks(run_id: str, codes: dict[int, int], world: int = 2) -> dict[int, tuple[int, str | None]]:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        got = {}

        def one(r):
            got[r] = distributed.agree_on_failure(codes[r], "rlkit: error: ", f"what rank {r} saw", wait=1.0,
                                                  rank=r, world=world)

        threads = [threading.Thread(target=one, args=(r,)) for r in codes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return got

    # a truncated stream on rank 0 (3), the same input as a plain bad input on rank 1 (2): 3 everywhere
    assert ranks("a", {0: 3, 1: 2}) == {0: (3, "rlkit: error: what rank 0 saw"), 1: (3, None)}
    # the highest code is rank 1's: rank 0 prints rank 1's line
    assert ranks("b", {0: 2, 1: 71}) == {0: (71, "rlkit: error: rank 1: what rank 1 saw"), 1: (71, None)}
    # rank 1 fails alone: its own line and code, once the wait is over
    t0 = time.monotonic()
    assert ranks("c", {1: 2}) == {1: (2, "rlkit: error: rank 1: what rank 1 saw")}
    assert time.monotonic() - t0 < 5
    # a launcher without a store, before the process group is up: every rank reports alone, at once
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    t0 = time.monotonic()
    assert ranks("d", {0: 2}) == {0: (2, "rlkit: error: what rank 0 saw")}
    assert time.monotonic() - t0 < 0.5
