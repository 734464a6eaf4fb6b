"""Code from the user's own files and modules: `path/to/file.py:NAME` or `package.module:NAME`.

Task classes (`--task`), environment classes (`--env`), reward functions (`--reward-fn`) and tools load
through here, so all accept the same two forms, fail the same way (one line naming the file or module and the name), and are
fingerprinted by the source file that defines them: a stage rerun after that file was edited is not
skipped as up to date. A file is imported under a private module name, once per content; its folder
is appended to `sys.path` (so it can import its neighbours without shadowing installed packages). A
module is imported from the installed packages, PYTHONPATH or the current directory.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from rlkit.errors import RlkitError

_FILE_REF = re.compile(r"^(?P<src>.+?\.py):(?P<name>[A-Za-z_]\w*)(?::(?P<rest>.*))?$", re.S)
_MODULE_REF = re.compile(r"^(?P<src>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)(?::(?P<rest>.*))?$", re.S)


@dataclass(frozen=True)
class Ref:
    """Where a user object lives: `source` is a .py path or a dotted module name, `name` the attribute."""

    source: str
    name: str

    @property
    def is_file(self) -> bool:
        return self.source.endswith(".py")

    def __str__(self) -> str:
        return f"{self.source}:{self.name}"


def parse_ref(text: str) -> tuple[Ref, str | None] | None:
    """(ref, what follows `:NAME`, or None) for `FILE.py:NAME[:rest]` or `pkg.module:NAME[:rest]`; None
    when `text` has neither form."""
    m = _FILE_REF.match(text) or _MODULE_REF.match(text)
    return (Ref(m["src"], m["name"]), m["rest"]) if m else None


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise RlkitError(f"{path}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    resolved = path.resolve()
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(str(resolved).encode() + b"\0" + resolved.read_bytes()).hexdigest()[:12]
    key = f"_rlkit_user_{digest}_{stem}"  # an edited file is a new module, also within one process
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, resolved)
    if spec is None or spec.loader is None:
        raise RlkitError(f"{path}: cannot be imported as Python code")
    mod = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    sys.modules[key] = mod  # before exec: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(mod)
    except (Exception, SystemExit) as e:
        del sys.modules[key]
        raise RlkitError(f"{path}: importing it raised {one_line(e)}") from e
    return mod


def _import_module(name: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path:  # `rlkit` (a console script) does not have the current directory on its path
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise RlkitError(f"no module named {e.name!r} (for {name}); install it, or put it on PYTHONPATH or in "
                             "the current directory") from e
        raise RlkitError(f"module {name}: importing it raised {one_line(e)}") from e
    except (Exception, SystemExit) as e:
        raise RlkitError(f"module {name}: importing it raised {one_line(e)}") from e


def load(ref: Ref, what: str) -> object:
    """The object `ref` names; `what` ('task class', 'reward function') words the errors."""
    mod = _import_file(Path(ref.source)) if ref.is_file else _import_module(ref.source)
    if not hasattr(mod, ref.name):
        public = sorted(n for n, v in vars(mod).items() if not n.startswith("_") and callable(v)
                        and getattr(v, "__module__", None) == mod.__name__)
        raise RlkitError(f"{ref.source} has no {what} named {ref.name!r}"
                         + (f" (it defines {', '.join(public)})" if public else ""))
    return getattr(mod, ref.name)


def source_file(obj: object) -> Path | None:
    """The .py file that defines `obj` (a class, function or callable instance), when there is one."""
    for target in (obj, type(obj)):
        try:
            f = inspect.getsourcefile(target)  # type: ignore[arg-type]
        except TypeError:
            continue
        if f and Path(f).is_file():
            return Path(f)
    return None


def fingerprint(obj: object, label: str) -> str:
    """A manifest identity for user code: the content hash of the file that defines `obj`."""
    from rlkit.io import fingerprints

    f = source_file(obj)
    if f is None:
        return f"unhashed:{label}"  # e.g. a C extension: nothing rlkit can hash
    return fingerprints.fingerprint(f)


def as_number(value: object) -> float | None:
    """`value` as a float when it is a finite real number (bool, int, float, numpy scalar, a one-element
    tensor), else None: what user code's rewards are checked with."""
    import math
    import numbers

    if not isinstance(value, numbers.Real):
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if size != 1 or not callable(getattr(value, "item", None)):
            return None
        value = value.item()  # a one-element torch tensor or numpy array
        if not isinstance(value, numbers.Real):
            return None
    v = float(value)
    return v if math.isfinite(v) else None


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` for an exception raised by the user's code (the traceback is
    --debug's)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
