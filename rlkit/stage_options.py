"""A stage's options are declared once: on the fields of its frozen config dataclass.

A field that is a flag carries its option in the field's metadata, written with `option()` (or `argument()`
for a positional one); a field written plainly is no flag (a setting the code fixes, or one `run` resolves):

    @dataclass(frozen=True)
    class PromptsConfig:
        out: Path | None = option(None, OutTable)     # a shared option: an Annotated alias of rlkit.options
        split: Literal["train", "heldout"] = option("train", panel="Data", help="Which split.")
        num: int = option(1000, "--num-prompts", min=1, panel="Data", help="Number of rows.")
        verify: bool = option(True, NoVerify, invert=True)   # the flag --no-verify sets verify=False
        chunk: int = 64                                # no flag

    command = stage_options.command(PromptsConfig, "Write a task's prompts as an Arrow table.")

`command(Config, help)` is the stage's typer command: one parameter per option field, in field order, named
after the field (`--num-prompts` is parameter `num`: the name --config files, the manifests' `options` and
the out-of-memory line know it by), typed by the field's annotation (a `Literal` is a choice; a
`tuple[X, ...]` field is a repeatable option, None when not given), defaulting to the field's default,
shown under the panel the option names (options.PANELS lists the panels). typer reads the parameters from
the generated `__signature__`, so flags, help, ranges, choices and the click checks are typer's own; the
--config loader and the help panels read the click command typer builds from it. When the command runs,
its values are turned back into the config (a list into a tuple, a path into the string a `str` field
holds, an inverted flag negated) and the stage module's `run(cfg)` is called.

A field whose value is itself a config (TrackingConfig, TrainOptions, RLConfig, ...) is flattened with
`nested(GROUP)`: a `Group` lists the nested config's flags (each an `option()`, named by its parameter) and
how the nested config is built from their values, so it is declared once and shared by every stage that
takes those flags (rlkit.options.TRACKING). Flags several stages take as fields of their own config (the engine's,
the environment's) are declared once as the fields of a dataclass and put into each config with `@splice(...)`.

Adding an option is one line: a field with `option(...)`; nothing else names it, except that a float option's
range is its flag's entry in FLOAT_BOUNDS (one range per flag, whichever command takes it; a test refuses a
float option without one).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Annotated, Any

import typer

from rlkit.training import MAX_DIST_TIMEOUT

OPTION = "rlkit_option"  # the metadata key of a config field's option (an Opt or a Group)
REQUIRED = ...  # option(..., PolicyDir): no default, the flag must be given


@dataclass(frozen=True)
class Opt:
    """One field's option: a shared `Annotated` alias, or the flags and typer.Option keywords of its own."""

    decls: tuple[str, ...] = ()  # flag names; none: typer's, from the parameter name
    shared: Any = None  # an Annotated[type, typer.Option(...)] alias of rlkit.options
    type: Any = None  # the command line's type, where it is not the field's annotation
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # help, min, max, parser, rich_help_panel, ...
    argument: bool = False  # a positional argument (typer.Argument)
    invert: bool = False  # a flag whose value is the field's negation (--no-verify -> verify)
    name: str | None = None  # the parameter's name, where it is not the field's
    to_config: Callable[[Any], Any] | None = None  # command-line value -> field value, where not the default rule


def option(default: Any = REQUIRED, /, *spec: Any, help: str | None = None, panel: str | None = None,
           type: Any = None, invert: bool = False, name: str | None = None,
           to_config: Callable[[Any], Any] | None = None, **typer_kwargs: Any) -> Any:
    """A config field that is a command-line option. `spec`: one shared alias (`Task`, `Seed`, `OutTable`: its
    flags, help and panel come with it), or the flag names (`"--num-prompts"`, `"-n"`; none: derived from the
    field's name, and a bool becomes `--x/--no-x`) followed by `help`, `panel` and typer.Option keywords
    (`min`, `max`, `parser`, `hidden`, `metavar`, ...). `type`: the command line's type where the field's
    annotation is not it. `invert`: a flag that sets the field to False (the parameter is named after the
    flag). `default`: the field's default (REQUIRED: none)."""
    shared = [s for s in spec if not isinstance(s, str)]
    decls = tuple(s for s in spec if isinstance(s, str))
    if len(shared) > 1 or (shared and (decls or help or panel or type is not None or typer_kwargs)):
        raise TypeError("option(): a shared alias brings its own flags, help and panel; give it alone")
    kwargs = {k: v for k, v in (("help", help), ("rich_help_panel", panel)) if v is not None} | typer_kwargs
    return _field(default, Opt(decls, shared[0] if shared else None, type, kwargs, False, invert, name, to_config))


