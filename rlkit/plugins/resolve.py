"""One resolver for every plug-in spec (`--task`, `--env`): a built-in by name, an installed package's entry point,
or a class in the user's code.

    NAME[:key=value,...]                     a built-in (`builtins`: name -> "module:attr", imported on use) or an
                                             entry point of `entry_group` (an installed package's)
    path/to/file.py:CLASS[:key=value,...]    a class in a Python file
    package.module:CLASS[:key=value,...]     a class in an importable module

`resolve` finds the object the spec names and parses its options; what the object is made into (a task, an
environment) is its caller's."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlkit.errors import RlkitError
from rlkit.plugins import user_code
from rlkit.plugins.options import parse_options

USER_FORMS = "or a class in your code: path/to/file.py:CLASS or package.module:CLASS"


@dataclass(frozen=True)
class Plugin:
    """What a spec names: the object (a class or a factory), how specs and messages name it, and its options."""

    factory: Any
    name: str  # as specs and manifests name it: the built-in's or entry point's name, or FILE.py:CLASS
    short: str  # the built-in's or entry point's name, or CLASS alone
    rest: str  # the options' text as given (after NAME: or CLASS:)
    spec: str  # the whole spec, as given
    builtin: bool

    @property
    def options(self) -> dict[str, str]:
        """The spec's options, as text (read when asked: a caller checks the object before its options)."""
        return parse_options(self.rest, self.spec)

    def fingerprint(self, label: str) -> str:
        """The hash of the file defining a user's or a package's object (`user_code.fingerprint`)."""
        return user_code.fingerprint(self.factory, label)


def load_builtin(target: str) -> Any:
    """The object "module:attr" names (a built-in plug-in's registry entry), importing its module now."""
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def resolve(kind: str, spec: str, builtins: Mapping[str, str], entry_group: str) -> Plugin:
    """The object `spec` names (see the module docstring). `kind` ('task', 'environment') words the errors;
    `builtins` maps each built-in's name to "module:attr"; `entry_group` is the entry-point group that installed
    packages register theirs under."""
    name, _, rest = spec.partition(":")
    if name in builtins:
        return Plugin(load_builtin(builtins[name]), name, name, rest, spec, True)
    eps = entry_points(entry_group, builtins) if name.isidentifier() or "-" in name else {}
    if name in eps:
        try:
            factory = eps[name].load()
        except Exception as e:
            raise RlkitError(f"{kind} {name!r} (entry point {eps[name].value}): loading it raised "
                             f"{user_code.one_line(e)}") from e
        return Plugin(factory, name, name, rest, spec, False)
    parsed = user_code.parse_ref(spec)
    if parsed is None:
        known = ", ".join([*builtins, *sorted(eps)])
        raise RlkitError(f"unknown {kind} {name!r}; known {kind}s: {known}; {USER_FORMS}")
    ref, rest = parsed
    return Plugin(user_code.load(ref, f"{kind} class"), str(ref), ref.name, rest or "", spec, False)


def entry_points(group: str, builtins: Mapping[str, str]) -> dict:
    """The installed packages' plug-ins of `group` by name (a built-in's name is not theirs to take)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group) if ep.name not in builtins}
