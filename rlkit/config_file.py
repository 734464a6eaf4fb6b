"""`--config FILE` on every command, and the file `rlkit inspect CKPT --config` writes.

A config file is TOML (`.toml`) or YAML (`.yaml`/`.yml`) holding option values by name: `minibatch_size = 64`
or `minibatch-size = 64` sets `--minibatch-size 64`; a list sets a repeatable option (`reward = ["verifier=1",
"rm:helpful=0.5"]`); `in = "r.arrow"` sets `--in`. Keys at the top level apply to whichever command reads the
file; a table named after a command (`[update]`, `[rollout]`, ...) applies to that command only, so one file
can hold a whole pipeline's settings. Flags given on the command line win over the file, and the file
wins over the defaults.

The loading and merging is click's own: the file becomes the command's `default_map` (click's documented
mechanism for defaults from a configuration file), and `--help` stays the single list of what can be set.
A value is checked exactly as the same value typed on the command line: its TOML/YAML type first
(`as_typed`: `n = true` is refused as `--n true` is, not taken as 1; a fraction for an integer, a list for a
one-value option and anything but true/false for a flag are refused, naming the key), then it goes to click
as the string a user would type, which converts and range-checks it as it does a typed one. YAML's null
leaves the option's default. The file is read by `tomllib` (the standard library; `tomli` on Python 3.10)
or PyYAML's safe loader (transformers depends on it), never executed; a file over MAX_BYTES, one of more than
MAX_NODES values (YAML aliases expanded, counted before any is built) and keys that are not strings are
refused.

Every output made from the command line records its options as given or defaulted (the manifest's
`options`): `options_toml` writes them back as a file `--config` reads, so a run can be reproduced or
varied from its checkpoint; where that run wrote (OUTPUT_KEYS) is written commented out.
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
    ctx.meta[META_KEY] = str(value)  # rlkit.cli names the file in an error about a value from it
    return None


META_KEY = "rlkit_config_file"


def read(path: Path) -> dict:
    """The file's top-level table (TOML or YAML by suffix). -> {key: value}. Raises ValueError with the reason.
    A file over MAX_BYTES, one of more than MAX_NODES values (YAML aliases expanded), nesting deeper than
    Python's recursion allows and a key that is not a string are refused here."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"expected a .toml, .yaml or .yml file, not {suffix or 'a file without a suffix'!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    if len(raw) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES // 2**20} MiB, the most a config file may be (an option file is a few lines)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start}): expected a TOML or YAML file") from None
    try:
        data = load_toml(text) if suffix == ".toml" else _load_yaml(text)
    except RecursionError:
        raise ValueError("nested too deeply: expected a table of option names and values") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a table of option names and values at the top level, not a {type(data).__name__}")
    for k, v in data.items():
        _check_key(k, None)
        if isinstance(v, dict):
            for k2 in v:
                _check_key(k2, k)
    return data


# a config file holds a few lines of option values: anything this large is something else (or an attack)
MAX_BYTES = 2**20
MAX_NODES = 10_000  # values, YAML aliases expanded (a "billion laughs" file expands without bound)


def load_toml(text: str) -> dict:
    """TOML text -> a dict (tomllib; tomli on Python 3.10); ValueError with the parser's message, or when it holds
    more values than an option file (or a rubric) ever needs."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML: {e}") from None
    if _count(data) > MAX_NODES:
        raise ValueError(f"more than {MAX_NODES:,} values (an option file holds a few)")
    return data


def _count(value: Any) -> int:
    """How many values `value` holds (itself included): a TOML document is a tree, no node is shared."""
    if isinstance(value, dict):
        return 1 + sum(_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


def _load_yaml(text: str) -> Any:
    """PyYAML's safe loader, with the size of the document counted on its node graph before any Python value
    is built: an alias counts as the whole node it names, every time it is used."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        n = _expanded_size(node, {}, set())
        if n > MAX_NODES:
            raise ValueError(f"more than {MAX_NODES:,} values, YAML aliases expanded (an option file holds a few)")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        loader.dispose()


