"""Tasks: prompt generators that carry their own verifier, chosen by name from a registry, or loaded
from the user's code.

A task spec is one of
  `NAME[:key=value,...]`                 a built-in task (`arithmetic`, `math`, `code`, `calc`, `guess`,
                                         `reasoning-gym` through its extra) or one registered by an installed
                                         package under the `rlkit.tasks` entry-point group
  `path/to/file.py:CLASS[:key=value,...]`  a class in a Python file
  `package.module:CLASS[:key=value,...]`   a class in an importable module
e.g. `arithmetic:terms=2-5,max=20` or `my_tasks.py:Countdown:max=50`. Options reach a user class
through its `from_options(dict)` classmethod when it has one, else as keyword arguments of its
constructor, converted to the parameter's annotated type (int, float, bool, str).

Every task follows the `Task` protocol (`rlkit.tasks.base`). A user class needs only `iter_examples(split, seed)`
and `reward(response, answer)`; `UserTask` supplies the rest (`examples`, `completion` = the gold
answer, `name`, `spec`, `max_new_tokens` = 16 unless the class sets it) and checks what the class returns. A user task's identity in manifests
includes the hash of the file that defines it (`task_inputs`), so editing it reruns the stages.

A verifier is a reward function of (response, gold answer) -> float, so a verifier (RLVR) and a
reward model (RLHF) are interchangeable reward components.

Train and held-out prompts come from one deterministic partition of the problem space (a stable
hash of the prompt text, `is_heldout`), so a held-out prompt can never be drawn for training,
whatever the seeds. User tasks should split the same way.

The files: `base` (the vocabulary, and `TaskBase`, the built-ins' base class: examples, the split, the options),
`registry` (`TASKS`, `get_task`, through `rlkit.plugins.resolve`), `user` (`UserTask`), `trust` (the verifier
check every stage runs before it trusts a task's verifier: gold answers must pass, junk must not), and one file a
built-in task (`arithmetic`, `math`, `code`, `reasoning_gym`; `calc` and `guess` live with their environments in
`rlkit.envs`).
"""

from rlkit.plugins import parse_options
from rlkit.tasks.arithmetic import Arithmetic
from rlkit.tasks.base import (
    DEFAULT_MAX_NEW_TOKENS,
    SPLITS,
    TRUNCATED,
    VERBOSE,
    VERIFIERS,
    Example,
    Problem,
    Scores,
    Task,
    TaskBase,
    Transcript,
    as_bool,
    check,
    check_split,
    generation_length,
    heldout_examples,
    is_heldout,
    last_integer,
    span,
    truncation_warning,
    verify,
)
from rlkit.tasks.registry import (
    ENTRY_POINT_GROUP,
    TASKS,
    get_task,
    reward_fn_sandbox,
    task_inputs,
    task_sandbox,
)
from rlkit.tasks.user import UserTask, as_example

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "ENTRY_POINT_GROUP", "SPLITS", "TASKS", "TRUNCATED", "VERBOSE", "VERIFIERS",
           "Arithmetic", "Example", "Problem", "Scores", "Task", "TaskBase", "Transcript", "UserTask", "as_bool",
           "as_example", "check", "check_split", "generation_length", "get_task", "heldout_examples", "is_heldout", "last_integer",
           "parse_options", "reward_fn_sandbox", "span", "task_inputs", "task_sandbox", "truncation_warning", "verify"]
