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

Every task follows the `Task` protocol below. A user class needs only `iter_examples(split, seed)`
and `reward(response, answer)`; `UserTask` supplies the rest (`examples`, `completion` = the gold
answer, `name`, `spec`, `max_new_tokens` = 16 unless the class sets it) and checks what the class returns. A user task's identity in manifests
includes the hash of the file that defines it (`task_inputs`), so editing it reruns the stages.

A verifier is a reward function of (response, gold answer) -> float, so a verifier (RLVR) and a
reward model (RLHF) are interchangeable reward components.

Train and held-out prompts come from one deterministic partition of the problem space (a stable
hash of the prompt text, `is_heldout`), so a held-out prompt can never be drawn for training,
whatever the seeds. User tasks should split the same way.
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from rlkit.errors import RlkitError
from rlkit.tasks.base import (  # noqa: F401 (the task vocabulary, named from here too)
    DEFAULT_MAX_NEW_TOKENS,
    SPLITS,
    TRUNCATED,
    VERBOSE,
    VERIFIERS,
    Example,
    Scores,
    Task,
    Transcript,
    as_bool,
    check_split,
    generation_length,
    is_heldout,
    last_integer,
    truncation_warning,
    verify,
)


@dataclass(frozen=True)
class Arithmetic:
    """Sums like `<3+4+5>=` whose answer is the integer total.

    Knobs: `terms` (range of the number of terms, e.g. 2-4), `max` (largest operand, 0..max), `heldout`
    (fraction of the problem space held out) and `prose` (fraction of SFT targets written as a sentence,
    "The total is 12.", instead of the bare number; the prompts are the same whatever `prose` is).
    Generation length 16 tokens: a bare answer is a few characters.
    """

    min_terms: int = 2
    max_terms: int = 4
    max_operand: int = 19
    heldout_fraction: float = 0.1
    prose: float = 0.0
    name: str = field(default="arithmetic", init=False)
    verifier: str = field(default="last-integer", init=False)
    max_new_tokens: int = field(default=16, init=False)  # the task's generation length (Task.max_new_tokens)

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> Arithmetic:
        kw: dict = {}
        for k, v in opts.items():
            if k == "terms":
                lo, _, hi = v.partition("-")
                kw["min_terms"], kw["max_terms"] = int(lo), int(hi or lo)
            elif k == "max":
                kw["max_operand"] = int(v)
            elif k == "heldout":
                kw["heldout_fraction"] = float(v)
            elif k == "prose":
                kw["prose"] = float(v)
            else:
                raise RlkitError(f"unknown option {k!r} for task arithmetic; expected terms=LO-HI, max=N, heldout=F, "
                                 "prose=F")
        t = cls(**kw)
        for ok, given, expected in (
                (1 <= t.min_terms <= t.max_terms, f"terms={t.min_terms}-{t.max_terms}", "1 <= LO <= HI"),
                (t.max_operand >= 1, f"max={t.max_operand}", "max >= 1"),
                (0 < t.heldout_fraction < 1, f"heldout={t.heldout_fraction:g}", "0 < heldout < 1"),
                (0 <= t.prose <= 1, f"prose={t.prose:g}", "0 <= prose <= 1")):
            if not ok:
                raise RlkitError(f"--task arithmetic: {given}: expected {expected}")
        return t

    @property
    def spec(self) -> str:
        return self._problems_spec + (f",prose={self.prose}" if self.prose else "")

    @property
    def _problems_spec(self) -> str:  # what decides the prompts (not `prose`, which only shapes SFT targets)
        return f"arithmetic:terms={self.min_terms}-{self.max_terms},max={self.max_operand},heldout={self.heldout_fraction}"

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        terms = [rng.randint(0, self.max_operand) for _ in range(rng.randint(self.min_terms, self.max_terms))]
        return f"<{'+'.join(map(str, terms))}>=", str(sum(terms))

    def problem_space(self) -> int:
        return sum((self.max_operand + 1) ** k for k in range(self.min_terms, self.max_terms + 1))

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """Endless problems of `split`, deterministic in `seed`. Held-out ones are always unique."""
        check_split(split)
        unique = unique or split == "heldout"
        want_heldout = split == "heldout"
        rng = random.Random(f"{self._problems_spec}|{split}|{seed}")
        seen: set[str] = set()
        misses, i = 0, 0
        while True:
            prompt, answer = self._problem(rng)
            if is_heldout(prompt, self.heldout_fraction) != want_heldout or (unique and prompt in seen):
                misses += 1
                if misses > 10_000 + 200 * i:
                    raise RlkitError(
                        f"task {self.spec}: ran out of distinct {split} prompts after {i} "
                        f"(problem space {self.problem_space()}); ask for fewer or widen the task"
                    )
                continue
            if unique:  # only a unique stream remembers its prompts: an endless one stays flat in memory
                seen.add(prompt)
            yield Example(f"{split}-{seed}-{i}", prompt, answer, split)
            i += 1

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]:
        return list(itertools.islice(self.iter_examples(split, seed, unique), n))

    def completion(self, ex: Example) -> str:
        """The SFT target for an example (the eos token is appended by the tokenization step): the bare
        answer, or with probability `prose` (fixed per prompt) one of the VERBOSE sentences around it."""
        if not self.prose:
            return ex.answer
        rng = random.Random(f"prose|{ex.prompt}")
        return rng.choice(VERBOSE).format(ex.answer) if rng.random() < self.prose else ex.answer

    def reward(self, response: str, answer: str) -> float:
        return VERIFIERS[self.verifier](response, answer)


