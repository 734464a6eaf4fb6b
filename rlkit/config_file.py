"""`--config FILE` on every command, and the file `rlkit inspect CKPT --config` writes.

A config file is TOML (`.toml`) or YAML (`.yaml`/`.yml`) holding option values by name: `minibatch_size = 64`
or `minibatch-size = 64` sets `--minibatch-size 64`; a list sets a repeatable option (`reward = ["verifier=1",
"rm:helpful=0.5"]`); `in = "r.arrow"` sets `--in`. Keys at the top level apply to whichever command reads the
file; a table named after a command (`[update]`, `[rollout]`, ...) applies to that command only, so one file
can hold a whole pipeline's settings. Flags given on the command line win over the file, and the file
wins over the defaults.

The loading and merging is click's own: the file becomes the command's `default_map` (click's documented
mechanism for defaults from a configuration file), so a value from the file is converted and checked
exactly as the same value typed on the command line, and `--help` stays the single list of what can be
set. The file is read by `tomllib` (the standard library; `tomli` on Python 3.10) or PyYAML's `safe_load` (transformers depends on
it), never executed.

Every output made from the command line records its options as given or defaulted (the manifest's
`options`): `options_toml` writes them back as a file `--config` reads, so a run can be reproduced or
varied from its checkpoint.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any

CONFIG_HELP = ("Read option values from this TOML or YAML file (keys are option names, e.g. minibatch_size = 64; "
               "a [COMMAND] table applies to that command only); options on the command line win. "
               "`rlkit inspect CKPT --config` writes the file that made CKPT.")


# options whose one value is a comma-separated list: a config file may give them as a list too
COMMA_LISTS = frozenset({"report_to"})


def apply(ctx, param, value: Path | None) -> None:
    """--config's click callback: the file's values for this command become its `default_map`."""
    if value is None:
        return None
    import typer

    try:
        data = read(value)
        commands = getattr(ctx.parent.command, "commands", {}) if ctx.parent else {}
        others = {name: cmd.params for name, cmd in commands.items() if name != ctx.info_name}
        found = defaults_for(data, ctx.info_name, ctx.command.params, others)
    except ValueError as e:
        raise typer.BadParameter(f"{value}: {e}", ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **found}
    return None


def read(path: Path) -> dict:
    """The file's top-level table (TOML or YAML by suffix). -> {key: value}. Raises ValueError with the reason."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    if suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
            import tomli as tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"not valid TOML: {e}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML: {' '.join(str(e).split())}") from None
        data = {} if data is None else data
    else:
        raise ValueError(f"expected a .toml, .yaml or .yml file, not {suffix or 'a file without a suffix'!r}")
    if not isinstance(data, dict):
        raise ValueError(f"expected a table of option names and values at the top level, not a {type(data).__name__}")
    return data


def _keys(params: list) -> dict[str, str]:
    """Every spelling a config file may use for a command's options -> the parameter's name: the name
    (`minibatch_size`, `inp`) and each long option with dashes or underscores (`minibatch-size`, `in`)."""
    by_key: dict[str, str] = {}
    for p in params:
        if not p.expose_value or p.name is None:
            continue
        by_key[p.name] = by_key[p.name.replace("_", "-")] = p.name
        for opt in getattr(p, "opts", ()):
            if opt.startswith("--"):
                by_key[opt[2:]] = by_key[opt[2:].replace("-", "_")] = p.name
    return by_key


def defaults_for(data: dict, command: str, params: list, others: dict[str, list] | None = None) -> dict:
    """The `default_map` of `command` from a config file's table: its top-level keys plus its `[command]`
    table; other commands' tables are skipped, and so is a top-level key that only another command has
    (one file for a whole pipeline). `params`: the command's click parameters; `others`: every other
    command's, by name. -> {parameter name: value}. Raises ValueError naming an unknown key and the
    closest valid one."""
    others = others or {}
    mine = _keys(params)
    theirs = {k for ps in others.values() for k in _keys(ps)}
    items = [(k, v, False) for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if not isinstance(v, dict):
            continue
        if k == command:
            items += [(k2, v2, True) for k2, v2 in v.items()]
        elif k not in others:
            raise ValueError(f"[{k}] is not a command's table (the commands: {', '.join(sorted({command, *others}))})")
    out: dict[str, Any] = {}
    for key, value, in_table in items:
        where = f"[{command}] {key}" if in_table else key
        if key not in mine:
            if not in_table and key in theirs:
                continue  # another command's option, in a file shared by a pipeline
            close = difflib.get_close_matches(key, sorted(mine), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown key {where!r}: `rlkit {command}` has no option --{key.replace('_', '-')}{hint}")
        if isinstance(value, dict):
            raise ValueError(f"key {where!r}: expected a value, not a table")
        if isinstance(value, list) and mine[key] in COMMA_LISTS:  # report_to = ["wandb", "tensorboard"]
            value = ",".join(str(v) for v in value)
        out[mine[key]] = value
    return out


def options_toml(command: str, options: dict, made: str = "this artifact") -> str:
    """`options` (a manifest's, JSON values) as a TOML `[command]` table that `--config` reads back.
    None is left out (the option's default is None too); a path is a string."""
    lines = [f"# the options of the `rlkit {command}` that made {made}; rerun with `rlkit {command} --config FILE`",
             f"[{command}]"]
    for k, v in options.items():
        if v is None or (isinstance(v, list) and not v):
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{v} has no TOML form an option accepts")
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a TOML basic string is a JSON string (same escapes)
