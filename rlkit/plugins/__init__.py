"""Plug-ins: what the user's specs name, found and loaded in one place, torch-free.

- `resolve`: one resolver for `--task` and `--env` specs: a built-in from its registry (name -> "module:attr"), an
  installed package's entry point, or a class in the user's code (`path/to/file.py:CLASS`,
  `package.module:CLASS`); `Plugin` is what it finds.
- `options`: a spec's `key=value,...` options (`parse_options`), typed for a constructor (`typed_options`).
- `user_code`: importing the user's files and modules, their fingerprints (a rerun after an edit is not skipped),
  and the checks and one-line errors for what the user's code returns and raises (`as_number`, `one_line`).
- `extras`: the optional extras a built-in runs (`missing_extra`: the line that names the install; `library_version`).
- `timer`: the time limit on a call into the user's code (`alarm_handler`, `timed`, `TimedOut`).

Tasks (`rlkit.tasks.get_task`) and environments (`rlkit.envs.get_env`) are thin calls to `resolve`; reward
functions and tools load through `user_code`.
"""

from rlkit.plugins.extras import library_version, missing_extra
from rlkit.plugins.options import accepts, as_bool, parse_options, typed_options
from rlkit.plugins.resolve import USER_FORMS, Plugin, entry_points, load_builtin, resolve
from rlkit.plugins.timer import TimedOut, alarm_handler, timed
from rlkit.plugins.user_code import Ref, as_number, fingerprint, load, one_line, parse_ref, source_file

__all__ = ["USER_FORMS", "Plugin", "Ref", "TimedOut", "accepts", "alarm_handler", "as_bool", "as_number",
           "entry_points", "fingerprint", "library_version", "load", "load_builtin", "missing_extra", "one_line", "parse_options", "parse_ref", "resolve",
           "source_file", "timed", "typed_options"]