def _math(opts: dict[str, str]) -> Task:
    from rlkit.tasks.math import Math  # math-verify and the data reader load only when a stage uses it

    return Math.from_options(opts)


def _code(opts: dict[str, str]) -> Task:
    from rlkit.tasks.code import Code  # the sandbox and the data reader load only when a stage uses it

    return Code.from_options(opts)


def _calc(opts: dict[str, str]) -> Task:
    from rlkit.envs.calc import Calc  # the calc environment's problems, with tool-use transcripts

    return Calc.from_options(opts)


def _guess(opts: dict[str, str]) -> Task:
    from rlkit.envs.guess import Guess  # games of guess-the-number as transcripts (the `guess` environment's)

    return Guess.from_options(opts)


def _reasoning_gym(opts: dict[str, str]) -> Task:
    from rlkit.tasks.reasoning_gym import (
        ReasoningGym,  # the optional extra rlkit[reasoning-gym], imported on use
    )

    return ReasoningGym.from_options(opts)


def _judge(opts: dict[str, str]) -> Task:
    from rlkit.tasks.judge import JudgeTask  # a judge's training data: judgments of another task's problems

    return JudgeTask.from_options(opts, get_task)


TASKS: dict[str, Callable[[dict[str, str]], Task]] = {"arithmetic": Arithmetic.from_options, "math": _math,
                                                      "code": _code, "calc": _calc, "guess": _guess,
                                                      "reasoning-gym": _reasoning_gym, "judge": _judge}
ENTRY_POINT_GROUP = "rlkit.tasks"
_USER_FORMS = "or a class in your code: path/to/file.py:CLASS or package.module:CLASS"


def parse_options(rest: str, spec: str) -> dict[str, str]:
    """`key=value,...` -> {key: value} (values may contain '=' and ':', not ',')."""
    opts: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq or not k.strip():
            raise RlkitError(f"bad task option {part!r} in {spec!r}; expected key=value")
        opts[k.strip()] = v.strip()
    return opts


def get_task(spec: str) -> Task:
    """The task a spec names (see the module docstring for the forms); user classes come back checked
    and wrapped in `UserTask`."""
    from rlkit.tasks import user_code

    name, _, rest = spec.partition(":")
    if name in TASKS:
        return TASKS[name](parse_options(rest, spec))
    eps = _entry_points() if name.isidentifier() or "-" in name else {}
    if name in eps:
        try:
            factory = eps[name].load()
        except Exception as e:
            raise RlkitError(f"task {name!r} (entry point {eps[name].value}): loading it raised "
                             f"{user_code.one_line(e)}") from e
        return _user_task(factory, name, name, parse_options(rest, spec))
    parsed = user_code.parse_ref(spec)
    if parsed is None:
        known = ", ".join([*TASKS, *sorted(eps)])
        raise RlkitError(f"unknown task {name!r}; known tasks: {known}; {_USER_FORMS}")
    ref, rest = parsed
    return _user_task(user_code.load(ref, "task class"), str(ref), ref.name, parse_options(rest or "", spec))


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in TASKS}


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
    if sb.kind == "none":
        from rlkit import console

        console.warn(f"--sandbox none: task {task.name}'s model-written programs run as you, with resource limits "
                     "but no isolation (unsafe)")
    else:
        sb.check()
    return sb