def _expanded_size(node, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values `node` is once every alias in it is expanded (memoised per node, so the count costs
    one pass over the nodes however often an alias repeats them). ValueError on an alias that contains itself."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise ValueError("a YAML alias refers to a node that contains it (a recursive structure, not an option value)")
    open_.add(key)
    n = 1
    if isinstance(node.value, list):
        for item in node.value:
            for sub in item if isinstance(item, tuple) else (item,):  # a mapping's (key, value) pairs
                n += _expanded_size(sub, sizes, open_)
                if n > MAX_NODES:
                    break
    open_.discard(key)
    sizes[key] = n
    return n


def _check_key(key: Any, table: Any) -> None:
    if not isinstance(key, str):
        where = f" in [{table}]" if table is not None else ""
        raise ValueError(f"key {_shown(key)}{where} ({_a(key)}): expected an option or command name (a string)")


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
    by_name = {p.name: p for p in params if p.name}
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
        if value is None:  # YAML's null: the option's default, as when the key is left out
            continue
        name = mine[key]
        out[name] = as_typed(by_name[name], value, where)
    return out


def as_typed(param, value: Any, where: str) -> Any:
    """A file's `value` for click parameter `param` as the command line would give it (the strings a user
    types; True/False for a flag), after checking that its TOML/YAML type is one the option takes: a bool
    only for a flag, a whole number for an integer, a number for a float, a list only for a repeatable option
    (a single value is a list of one), a string or a whole number for a string or path. The string is then
    converted and range-checked by click exactly as a typed one. ValueError naming `where`, what was given
    and what the option takes."""
    flag = _flag(param)
    kind, many = _kind(param)
    if param.name in COMMA_LISTS and isinstance(value, list):  # report_to = ["wandb", "tensorboard"]
        value = [_scalar(param, v, "str", where, flag) for v in value]
        return ",".join(value)
    if isinstance(value, list):
        if not many:
            raise ValueError(f"key {where!r}: {flag} takes {_KINDS[kind]}, not a list ({_shown(value)})")
        return [_scalar(param, v, kind, where, flag, one=True) for v in value]
    v = _scalar(param, value, kind, where, flag)
    return [v] if many else v


# what each kind of option takes, as an error says it
_KINDS = {"flag": "true or false (it is a flag)", "int": "an integer", "float": "a number",
          "str": "a string", "path": "a path (a string)", "choice": "one of its choices (a string)"}


def _scalar(param, value: Any, kind: str, where: str, flag: str, one: bool = False) -> Any:
    takes = _KINDS[kind] + (" per list item" if one else "")
    ok = {"flag": (bool,), "int": (int,), "float": (int, float), "choice": (str,), "str": (str, int),
          "path": (str, int)}[kind]
    if kind != "flag":
        ok = (*ok, str)  # a string is converted as the same string typed on the command line
    if isinstance(value, bool) and kind != "flag" or not isinstance(value, ok):
        hint = " (quote it to give a string)" if kind in ("str", "path", "choice") and not isinstance(value, list) else ""
        raise ValueError(f"key {where!r}: {flag} takes {takes}, not {_shown(value)} ({_a(value)}){hint}")
    if kind == "flag":
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"key {where!r}: {flag} takes a finite number, not {_shown(value)}")
        return repr(value)  # float(repr(x)) == x
    return str(value)


def _flag(param) -> str:
    return next((o for o in getattr(param, "opts", ()) if o.startswith("--")), f"--{param.name.replace('_', '-')}")


def _kind(param) -> tuple[str, bool]:
    """(flag | int | float | choice | path | str, whether it repeats) of a click parameter: from typer's
    annotation where typer records it, else from click's type."""
    import types
    import typing

    many = bool(getattr(param, "multiple", False)) or getattr(param, "nargs", 1) == -1
    if getattr(param, "is_flag", False):
        return "flag", False
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if ann is not None:
        while (origin := typing.get_origin(ann)) in (list, tuple, typing.Union, types.UnionType):
            many = many or origin in (list, tuple)
            args = [a for a in typing.get_args(ann) if a is not type(None) and a is not Ellipsis]
            ann = args[0] if args else str
        if typing.get_origin(ann) is typing.Literal:
            return "choice", many
        if ann is bool:
            return "flag", many
        if ann is int or ann is float:
            return ann.__name__, many
        if isinstance(ann, type) and issubclass(ann, Path):
            return "path", many
        return "str", many
    name = getattr(getattr(param, "type", None), "name", "")
    return {"integer": "int", "integer range": "int", "float": "float", "float range": "float", "boolean": "flag",
            "choice": "choice", "path": "path"}.get(name, "str"), many


def _a(value: Any) -> str:
    """What a TOML/YAML value is, in words."""
    if value is None:
        return "YAML's null"
    for t, words in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                     (list, "a list"), (dict, "a table")):
        if isinstance(value, t):
            return words
    return f"a {type(value).__name__}"  # a TOML date or time


def _shown(value: Any, width: int = 60) -> str:
    """A value as the file spells it, cut to `width` characters."""
    try:
        text = _toml_value(value) if value is not None else "null"
    except (ValueError, TypeError, RecursionError):
        text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


# Where a run wrote: `options_toml` writes them commented out, so a run from the file cannot write over the
# run it was read from (`--out`) or add its rows to that run's metrics, event files or tracker run.
OUTPUT_KEYS = ("out", "metrics", "tensorboard", "run_name")


def options_toml(command: str, options: dict, made: str = "this artifact") -> str:
    """`options` (a manifest's, JSON values) as a TOML `[command]` table that `--config` reads back.
    None is left out (the option's default is None too); a path is a string. The OUTPUT_KEYS are written
    commented out, under a line saying why: the rerun names its own outputs."""
    lines = [f"# the options of the `rlkit {command}` that made {made}; rerun with `rlkit {command} --config FILE`",
             f"[{command}]"]
    outputs = []
    for k, v in options.items():
        if v is None or (isinstance(v, list) and not v):
            continue
        (outputs if k in OUTPUT_KEYS else lines).append(f"{k} = {_toml_value(v)}")
    if outputs:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in OUTPUT_KEYS if any(o.startswith(f"{k} =") for o in outputs))
        lines += [f"# where {made} was written: left out, so that a run from this file cannot write over it or add",
                  f"# to its records; name new ones on the command line ({flags})"]
        lines += [f"# {o}" for o in outputs]
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
