"""Each stage option is declared once, on its config dataclass field (rlkit.stage_options): the command, its
--help panels and the --config loader all read that one declaration, and nothing else names the option."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from rlkit import options, stage_options
from rlkit.cli import app, command
from rlkit.stage_options import Group, nested, option

# every command is made from its config (stage_options.command)
CONVERTED = ("prompts", "sft", "build-prefs", "train-rm", "freeze-ref", "rollout", "score-ref", "update", "eval", "cat",
             "inspect", "report", "plan")
SHARED = {"_config", "_log_level", "_quiet"}  # --config FILE, --log-level, -q: every command's, added by rlkit.cli
CALLBACKS = {c.name: c.callback for c in app.registered_commands}


def test_every_command_is_made_from_its_config():
    assert set(CONVERTED) == set(command().commands)


def _config(name: str) -> type:
    cfg = getattr(CALLBACKS[name], "config", None)
    assert cfg is not None, f"rlkit {name}: its command is not made from its config (stage_options.command)"
    return cfg


def _fields_with_options(cls: type) -> dict[str, object]:
    return {f.name: f.metadata[stage_options.OPTION] for f in dataclasses.fields(cls) if stage_options.OPTION in f.metadata}


@pytest.mark.parametrize("name", CONVERTED)
def test_every_option_is_one_config_field_and_every_option_field_one_option(name):
    cls = _config(name)
    plan = stage_options.params(cls)
    click_params = [p for p in command().commands[name].params if p.name not in SHARED]
    assert [p.name for p in click_params] == [p.name for p in plan]  # the same options, in the same order
    by_field: dict[str, list[str]] = {}
    for p in plan:
        by_field.setdefault(p.field.partition(".")[0], []).append(p.name)
    for field_name, meta in _fields_with_options(cls).items():
        made = by_field.pop(field_name, [])
        if isinstance(meta, Group):
            assert made == list(meta.options), (name, field_name, made)
        else:
            assert len(made) == 1, (name, field_name, made)
    assert not by_field, f"{name}: options from no field: {by_field}"


@pytest.mark.parametrize("name", CONVERTED)
def test_the_stage_module_declares_no_option_outside_its_config(name):
    """No hand-written typer signature beside the config: the module has no typer.Option, typer.Argument or
    Annotated parameter, and its command is the generated one."""
    fn = CALLBACKS[name]
    source = inspect.getsource(inspect.getmodule(_config(name)))
    for word in ("typer.Option(", "typer.Argument(", "Annotated[", "def command("):
        assert word not in source, f"rlkit {name}: {word} in {fn.__module__}"


@pytest.mark.parametrize("name", CONVERTED)
def test_the_command_line_defaults_are_the_config_defaults(name):
    """Parsed by click with only the required values given, the command line makes exactly the config Python
    gets with those values: no default is declared twice (a nested config's flags rebuild its defaults too)."""
    cls = _config(name)
    hints = typing.get_type_hints(cls)
    args: list[str] = []
    required: dict[str, object] = {}
    for p in stage_options.params(cls):
        if p.default is not inspect.Parameter.empty:
            continue
        t = hints[p.field]
        many = typing.get_origin(t) is tuple
        required[p.field] = ("x.arrow",) if many else (Path("x") if t is Path else "x")
        flag = next((o for o in _click(name, p.name).opts if o.startswith("--")), None)
        args += ["x.arrow"] if many else ([flag, "x"] if flag else ["x"])
    cmd = command().commands[name]
    with cmd.make_context(name, args) as ctx:
        got = stage_options.config_from(cls, ctx.params)
    assert got == cls(**required)


def _click(name: str, param: str):
    return next(p for p in command().commands[name].params if p.name == param)


@pytest.mark.parametrize("name", CONVERTED)
def test_the_help_panel_is_the_fields(name):
    """Each option's --help panel comes with its declaration (on typer's own tree, before rlkit.cli touches it),
    and is one of the panels options.PANELS lists."""
    fresh = typer.main.get_command(app).commands[name]
    for p in fresh.params:
        if p.param_type_name == "option":
            assert p.rich_help_panel in options.PANELS, (name, p.name, p.rich_help_panel)


def test_the_mechanism_refuses_an_option_declared_twice():
    @dataclass(frozen=True)
    class Twice:
        a: int = option(1, "--a", name="x", panel="Data", help="a")
        b: int = option(2, "--b", name="x", panel="Data", help="b")

    with pytest.raises(TypeError, match="two fields are the option 'x'"):
        stage_options.params(Twice)
    with pytest.raises(TypeError, match="shared alias"):
        option(0, options.Seed, help="its own help as well")
    with pytest.raises(TypeError, match="must be an option"):
        Group(Twice, a=1)


@dataclass(frozen=True)
class _Inner:
    k: int = 3


@dataclass(frozen=True)
class _Demo:
    inp: str | None = option(None, options.InTable)
    names: tuple[str, ...] = option((), "--name", panel="Data", help="repeatable")
    verify: bool = option(True, options.NoVerify, invert=True)
    inner: _Inner = nested(Group(_Inner, k=option(3, "--k", min=1, panel="Data", help="k")))
    fixed: int = 7  # no option


def test_values_turn_into_the_fields_types():
    """A repeatable option's list is the field's tuple, a path the string a str field holds, an inverted flag
    its negation, a nested config rebuilt from its flags; a plain field keeps its default."""
    plan = stage_options.params(_Demo)
    assert [p.name for p in plan] == ["inp", "names", "no_verify", "k"]
    assert [p.default for p in plan] == [None, None, False, 3]
    got = stage_options.config_from(_Demo, {"inp": Path("r.arrow"), "names": ["a", "b"], "no_verify": True, "k": 5})
    assert got == _Demo(inp="r.arrow", names=("a", "b"), verify=False, inner=_Inner(5))
    assert stage_options.config_from(_Demo, {"inp": None, "names": None, "no_verify": False, "k": 3}) == _Demo()


# ---------------------------------------------------------------- every float option has a range (stage_options.FLOAT_BOUNDS)


def _float_options() -> list[tuple[str, str]]:
    """(command, long flag) of every option of every command whose value is (or holds) a float."""
    return [(name, _long(p)) for name, cmd in sorted(command().commands.items()) for p in cmd.params
            if p.param_type_name == "option" and stage_options._holds_float(p.type_descriptor.annotation)]


def _long(p) -> str:
    return next(o for o in p.opts if o.startswith("--"))


def _required_args(name: str) -> list[str]:
    """Values for the command's required options and arguments, so that only the option under test is wrong."""
    args: list[str] = []
    for p in command().commands[name].params:
        if p.required:
            args += ["x"] if p.param_type_name == "argument" else [_long(p), "x"]
    return args


def test_every_float_option_has_a_range_and_its_default_is_in_it():
    found = _float_options()
    flags = {f for _, f in found}
    assert len(found) >= 30 and {"--lr", "--dist-timeout", "--temperature", "--top-p", "--reward-timeout"} <= flags
    assert flags - set(stage_options.FLOAT_BOUNDS) == set(), "a float option without a range in stage_options.FLOAT_BOUNDS"
    assert set(stage_options.FLOAT_BOUNDS) - flags == set(), "a range for no option"
    for name, flag in found:
        (p,) = [p for p in command().commands[name].params if flag in p.opts]
        b = stage_options.FLOAT_BOUNDS[flag]
        assert b.low < b.high and (p.default is None or b.holds(p.default)), (name, flag, p.default)


BAD_FLOATS = ("1e300", "-1e300", "nan", "inf", "-inf")


@pytest.mark.parametrize("name,flag", _float_options())
def test_every_float_option_refuses_what_is_out_of_its_range(name, flag, tmp_path):
    """1e300, -1e300 (every range starts above it), NaN, inf and the values just outside each end: exit 2 and
    click's one error line naming the flag, before anything is read or written. Each end the range includes
    parses."""
    from tests.conftest import run_cli_inproc

    b = stage_options.FLOAT_BOUNDS[flag]
    assert b.low > -1e300  # so that -1e300 is out of every range (--min-reward's goes below 0: rewards can)
    outside = [f"{b.low:g}" if b.low_open else repr(b.low - max(abs(b.low), 1) * 1e-6),
               f"{b.high:g}" if b.high_open else repr(b.high * (1 + 1e-6))]
    stage = "update" if name == "plan" else name  # plan takes the stage's own options
    base = [stage, *_required_args(stage)]
    for bad in (*BAD_FLOATS, *outside):
        r = run_cli_inproc(*(["plan"] if name == "plan" else []), *base, f"{flag}={bad}", cwd=tmp_path)
        err = r.stderr.decode()
        errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
        assert r.returncode == 2 and "Traceback" not in err and "rlkit: error" not in err, (flag, bad, err)
        assert len(errors) == 1 and f"'{flag}'" in errors[0], (flag, bad, err)
        assert "not a finite number" in errors[0] or "is not" in errors[0] or "Input should be" in errors[0], err
    assert list(tmp_path.iterdir()) == []
    cmd = command().commands[name]
    for good in ([] if b.low_open else [b.low]) + ([] if b.high_open else [b.high]):
        with cmd.make_context(name, [*_required_args(name), flag, repr(good)]) as ctx:
            assert any(v == good for v in ctx.params.values()), (flag, good)


def test_a_float_out_of_range_in_a_config_file_is_refused_naming_the_file(tmp_path):
    from tests.conftest import run_cli_inproc

    cfg = tmp_path / "c.toml"
    cfg.write_text("[sft]\ndist_timeout = 1e300\n")
    r = run_cli_inproc("sft", "--out", str(tmp_path / "o"), "--config", str(cfg))
    (line,) = [ln for ln in r.stderr.decode().splitlines() if ln.startswith("Error:")]
    assert r.returncode == 2 and "'--dist-timeout': 1e+300 is not a number of minutes in (0, 1e+07]" in line
    assert f"(from --config {cfg})" in line and sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_a_dist_timeout_out_of_range_is_refused_before_the_process_group(tmp_path):
    """A rank launched by torchrun (WORLD_SIZE 2) refuses --dist-timeout 1e300 as one process does, at once:
    no process group is joined (its peer never comes, so joining would wait), no OverflowError from torch."""
    from tests.conftest import run_cli

    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    for extra in ({}, env):
        r = run_cli("sft", "--out", str(tmp_path / "o"), "--dist-timeout", "1e300", env=extra, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 2 and "Traceback" not in err and "Overflow" not in err, err
        assert "Invalid value for '--dist-timeout': 1e+300 is not a number of minutes" in err, err
    assert list(tmp_path.iterdir()) == []


def _help_line(name: str, flag: str) -> str:
    """The `rlkit NAME --help` line of `flag`, its help text on one line (a wide terminal), whitespace collapsed."""
    from conftest import run_cli_inproc

    r = run_cli_inproc(name, "--help", env={"COLUMNS": "4000"})
    assert r.returncode == 0, r.stderr
    lines = [" ".join(x.strip("│ ").split()) for x in r.stdout.decode().splitlines()]
    (line,) = [x for x in lines if x.startswith(f"{flag} ")]
    return line


def test_the_help_says_each_batch_option_in_trl_and_verl_terms():
    """What a TRL or verl user misreads: what each batch size counts, per GPU or in all, padded or real tokens,
    --packing vs TRL's packing, and where the generation length comes from."""
    mb = _help_line("update", "--minibatch-size")
    assert "Sequences (table rows = prompts x rollout's --n samples) per optimizer step, over all GPUs" in mb
    assert "Unlike verl's ppo_mini_batch_size, which counts prompts" in mb
    for name in ("update", "sft", "train-rm"):
        micro = _help_line(name, "--micro-batch-size")
        assert "per forward/backward pass on each GPU or process: per rank under torchrun" in micro
        assert "verl's ppo_micro_batch_size_per_gpu" in micro
        assert "real prompt + completion tokens (no padding counted)" in _help_line(name, "--micro-batch-tokens")
        assert "This is TRL's padding_free, not TRL's packing" in _help_line(name, "--packing")
    assert "counted padded: rows x the longest row's prompt + completion tokens" in _help_line("sft", "--batch-tokens")
    for name in ("eval", "rollout", "build-prefs"):
        line = _help_line(name, "--max-new-tokens")
        assert "the task's own generation length (arithmetic 16; math 96" in line
        if name != "build-prefs":  # the stages that run environments: one model turn under --env
            assert "under --env, the longest model turn (per turn; a whole trajectory is --max-total-tokens)" in line


def test_a_micro_batch_of_zero_says_what_leaving_it_out_means_on_a_cpu_and_a_gpu():
    from rlkit.errors import RlkitError
    from rlkit.training import TrainOptions

    for kw, flag in (({"micro_batch_size": 0}, "--micro-batch-size 0"), ({"micro_batch_tokens": 0}, "--micro-batch-tokens 0")):
        with pytest.raises(RlkitError) as e:
            TrainOptions(**kw).check()
        assert str(e.value) == (f"{flag}: expected an integer >= 1, or leave it out for the default: the whole step in "
                                "one forward pass on a CPU, micro-batches of 16384 tokens on a GPU")


def test_the_engine_and_environment_options_are_one_declaration_spliced_in_place():
    """rollout, eval and build-prefs take the engine options (and rollout and eval the environment options) from one
    declaration each (options.EngineFlags, EnvFlags): the same parameters, each stage's own fields in place, and one
    resolution to the EngineOptions an engine starts with and to the driver's settings."""
    from rlkit.engines import EngineOptions
    from rlkit.sampling import Sampling
    from rlkit.stages.build_prefs import BuildPrefsConfig
    from rlkit.stages.eval import EvalConfig
    from rlkit.stages.rollout import RolloutConfig

    engine = [f.name for f in dataclasses.fields(options.EngineFlags)]
    env = [f.name for f in dataclasses.fields(options.EnvFlags)]

    def declared(cls, names):
        return [(p.name, p.default, typing.get_args(p.annotation)[1].help) for p in stage_options.params(cls)
                if p.name in names]

    assert declared(EvalConfig, engine) == declared(BuildPrefsConfig, engine) == [
        x for x in declared(RolloutConfig, engine) if x[0] != "colocate"]
    assert "colocate" in [x[0] for x in declared(RolloutConfig, engine)]
    assert declared(RolloutConfig, env) == declared(EvalConfig, env)
    fields = [f.name for f in dataclasses.fields(RolloutConfig)]  # in place: where the stage lists them
    assert fields[fields.index("max_new_tokens") + 1:fields.index("shard")] == env + engine

    @dataclass(frozen=True)
    @stage_options.splice(options.EngineFlags, before="seed", omit=("colocate",))
    class Demo:
        policy: Path = option(..., options.PolicyDir)
        seed: int = option(0, options.Seed)
        device: str = option("auto", options.Device)
        trust_remote_code: bool = option(False, options.TrustRemoteCode)
        plan: bool = option(True, options.NoPlan, invert=True)

    assert [f.name for f in dataclasses.fields(Demo)] == ["policy", *[n for n in engine if n != "colocate"], "seed",
                                                           "device", "trust_remote_code", "plan"]
    cfg = Demo(policy=Path("p"), tp=2, vllm_lora="merge", seed=5, plan=False)
    assert options.engine_options(cfg, sleep=True) == EngineOptions(seed=5, tp=2, lora="merge", plan=False, sleep=True)
    assert Sampling.of(RolloutConfig(policy=Path("p"), n=3, max_new_tokens=9, max_turns=2, env_workers=4),
                       temperature=0.5) == \
        Sampling(n=3, temperature=0.5, max_new_tokens=9, max_turns=2, env_workers=4)
    with pytest.raises(TypeError, match="has no field 'nope'"):
        stage_options.splice(options.EngineFlags, before="nope")(Demo)