def reward_fn_sandbox(kind: str | None, workers: int | None = None):
    """The sandbox `--reward-fn` functions run in: only when `--sandbox bwrap` is given (then each function runs
    in sandboxed worker processes, `rlkit.tasks.sandboxed`); without it, or with `--sandbox none`, they run in
    the stage's own process, as the user's own code always has."""
    from rlkit.sandbox import KINDS, Sandbox

    if kind is not None and kind not in KINDS:
        raise RlkitError(f"--sandbox {kind!r}: expected one of {', '.join(KINDS)}")
    return Sandbox(kind, workers) if kind == "bwrap" else None


# ---------------------------------------------------------------------------------------------
# Tasks from the user's code

_NEEDS = {"iter_examples": ("(split, seed)", ("train", 0)), "reward": ("(response, answer)", ("", ""))}


@dataclass(frozen=True)
class UserTask:
    """A task object built from the user's class, completed to the `Task` protocol and checked as it
    runs: examples must be `Example`s (or mappings with prompt and answer) of the split asked for,
    completions strings, rewards finite numbers; anything else, or an exception inside, is one error
    line naming the task."""

    impl: object = field(compare=False)
    spec: str
    name: str
    label: str = field(compare=False)  # how messages name it: 'my_tasks.py:Countdown'
    fingerprint: str  # the defining file's hash, plus the object's own `fingerprint` (e.g. of its data)

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        from rlkit.tasks.user_code import one_line

        check_split(split)
        unique = unique or split == "heldout"
        fn = self.impl.iter_examples
        where = f"task {self.label}: iter_examples({split!r}, {seed})"
        try:
            it = iter(fn(split, seed, unique=unique) if _accepts(fn, "unique") else fn(split, seed))
        except RlkitError:
            raise
        except Exception as e:
            raise RlkitError(f"{where} raised {one_line(e)}") from e
        seen: set[str] = set()
        i = misses = 0
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except RlkitError:
                raise
            except Exception as e:
                raise RlkitError(f"{where} raised {one_line(e)} after {i} examples") from e
            ex = _as_example(item, split, f"{split}-{seed}-{i}", where)
            if unique and ex.prompt in seen:
                misses += 1
                if misses > 10_000 + 200 * i:
                    raise RlkitError(f"{where} ran out of distinct prompts after {i}; ask for fewer")
                continue
            if unique:
                seen.add(ex.prompt)
            yield ex
            i += 1

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]:
        return list(itertools.islice(self.iter_examples(split, seed, unique), n))

    def completion(self, ex: Example) -> str:
        fn = getattr(self.impl, "completion", None)
        if fn is None:
            return ex.answer
        out = self._call(fn, "completion", ex)
        if not isinstance(out, str):
            raise RlkitError(f"task {self.label}: completion() returned a {type(out).__name__} for prompt "
                             f"{ex.prompt[:60]!r}, expected a str")
        return out

    @property
    def max_new_tokens(self) -> int:
        """The class's `max_new_tokens` (checked when the task was made), else DEFAULT_MAX_NEW_TOKENS."""
        n = getattr(self.impl, "max_new_tokens", None)
        return DEFAULT_MAX_NEW_TOKENS if n is None else n

    @property
    def reads(self) -> str | None:
        """What the class says its verifier reads of a multi-turn row (`reads = "final"`, "model" or
        "conversation"; `rlkit.tasks.multi_turn`), None: the default (the final turn)."""
        return getattr(self.impl, "reads", None)

    @property
    def runs_code(self) -> bool:
        """The class says its verifier runs model-written programs (`runs_code = True`): the stage then checks
        the sandbox (`--sandbox`, default bwrap) before sampling and hands it to its `score_batch`."""
        return getattr(self.impl, "runs_code", False) is True

    @property
    def score_batch(self):
        """The class's `score_batch(responses, answers, sandbox) -> Scores` (or a list of rewards), checked as
        it runs; None when it has none (rows are then scored one by one through `reward`)."""
        fn = getattr(self.impl, "score_batch", None)
        return None if not callable(fn) else lambda responses, answers, sandbox=None: self._batch(fn, responses,
                                                                                                   answers, sandbox)

    def _batch(self, fn, responses, answers, sandbox) -> Scores:
        from rlkit.tasks.user_code import as_number

        out = self._call(fn, "score_batch", responses, answers, sandbox)
        values, reasons = (out.values, out.reasons) if isinstance(out, Scores) else (out, None)
        values = [as_number(v) for v in values] if isinstance(values, list | tuple) else None
        if values is None or len(values) != len(responses) or any(v is None for v in values) or (
                reasons is not None and (len(reasons) != len(responses) or not all(isinstance(r, str) for r in reasons))):
            raise RlkitError(f"task {self.label}: score_batch() on {len(responses)} responses returned {out!r:.80}; "
                             "expected rlkit.tasks.Scores(values, reasons) or a list of finite numbers, one per response")
        return Scores(values, None if reasons is None else list(reasons))

    def reward(self, response: str, answer: str) -> float:
        from rlkit.tasks.user_code import as_number

        out = self._call(self.impl.reward, "reward", response, answer)
        v = as_number(out)
        if v is None:
            raise RlkitError(f"task {self.label}: reward() returned {out!r:.60} for response {response[:60]!r} "
                             f"(answer {answer!r}), expected a finite number")
        return v

    def _call(self, fn, what: str, *args):
        from rlkit.tasks.user_code import one_line

        try:
            return fn(*args)
        except RlkitError:
            raise
        except Exception as e:
            shown = ", ".join(repr(a)[:60] if isinstance(a, str) else f"<{type(a).__name__}>" for a in args)
            raise RlkitError(f"task {self.label}: {what}({shown}) raised {one_line(e)}") from e


