"""One flag vocabulary across every command, checked by walking the click parameters of each: one
name per concept, choices as choices, defaults shown, options grouped, old spellings hidden aliases."""

from __future__ import annotations

import re
import typing

import pytest

from rlkit import options
from rlkit.cli import command

from conftest import run_cli

COMMANDS = command().commands
# concept -> the one spelling every command uses, and the spellings no command may show
CANONICAL = {
    "prompts read or written": ("--num-prompts", {"--num", "-n", "--prompts-num", "--num-prompt"}),
    "sequence length": ("--max-length", {"--max-len", "--maxlen", "--max-seq-len"}),
    "warmup as a fraction": ("--warmup-ratio", {"--warmup", "--warmup-frac"}),
    "the model a stage starts from": ("--model", {"--base", "--base-model", "--model-name"}),
}
DTYPES = {"auto", "fp32", "bf16", "fp16", "stored"}


def _long_opts(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}


def _choices(p) -> tuple[str, ...] | None:
    desc = getattr(p, "type_descriptor", None)
    ann = getattr(desc, "annotation", None)
    for a in (ann, *typing.get_args(ann)):
        if typing.get_origin(a) is typing.Literal:
            return typing.get_args(a)
    return None


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_one_name_per_concept(name):
    shown = _long_opts(COMMANDS[name])
    for concept, (_, banned) in CANONICAL.items():
        assert not (shown & banned), f"{name}: {sorted(shown & banned)} for {concept}"
    renamed = set(options.RENAMED.get(name, {}))
    assert not (shown & renamed), f"{name} shows its deprecated spellings {sorted(shown & renamed)}"
    for new in options.RENAMED.get(name, {}).values():
        assert new in shown, f"{name}: the alias target {new} is not an option"


def test_the_canonical_spellings_are_used_where_the_concept_is():
    assert {n for n, c in COMMANDS.items() if "--num-prompts" in _long_opts(c)} >= {"prompts", "eval", "rollout",
                                                                                    "build-prefs"}
    assert "--max-length" in _long_opts(COMMANDS["sft"]) and "--max-length" in _long_opts(COMMANDS["train-rm"])
    assert "--warmup-ratio" in _long_opts(COMMANDS["sft"]) and "--warmup-steps" in _long_opts(COMMANDS["update"])
    assert "--model" in _long_opts(COMMANDS["sft"]) and "--model" in _long_opts(COMMANDS["train-rm"])
    for name in ("rollout", "update", "eval", "build-prefs", "freeze-ref"):
        assert "--policy" in _long_opts(COMMANDS[name]), name


def test_tables_and_directories_are_paths_and_trackers_read_alike():
    """--in/--out/--metrics/--tensorboard are click paths ('-' allowed for a table: stdin/stdout); every stage that
    trains or evaluates takes the same tracking flags, with the same help."""
    from pathlib import Path

    seen = 0
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if set(getattr(p, "opts", ())) & {"--in", "--out", "--metrics", "--tensorboard"}:
                ann = p.type_descriptor.annotation
                assert Path in (ann, *typing.get_args(ann)), (name, p.opts, ann)
                seen += 1
    assert seen > 15
    update = {p.name: p for p in COMMANDS["update"].params}
    for name in ("sft", "train-rm", "eval"):
        params = {p.name: p for p in COMMANDS[name].params}
        for flag in ("metrics", "report_to", "run_name", "project", "tensorboard"):
            assert params[flag].help == update[flag].help, (name, flag)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_choices_are_choices_and_every_default_is_shown(name):
    for p in COMMANDS[name].params:
        if "--dtype" in getattr(p, "opts", ()):
            assert _choices(p) and set(_choices(p)) <= DTYPES, (name, _choices(p))
        if p.name in ("algo", "kl_estimator", "kl_in", "loss_agg", "old_logprobs", "split"):
            assert _choices(p), (name, p.name)
        if not p.required:
            assert getattr(p, "show_default", True) is not False, (name, p.name)


