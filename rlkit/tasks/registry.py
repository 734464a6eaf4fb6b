"""The task registry: the built-in tasks by name (`TASKS`), the tasks installed packages register under the
`rlkit.tasks` entry-point group, and `get_task`, which resolves a spec (through `rlkit.plugins.resolve`) to a task;
and what a stage asks about the task it got (`task_inputs`, `task_sandbox`, `reward_fn_sandbox`).

A built-in is a class whose `from_options(dict)` builds it from the spec's options (a task made of another task,
`judge`, takes `get_task` too). A new built-in is one file in `rlkit/tasks/` and one line here; `calc` and `guess`,
whose problems their environments share, live in `rlkit/envs/` and are registered here the same way."""

from __future__ import annotations

from rlkit.errors import RlkitError
from rlkit.plugins import accepts, resolve
from rlkit.tasks.base import Task
from rlkit.tasks.user import user_task

TASKS: dict[str, str] = {
    "arithmetic": "rlkit.tasks.arithmetic:Arithmetic",
    "math": "rlkit.tasks.math:Math",  # math-verify and the data reader load only when a stage uses it
    "code": "rlkit.tasks.code:Code",  # the sandbox and the data reader load only when a stage uses it
    "calc": "rlkit.envs.calc:Calc",  # the calc environment's problems, with tool-use transcripts
    "guess": "rlkit.envs.guess:Guess",  # games of guess-the-number as transcripts (the `guess` environment's)
    "code-feedback": "rlkit.envs.code_feedback:CodeFeedback",  # code repair transcripts (the `code-feedback` env's)
    "reasoning-gym": "rlkit.tasks.reasoning_gym:ReasoningGym",  # the optional extra rlkit[reasoning-gym], on use
    "judge": "rlkit.tasks.judge:JudgeTask",  # a judge's training data: judgments of another task's problems
}
ENTRY_POINT_GROUP = "rlkit.tasks"


def get_task(spec: str) -> Task:
    """The task a spec names (see `rlkit.tasks` for the forms); user classes come back checked and wrapped in
    `UserTask`."""
    found = resolve("task", spec, TASKS, ENTRY_POINT_GROUP)
    if not found.builtin:
        return user_task(found.factory, found.name, found.short, found.options)
    build = found.factory.from_options
    return build(found.options, get_task) if accepts(build, "get_task") else build(found.options)


def task_inputs(task: Task) -> dict[str, str]:
    """What a task adds to a stage's input fingerprints: {'task': ...} for a task from the user's code
    (the hash of its file) or from a data file (the data's), nothing for a generated built-in. A stage
    whose task file or data changed is then not skipped as up to date."""
    fp = getattr(task, "fingerprint", None)
    return {"task": fp} if isinstance(fp, str) and fp else {}


def task_sandbox(task: Task | None, kind: str | None, workers: int | None = None):
    """The sandbox a task's verifier runs model-written programs in (`--sandbox`, `--sandbox-workers`), checked
    now, before any sampling: an `rlkit.sandbox.Sandbox`, or None for a task that runs no code. The code task
    sandboxes with bwrap unless `--sandbox none` (said on stderr: unsafe); bubblewrap missing or broken is one
    line (`SandboxUnavailable`)."""
    from rlkit.sandbox import KINDS, Sandbox

    if kind is not None and kind not in KINDS:
        raise RlkitError(f"--sandbox {kind!r}: expected one of {', '.join(KINDS)}")
    if task is None or not getattr(task, "runs_code", False):
        return None
    sb = Sandbox(kind or "bwrap", workers)
    if not sb.backend.isolated:
        from rlkit import console

        console.warn(f"--sandbox none: task {task.name}'s model-written programs run as you, with resource limits "
                     "but no isolation (unsafe)")
    else:
        sb.check()
    return sb


def reward_fn_sandbox(kind: str | None, workers: int | None = None):
    """The sandbox `--reward-fn` functions run in: only when an isolated backend is given (`--sandbox bwrap`: then
    each function runs in sandboxed worker processes, `rlkit.sandbox.workers`); without it, or with `--sandbox
    none`, they run in the stage's own process, as the user's own code always has."""
    from rlkit.sandbox import KINDS, Sandbox

    if kind is not None and kind not in KINDS:
        raise RlkitError(f"--sandbox {kind!r}: expected one of {', '.join(KINDS)}")
    return Sandbox(kind, workers) if kind is not None and Sandbox(kind).backend.isolated else None
