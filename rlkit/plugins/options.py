"""A plug-in's options: `key=value,...` read from its spec, and typed for the constructor that takes them.

Tasks, environments and textarena's games share these, so a spec's options read, convert and fail the same way
wherever they go (an int, float, bool or str parameter takes its option's text converted to that type)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

from rlkit.errors import RlkitError


def parse_options(rest: str, spec: str) -> dict[str, str]:
    """`key=value,...` -> {key: value} (values may contain '=' and ':', not ',')."""
    opts: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq or not k.strip():
            raise RlkitError(f"bad task option {part!r} in {spec!r}; expected key=value")
        opts[k.strip()] = v.strip()
    return opts


def as_bool(v: str) -> bool:
    """An option's text as a boolean: 1/true/yes/on or 0/false/no/off; ValueError otherwise."""
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{v!r} is not a boolean (true/false, 1/0, yes/no)")


_CONVERT: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str}


def typed_options(factory, opts: Mapping[str, str], label: str) -> dict[str, object]:
    """Task options as constructor keyword arguments, each converted to its parameter's annotated type."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return dict(opts)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    out: dict[str, object] = {}
    for k, v in opts.items():
        if k not in named:
            if takes_any:
                out[k] = v
                continue
            raise RlkitError(f"unknown option {k!r} for task {label}; it takes "
                             + (", ".join(f"{n}=..." for n in named) or "no options"))
        ann = params[k].annotation
        ann = getattr(ann, "__name__", ann) if not isinstance(ann, str) else ann.split("|")[0].strip()
        try:
            out[k] = as_bool(v) if ann == "bool" else _CONVERT.get(ann, str)(v)
        except ValueError as e:
            raise RlkitError(f"task {label}: option {k}={v!r} is not a valid {ann} ({e})") from None
    return out


def accepts(fn, keyword: str) -> bool:
    """Whether `fn` can be called with the keyword argument `keyword` (a parameter so named, or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