def _user_task(factory: object, source: str, name: str, opts: dict[str, str]) -> UserTask:
    """Build the user's task object from `factory` (a class or a function returning one) with `opts`,
    and check it has what a task needs before any stage work starts."""
    from rlkit.tasks import user_code

    label = source
    if not callable(factory):
        raise RlkitError(f"task {label} is a {type(factory).__name__}, not a class")
    from_options = getattr(factory, "from_options", None)
    try:
        obj = from_options(dict(opts)) if callable(from_options) else factory(**_typed_options(factory, opts, label))
    except RlkitError:
        raise
    except Exception as e:
        given = f" with {','.join(f'{k}={v}' for k, v in opts.items())}" if opts else ""
        raise RlkitError(f"task {label}: creating it{given} raised {user_code.one_line(e)}") from e
    lacks = [f"{m}{sig}" for m, (sig, _) in _NEEDS.items() if not callable(getattr(obj, m, None))]
    if lacks:
        raise RlkitError(f"task {label} lacks {' and '.join(lacks)}; a task class needs iter_examples(split, seed) "
                         "yielding rlkit.tasks.Example and reward(response, answer) -> float (see rlkit.tasks.Task)")
    for m, (sig, args) in _NEEDS.items():
        _check_signature(getattr(obj, m), args, f"task {label}", m, sig)
    if callable(getattr(obj, "completion", None)):
        _check_signature(obj.completion, (None,), f"task {label}", "completion", "(example)")
    n = getattr(obj, "max_new_tokens", None)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise RlkitError(f"task {label}: max_new_tokens is {n!r:.60}; expected an integer >= 1 (the task's generation "
                         "length in tokens), or leave it out for the default "
                         f"{DEFAULT_MAX_NEW_TOKENS}")
    own = getattr(obj, "fingerprint", None)
    own = own() if callable(own) else own
    fp = user_code.fingerprint(factory, label) + (f"+{own}" if isinstance(own, str) and own else "")
    obj_name = getattr(obj, "name", None)
    spec = source + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
    return UserTask(obj, spec, obj_name if isinstance(obj_name, str) and obj_name else name, label, fp)


def _check_signature(fn, args: tuple, where: str, method: str, want: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it will tell when called
    try:
        sig.bind(*args)
    except TypeError as e:
        raise RlkitError(f"{where}: {method}{sig} cannot be called as {method}{want} ({e})") from None


def _accepts(fn, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


_CONVERT: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str}




def _typed_options(factory, opts: Mapping[str, str], label: str) -> dict[str, object]:
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


def _as_example(item: object, split: str, default_id: str, where: str) -> Example:
    if isinstance(item, Example):
        ex = item
    elif isinstance(item, Mapping) and "prompt" in item and "answer" in item:
        ex = Example(str(item.get("prompt_id") or default_id), item["prompt"], item["answer"],
                     item.get("split") or split)
    else:
        raise RlkitError(f"{where} yielded a {type(item).__name__}; expected rlkit.tasks.Example(prompt_id, prompt, "
                         "answer, split) or a dict with prompt and answer")
    if not isinstance(ex.prompt, str) or not ex.prompt:
        raise RlkitError(f"{where} yielded an example whose prompt is {ex.prompt!r}; expected a non-empty str")
    if ex.answer is None:
        raise RlkitError(f"{where} yielded an example without an answer (prompt {ex.prompt[:60]!r})")
    if not isinstance(ex.answer, str):
        ex = Example(ex.prompt_id, ex.prompt, str(ex.answer), ex.split)
    if ex.split != split:
        raise RlkitError(f"{where} yielded a {ex.split!r} example (prompt {ex.prompt[:60]!r}); a split's examples "
                         "must be of that split")
    return ex
