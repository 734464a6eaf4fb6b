"""Tasks from the user's code: `path/to/file.py:CLASS` or `package.module:CLASS` (or an installed package's entry
point), completed to the `Task` protocol and checked as they run (`UserTask`).

A user class needs only `iter_examples(split, seed)` and `reward(response, answer)`; `UserTask` supplies the rest
(`examples`, `completion` = the gold answer, `name`, `spec`, `max_new_tokens` = 16 unless the class sets it) and
checks what the class returns. A user task's identity in manifests includes the hash of the file that defines it
(`task_inputs`), so editing it reruns the stages."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from rlkit.errors import RlkitError
from rlkit.plugins import accepts, as_number, one_line, typed_options, user_code
from rlkit.tasks.base import DEFAULT_MAX_NEW_TOKENS, Example, Scores, TaskBase, check_split

_NEEDS = {"iter_examples": ("(split, seed)", ("train", 0)), "reward": ("(response, answer)", ("", ""))}


@dataclass(frozen=True)
class UserTask(TaskBase):
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
        check_split(split)
        unique = unique or split == "heldout"
        fn = self.impl.iter_examples
        where = f"task {self.label}: iter_examples({split!r}, {seed})"
        try:
            it = iter(fn(split, seed, unique=unique) if accepts(fn, "unique") else fn(split, seed))
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
            ex = as_example(item, split, f"{split}-{seed}-{i}", where)
            if unique and ex.prompt in seen:
                misses += 1
                if misses > 10_000 + 200 * i:
                    if split == "heldout" and i:  # the held-out split is whole (`heldout_examples`)
                        return
                    raise RlkitError(f"{where} ran out of distinct prompts after {i}; ask for fewer")
                continue
            if unique:
                seen.add(ex.prompt)
            yield ex
            i += 1

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
        out = self._call(fn, "score_batch", responses, answers, sandbox)
        values, reasons = (out.values, out.reasons) if isinstance(out, Scores) else (out, None)
        values = [as_number(v) for v in values] if isinstance(values, list | tuple) else None
        if values is None or len(values) != len(responses) or any(v is None for v in values) or (
                reasons is not None and (len(reasons) != len(responses) or not all(isinstance(r, str) for r in reasons))):
            raise RlkitError(f"task {self.label}: score_batch() on {len(responses)} responses returned {out!r:.80}; "
                             "expected rlkit.tasks.Scores(values, reasons) or a list of finite numbers, one per response")
        return Scores(values, None if reasons is None else list(reasons))

    def reward(self, response: str, answer: str) -> float:
        out = self._call(self.impl.reward, "reward", response, answer)
        v = as_number(out)
        if v is None:
            raise RlkitError(f"task {self.label}: reward() returned {out!r:.60} for response {response[:60]!r} "
                             f"(answer {answer!r}), expected a finite number")
        return v

    def _call(self, fn, what: str, *args):
        try:
            return fn(*args)
        except RlkitError:
            raise
        except Exception as e:
            shown = ", ".join(repr(a)[:60] if isinstance(a, str) else f"<{type(a).__name__}>" for a in args)
            raise RlkitError(f"task {self.label}: {what}({shown}) raised {one_line(e)}") from e


def user_task(factory: object, source: str, name: str, opts: dict[str, str]) -> UserTask:
    """Build the user's task object from `factory` (a class or a function returning one) with `opts`,
    and check it has what a task needs before any stage work starts."""
    label = source
    if not callable(factory):
        raise RlkitError(f"task {label} is a {type(factory).__name__}, not a class")
    from_options = getattr(factory, "from_options", None)
    try:
        obj = from_options(dict(opts)) if callable(from_options) else factory(**typed_options(factory, opts, label))
    except RlkitError:
        raise
    except Exception as e:
        given = f" with {','.join(f'{k}={v}' for k, v in opts.items())}" if opts else ""
        raise RlkitError(f"task {label}: creating it{given} raised {one_line(e)}") from e
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


def as_example(item: object, split: str, default_id: str, where: str) -> Example:
    """An item the user's `iter_examples` yielded as an `Example` of `split` (a mapping with prompt and answer is
    made one, `default_id` its id when it has none), checked: anything else is one error line naming `where`."""
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