def argument(default: Any = REQUIRED, /, *, help: str | None = None, type: Any = None,
             to_config: Callable[[Any], Any] | None = None, **typer_kwargs: Any) -> Any:
    """A config field that is a positional command-line argument (typer.Argument keywords in `typer_kwargs`)."""
    kwargs = ({"help": help} if help is not None else {}) | typer_kwargs
    return _field(default, Opt((), None, type, kwargs, True, False, None, to_config))


class Group:
    """The options of a nested config, flattened into the command's flags: `options` maps each parameter's name
    to its `option(...)`; the nested config is `build(**values)` (default: `cls(**values)`, each value turned
    into its field's as for a stage's own fields), and `cls()` is the field's default."""

    def __init__(self, cls: type, /, build: Callable[..., Any] | None = None, **options: Any) -> None:
        self.cls, self.build, self.options = cls, build, options
        for key, f in options.items():
            if not isinstance(f, dataclasses.Field) or not isinstance(f.metadata.get(OPTION), Opt):
                raise TypeError(f"Group({cls.__name__}): {key} must be an option(...)")


def nested(group: Group) -> Any:
    """A config field holding a nested config whose flags `group` declares."""
    return dataclasses.field(default_factory=group.cls, metadata={OPTION: group})


def splice(flags: type, before: str | None = None, omit: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator (under `@dataclass`): the option fields of dataclass `flags`, options several stages take
    alike and declare once there (rlkit.options.EngineFlags, EnvFlags, SamplerFlags), made fields of the decorated
    config, in place, before its field `before` (None: after its last), all but `omit`. They are the config's own fields: the command, --help, the
    --config keys and the manifest's config name them as fields written in the class would be; what they resolve to
    is one function beside `flags` (`options.engine_options`: `EngineOptions`)."""
    hints = _hints(flags)
    given = [f for f in dataclasses.fields(flags) if f.name not in omit]

    def deco(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        if before is not None and before not in own:
            raise TypeError(f"splice({flags.__name__}): {cls.__name__} has no field {before!r}")
        clash = [f.name for f in given if f.name in own]
        if clash:
            raise TypeError(f"splice({flags.__name__}): {cls.__name__} declares {clash[0]!r} itself")
        annotations: dict[str, Any] = {}
        for name, t in own.items():
            if name == before:
                for f in given:
                    annotations[f.name] = hints[f.name]
                    setattr(cls, f.name, copy.copy(f))  # a fresh Field: @dataclass makes each its class's own
            annotations[name] = t
        if before is None:
            for f in given:
                annotations[f.name] = hints[f.name]
                setattr(cls, f.name, copy.copy(f))
        cls.__annotations__ = annotations
        return cls

    return deco


def _field(default: Any, opt: Opt) -> Any:
    if default is REQUIRED:
        return dataclasses.field(metadata={OPTION: opt})
    if isinstance(default, (list, dict, set)):
        raise TypeError("option(): a mutable default; use a tuple")
    return dataclasses.field(default=default, metadata={OPTION: opt})


@dataclass(frozen=True)
class Param:
    """One parameter of a generated command: the click parameter `name`, from config field `field` (a nested
    config's: `tracking.report_to`)."""

    name: str
    field: str
    annotation: Any
    default: Any  # inspect.Parameter.empty: required
    to_config: Callable[[Any], Any]


def params(cls: type) -> list[Param]:
    """The command-line parameters of config dataclass `cls`, in field order (a nested config's in place)."""
    hints = _hints(cls)
    out: list[Param] = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(OPTION)
        if isinstance(meta, Opt):
            out.append(_param(meta, f.name, f.name, hints[f.name], f.default))
        elif isinstance(meta, Group):
            inner = _hints(meta.cls)
            own = {g.name: g for g in dataclasses.fields(meta.cls)}
            for key, g in meta.options.items():
                t = inner[key] if key in own else Any
                out.append(_param(g.metadata[OPTION], key, f"{f.name}.{key}", t, g.default))
    names = [p.name for p in out]
    if len(set(names)) < len(names):
        raise TypeError(f"{cls.__name__}: two fields are the option {next(n for n in names if names.count(n) > 1)!r}")
    return out


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as e:  # noqa: BLE001 (a mistake in a config's annotations, said at import)
        raise TypeError(f"{cls.__name__}: cannot read its field types ({e})") from e


def _param(opt: Opt, field_name: str, path: str, field_type: Any, default: Any) -> Param:
    required = default is dataclasses.MISSING
    if opt.shared is not None:
        annotation = opt.shared
    else:
        t = opt.type
        if t is None:
            t = field_type
            if typing.get_origin(t) is tuple:  # tuple[X, ...] -> a repeatable option, a list; None when not given
                item = typing.get_args(t)[0]
                t = list[item] if required else list[item] | None
        info = typer.Argument(**opt.kwargs) if opt.argument else typer.Option(*opt.decls, **opt.kwargs)
        annotation = Annotated[t, info]
    annotation = _bounded(annotation, field_name)
    if required:
        cli_default = inspect.Parameter.empty
    elif opt.invert:
        cli_default = not default
    elif isinstance(default, tuple):
        cli_default = list(default) or None
    else:
        cli_default = default
    name = opt.name or (_flag_name(annotation) if opt.invert else field_name)
    cli_type = typing.get_args(annotation)[0]
    return Param(name, path, annotation, cli_default, _converter(opt, field_type, cli_type))


@dataclass(frozen=True)
class Bounds:
    """The values a float option takes: from `low` to `high`, either end open (excluded); `what` names the
    quantity in the error ("a learning rate"). FLOAT_BOUNDS gives each float flag its own."""

    low: float
    high: float
    what: str = "a number"
    low_open: bool = False
    high_open: bool = False

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def holds(self, v: float, low: bool = True, high: bool = True) -> bool:
        """Whether `v` is in range (`low`/`high`: check that end; an end the option's own min/max checks is not)."""
        above = not low or (v > self.low if self.low_open else v >= self.low)
        below = not high or (v < self.high if self.high_open else v <= self.high)
        return above and below


# The range of every float option, by flag (one flag, one meaning, in every command that takes it): click refuses a
# value outside it when the value is typed or read from --config, before any stage starts, with one line naming the
# flag, the value and the range (Bounds). NaN and inf are refused before that (rlkit.cli). An end
# an option declares itself (typer's min/max) is typer's to check. Each range is what the value can mean, and never
# more than its consumer takes: --dist-timeout goes to torch's process group (MAX_DIST_TIMEOUT), --reward-timeout to
# setitimer (a day is far below its time_t). tests/unit/test_stage_options.py checks that every float option is here.
FLOAT_BOUNDS: dict[str, Bounds] = {
    "--lr": Bounds(0, 1, "a learning rate", low_open=True),
    "--critic-lr": Bounds(0, 1, "a learning rate", low_open=True),
    "--warmup-ratio": Bounds(0, 1, "a fraction of the steps"),
    "--weight-decay": Bounds(0, 10, "an AdamW weight decay"),
    "--grad-clip": Bounds(0, 1e6, "a gradient norm"),
    "--temperature": Bounds(0, 100, "a sampling temperature", low_open=True),
    "--top-p": Bounds(0, 1, "a probability mass", low_open=True),
    "--gpu-memory-utilization": Bounds(0.01, 1, "a fraction of the GPU's memory"),
    "--gpu-memory": Bounds(1, 1e5, "a number of GiB"),
    "--reward-timeout": Bounds(0, 86_400, "a number of seconds"),
    "--env-timeout": Bounds(0, 86_400, "a number of seconds"),
    "--worker-timeout": Bounds(0, 7 * 86_400, "a number of seconds", low_open=True),
    "--dist-timeout": Bounds(0, MAX_DIST_TIMEOUT, "a number of minutes", low_open=True),
    "--eval-fraction": Bounds(0, 1, "a fraction of the prompts"),
    "--margin": Bounds(0, 100, "a reward margin"),
    "--clip-low": Bounds(0, 1, "a ratio clip below 1"),
    "--clip-high": Bounds(0, 100, "a ratio clip above 1"),
    "--dual-clip": Bounds(0, 100, "a dual clip"),
    "--beta": Bounds(0, 100, "a KL coefficient"),
    "--gamma": Bounds(0, 1, "a discount"),
    "--lam": Bounds(0, 1, "a GAE lambda"),
    "--vf-clip": Bounds(0, 100, "a value clip range", low_open=True),
    "--target-kl": Bounds(0, 1e4, "a KL per sequence", low_open=True),
    "--tis-cap": Bounds(0, 1e4, "an importance-weight cap", low_open=True),
    "--length-penalty": Bounds(0, 100, "a penalty per token"),
    "--overlong-penalty": Bounds(0, 100, "a penalty at the length limit"),
    "--teacher-coef": Bounds(0, 100, "a weight on the teacher's per-token advantage"),
    "--min-reward": Bounds(-1e6, 1e6, "a total reward"),
    "--max-drift": Bounds(0, 1e3, "a relative weight distance"),
    "--lora-alpha": Bounds(0, 1e5, "a LoRA alpha", low_open=True),
    "--lora-dropout": Bounds(0, 1, "a dropout probability", high_open=True),
}


def _bounded(annotation: Any, field_name: str) -> Any:
    """`annotation` of a float option, with a callback that refuses a value outside the flag's
    FLOAT_BOUNDS (an end the option declares itself, typer's min/max, is left to typer): click
    runs it when the value is typed and when it comes from a --config file, before any stage starts. NaN and
    inf are refused before it, by rlkit.cli."""
    base, info = typing.get_args(annotation)[:2]
    if not _holds_float(base) or not isinstance(info, typer.models.OptionInfo):
        return annotation
    flag = _long_flag(info, field_name)
    bounds = FLOAT_BOUNDS.get(flag)
    if bounds is None:
        return annotation
    own = typer.main.get_param_callback(callback=info.callback)  # typer's call of the option's own callback
    low, high = info.min is None, info.max is None

    def check(ctx, param, value):
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, float) and math.isfinite(v) and not bounds.holds(v, low, high):
                raise typer.BadParameter(f"{v:g} is not {bounds.what} in {bounds}", ctx=ctx, param=param)
        return own(ctx, param, value) if own is not None else value

    info = copy.copy(info)
    info.callback = check
    return Annotated[base, info]


def _holds_float(t: Any) -> bool:
    return t is float or any(_holds_float(a) for a in typing.get_args(t))


def _long_flag(info: Any, field_name: str) -> str:
    """The long flag of an option: the first `--` name it declares, else typer's, from the parameter name."""
    decls = (info.default, *(info.param_decls or ())) if isinstance(info.default, str) else info.param_decls or ()
    return next((d for d in decls if d.startswith("--")), "--" + field_name.replace("_", "-"))


def _flag_name(annotation: Any) -> str:
    """The parameter name of an inverted flag: its long flag's (`--no-verify` -> no_verify)."""
    info = typing.get_args(annotation)[1]
    decls = (info.default, *(info.param_decls or ())) if isinstance(info.default, str) else info.param_decls or ()
    return next(d[2:].replace("-", "_") for d in decls if d.startswith("--"))


def _converter(opt: Opt, field_type: Any, cli_type: Any) -> Callable[[Any], Any]:
    if opt.to_config is not None:
        return opt.to_config
    if opt.invert:
        return lambda v: not v
    if typing.get_origin(field_type) is tuple and list in (typing.get_origin(cli_type),
                                                           *map(typing.get_origin, typing.get_args(cli_type))):
        return lambda v: tuple(v or ())  # a repeatable option's list (None: not given) -> the field's tuple
    kinds = typing.get_args(field_type) or (field_type,)
    if str in kinds and not any(isinstance(k, type) and issubclass(k, PurePath) for k in kinds):
        return lambda v: str(v) if isinstance(v, PurePath) else v  # --in PATH held as the string given
    return lambda v: v


def config_from(cls: type, values: Mapping[str, Any], plan: list[Param] | None = None) -> Any:
    """The config `cls` the command-line `values` (by parameter name) make; `plan`: `params(cls)`, if made."""
    by_field: dict[str, Any] = {}
    nested_values: dict[str, dict[str, Any]] = {}
    for p in plan if plan is not None else params(cls):
        top, _, key = p.field.partition(".")
        if key:
            nested_values.setdefault(top, {})[key] = p.to_config(values[p.name])
        else:
            by_field[top] = p.to_config(values[p.name])
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(OPTION)
        if isinstance(meta, Group):
            by_field[f.name] = (meta.build or meta.cls)(**nested_values.get(f.name, {}))
    return cls(**by_field)


def command(cls: type, help: str, run: str = "run") -> Callable[..., None]:
    """The typer command of a stage whose options are config dataclass `cls`'s: it builds the config from the
    command line and calls `run(cfg)` of the stage module (looked up when the command runs, so a test may
    replace it). `help`: the command's help (its first line is the summary `rlkit --help` shows)."""
    module = sys.modules[cls.__module__]
    plan = params(cls)

    def stage(**values: Any) -> None:
        getattr(module, run)(config_from(cls, values, plan))

    sig = [inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=p.default, annotation=p.annotation)
           for p in plan]
    stage.__signature__ = inspect.Signature(sig)  # type: ignore[attr-defined]
    stage.__annotations__ = {p.name: p.annotation for p in plan}
    stage.__doc__ = help
    stage.__module__ = cls.__module__
    stage.__name__ = stage.__qualname__ = "command"
    stage.config = cls  # type: ignore[attr-defined]  # what the command was made from (tests walk it)
    return stage