def test_algo_choices_are_the_registry():
    from rlkit import algorithms

    (algo,) = [p for p in COMMANDS["update"].params if p.name == "algo"]
    assert _choices(algo) == tuple(algorithms.names())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_long_option_lists_are_grouped(name):
    shared = {"_config", "_log_level", "_quiet"}
    loose = [p.name for p in COMMANDS[name].params
             if p.param_type_name == "option" and p.name not in shared and not getattr(p, "rich_help_panel", None)]
    assert not loose, f"{name}: no --help panel for {loose} (give the option(...) of its config field a panel)"


def test_old_spellings_still_work_with_one_deprecation_line(tmp_path):
    said = []
    got = options.modernize(["eval", "--policy", "p", "-n", "3", "--num=4", "--", "--num"], said.append)
    assert got == ["eval", "--policy", "p", "--num-prompts", "3", "--num-prompts=4", "--", "--num"]
    assert said == ["rlkit eval: -n is deprecated; use --num-prompts", "rlkit eval: --num is deprecated; use --num-prompts"]
    said.clear()
    got = options.modernize(["rollout", "--dtype", "bfloat16", "--seed", "float16"], said.append)
    assert got == ["rollout", "--dtype", "bf16", "--seed", "float16"] and len(said) == 1
    assert options.modernize(["update", "--num", "3"], said.append) == ["update", "--num", "3"]  # not an alias there

    r = run_cli("prompts", "--num", "3", "--out", str(tmp_path / "p.arrow"))
    assert r.returncode == 0 and r.stderr.decode().splitlines() == ["rlkit prompts: --num is deprecated; use --num-prompts"]
    r = run_cli("rollout", "--policy", str(tmp_path), "--dtype", "fp8", "--out", str(tmp_path / "r.arrow"))
    assert r.returncode == 2 and "'fp8' is not one of 'auto', 'fp32', 'bf16', 'fp16'" in r.stderr.decode()


def _help(name: str, capsys, monkeypatch) -> str:
    from rlkit.cli import _main

    monkeypatch.setenv("COLUMNS", "400")
    capsys.readouterr()
    assert _main([name, "--help"] if name else ["--help"]) == 0
    return capsys.readouterr().out


def _squeezed(text: str) -> str:
    return re.sub(r"[\s│]", "", text)  # a wrapped help line is one line again


@pytest.mark.parametrize("name", ["", *sorted(COMMANDS)])
def test_help_prints_every_bracket_of_the_source_as_written(name, capsys, monkeypatch):
    """rich would read `rlkit[track]` or `[@SPLIT]` as markup and drop it: every bracketed word of a help text,
    as the source has it (typer's own fresh command tree, before rlkit touches it), is on the screen."""
    import typer

    from rlkit.cli import app

    fresh = typer.main.get_command(app)
    cmd = fresh.commands[name] if name else fresh
    texts = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
    if not name:
        texts += [c.help.split("\n\n")[0] for c in fresh.commands.values() if c.help]
    words = {w for t in texts for w in re.findall(r"[^\s\[\]]*(?:\[[^\[\]\s]*\])+[^\s\[\]]*", t)}
    shown = _squeezed(_help(name, capsys, monkeypatch))
    assert all(_squeezed(w) in shown for w in words), sorted(w for w in words if _squeezed(w) not in shown)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_flags_show_no_value_and_string_options_their_choices(name, capsys, monkeypatch):
    out = _help(name, capsys, monkeypatch)
    assert "<bool>" not in out  # a flag takes no value (`--force true` is refused)
    assert re.search(r"--log-level\s+<debug\|info\|warning\|error>", out)
    params = {p.name: p for p in COMMANDS[name].params}
    if "device" in params:
        assert "<auto|cpu|cuda|cuda:N>" in out
    for p in ("engine", "vllm_lora", "_log_level"):
        if p in params:
            assert _choices(params[p]), (name, p)
