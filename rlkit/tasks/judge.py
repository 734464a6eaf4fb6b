"""LLM judges (RLAIF): a frozen causal LM asked, through a written rubric, whether a response meets it (a yes/no
verdict or a score) or which of two responses meets it better, as a reward source beside verifiers and reward
models (Bai et al. 2022, "Constitutional AI"; Lee et al. 2023, "RLAIF").

A rubric is a TOML file (`load_rubric`):

    kind = "yes-no"                 # or "pairwise", "score"
    template = "{prompt}{response} correct? "
    choices = ["Y", "N"]            # yes-no: (yes, no); pairwise: (the first response, the second)
    # score only: the judge writes its answer (greedy), the first group of `pattern` is read as a number in
    # [low, high] and mapped to [0, 1]
    pattern = "Score: (\\d+)"
    low = 1
    high = 10
    max_new_tokens = 16

The template's placeholders are `{prompt}` and `{response}` (yes-no, score) or `{prompt}`, `{response_a}` and
`{response_b}` (pairwise); `{{` and `}}` are literal braces. Each choice must be one token of the judge's
tokenizer, the token the judge writes right after the rendered template: a verdict is then read from one forward
pass, without sampling noise, as P(first choice) / (P(first) + P(second)) (`Judge.first_choice`). The
rubric's sha256 (of its bytes) goes into every manifest that used it.

`Judge` loads a judge checkpoint frozen and hash-checked (always, as a reference is), runs it forward-only in
batches of a token budget, and generates greedily through the sampling driver (the hf engine on the judge in
memory) for score rubrics. `parse_judges` reads `--judge [NAME=]DIR[:rubric=FILE][,engine=...]` and `--rubric FILE`
the same way for every stage that takes a judge (score-ref, build-prefs). `JudgeTask`
(`--task judge:task=arithmetic,rubric=FILE[|FILE...]`) makes a judge's training data from a generated task: the
task's prompts with proposed answers (the gold one or a near miss) and the verdict a rubric asks for, so
`rlkit sft` trains a judge and its held-out evaluation is the judge's agreement with the task's verifier.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, check_split

RUBRIC_KINDS = ("yes-no", "pairwise", "score")
# the placeholders each kind's template must hold
PLACEHOLDERS = {"yes-no": {"prompt", "response"}, "score": {"prompt", "response"},
                "pairwise": {"prompt", "response_a", "response_b"}}
_KEYS = {"kind", "template", "choices", "pattern", "low", "high", "max_new_tokens"}


@dataclass(frozen=True)
class Rubric:
    kind: str  # one of RUBRIC_KINDS
    template: str
    choices: tuple[str, str] = ("", "")  # yes-no: (yes, no); pairwise: (first response, second response)
    pattern: str = ""  # score: a regex whose first group is the score
    low: float = 0.0
    high: float = 1.0
    max_new_tokens: int = 16
    path: str = ""
    sha256: str = ""

    def render(self, prompt: str, response: str | None = None, response_a: str | None = None,
               response_b: str | None = None) -> str:
        """The judge's input text for one (prompt, response) or (prompt, response_a, response_b)."""
        return self.template.format(prompt=prompt, response=response, response_a=response_a, response_b=response_b)

    def parse_score(self, text: str) -> tuple[float, str]:
        """A score rubric's reward from the judge's answer: (value in [0, 1], verdict). An answer without the
        pattern, or a number outside [low, high], is 0.0 with the reason as its verdict."""
        m = re.search(self.pattern, text)
        if m is None or not m.groups():
            return 0.0, "unparseable"
        try:
            x = float(m.group(1))
        except ValueError:
            return 0.0, "unparseable"
        if not self.low <= x <= self.high:
            return 0.0, "out_of_range"
        return (x - self.low) / (self.high - self.low), "parsed"

    def manifest_entry(self) -> dict:
        return {"rubric": self.path, "rubric_sha256": self.sha256, "rubric_kind": self.kind}


def load_rubric(path: str | Path, kinds: Sequence[str] = RUBRIC_KINDS, flag: str = "--rubric") -> Rubric:
    """A rubric file, checked: one line naming what is wrong (a missing or unreadable file, invalid TOML, an unknown
    key or kind, a template without its placeholders or with others, choices that are not two distinct strings,
    a score rubric without a pattern with one group, low >= high), or a kind this use does not take (`kinds`)."""
    from rlkit.config_file import load_toml

    p = Path(path)
    where = f"{flag} {p}"
    if not p.is_file():
        raise RlkitError(f"{where}: no such rubric file (a TOML file with kind, template and choices; see "
                         "docs/tasks-rewards.md)")
    raw = p.read_bytes()
    try:
        d = load_toml(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise RlkitError(f"{where}: not a valid TOML rubric ({str(e).splitlines()[0]})") from None
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise RlkitError(f"{where}: unknown key {unknown[0]!r}; a rubric has {', '.join(sorted(_KEYS))}")
    kind = d.get("kind")
    if kind not in RUBRIC_KINDS:
        raise RlkitError(f"{where}: kind {kind!r} is not one of {', '.join(RUBRIC_KINDS)}")
    if kind not in kinds:
        raise RlkitError(f"{where} is a {kind} rubric; this takes {' or '.join(kinds)}")
    template = d.get("template")
    if not isinstance(template, str) or not template:
        raise RlkitError(f"{where}: 'template' must be a non-empty string")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise RlkitError(f"{where}: the template does not parse ({e}); write literal braces as {{{{ and }}}}") from None
    want = PLACEHOLDERS[kind]
    if names != want:
        raise RlkitError(f"{where}: a {kind} template holds {', '.join('{' + n + '}' for n in sorted(want))}"
                         + (f", not {', '.join('{' + n + '}' for n in sorted(names - want))}" if names - want else "")
                         + (f"; missing {', '.join('{' + n + '}' for n in sorted(want - names))}" if want - names
                            else ""))
    kw: dict = {}
    if kind in ("yes-no", "pairwise"):
        choices = d.get("choices")
        if (not isinstance(choices, list) or len(choices) != 2 or not all(isinstance(c, str) and c for c in choices)
                or choices[0] == choices[1]):
            what = "[yes, no]" if kind == "yes-no" else "[first, second]"
            raise RlkitError(f"{where}: 'choices' must be two distinct non-empty strings {what}, e.g. [\"Y\", \"N\"]")
        kw["choices"] = tuple(choices)
    else:
        pattern = d.get("pattern")
        example = "e.g. \"Score: (\\\\d+)\""
        if not isinstance(pattern, str) or not pattern:
            raise RlkitError(f"{where}: a score rubric needs 'pattern', a regular expression whose first group is "
                             f"the score, {example}")
        shown = f"`{pattern}`" if pattern.isprintable() else repr(pattern)  # the expression itself, unescaped
        try:
            groups = re.compile(pattern).groups
        except re.error as e:
            raise RlkitError(f"{where}: 'pattern' {shown} is not a regular expression ({e}); {example}") from None
        if groups < 1:
            raise RlkitError(f"{where}: 'pattern' {shown} has no group; its first group (in parentheses) is the "
                             f"score, {example}")
        low, high = d.get("low", 0), d.get("high", 10)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) or low >= high:
            raise RlkitError(f"{where}: 'low' and 'high' must be numbers with low < high (got {low!r}, {high!r})")
        n = d.get("max_new_tokens", 16)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RlkitError(f"{where}: 'max_new_tokens' must be an integer >= 1")
        kw.update(pattern=pattern, low=float(low), high=float(high), max_new_tokens=n)
    return Rubric(kind, template, path=str(p), sha256="sha256:" + hashlib.sha256(raw).hexdigest(), **kw)


def first_choice_prob(logits_first, logits_second):
    """P(first) / (P(first) + P(second)) from the two choices' logits: a softmax over the pair, sigmoid(l1 - l2).
    Tensors of any shape, same shape out."""
    import torch

    return torch.sigmoid(logits_first.float() - logits_second.float())


def prefer(p_ab: float, p_ba: float) -> int | None:
    """Which response a judge prefers, asked in both orders (position bias cancels): `p_ab` = P(the first) with
    (a, b) shown, `p_ba` = P(the first) with (b, a) shown. -> 0 (a), 1 (b) or None: the two orders disagree (a
    judge that always prefers the first response, or is unsure), a tie."""
    if p_ab > 0.5 and p_ba < 0.5:
        return 0
    if p_ab < 0.5 and p_ba > 0.5:
        return 1
    return None


class Judge:
    """A judge checkpoint, frozen: hash-checked whatever --no-verify says (as a reference is), requires_grad off,
    on `device` in `dtype`; its rubric's choices checked against its tokenizer."""

    def __init__(self, path: Path, rubric: Rubric, device=None, dtype: str = "fp32",
                 trust_remote_code: bool = False, what: str = "judge", engine: str = "hf") -> None:
        from rlkit.io import checkpoints, fingerprints

        self.path, self.rubric, self.what = Path(path), rubric, what
        checkpoints.check_model_dir(self.path, what, verify=True)
        self.tokenizer = checkpoints.load_tokenizer(self.path, trust_remote_code)
        self.choice_ids = self._choice_ids() if rubric.kind != "score" else ()
        self.fingerprint = fingerprints.fingerprint(self.path)
        self.device, self.dtype, self.trust_remote_code = device, dtype, trust_remote_code
        self.engine = engine  # a score rubric's generation engine (rlkit.engines): hf (the model in memory) or vllm
        self.model = None
        if engine != "hf" and rubric.kind != "score":
            raise RlkitError(f"{what}: engine={engine} generates a score rubric's answers; a {rubric.kind} rubric's "
                             "verdict is one forward pass (no generation)")
        if engine != "hf":
            from rlkit import engines

            engines.get(engine)  # a known engine, one line otherwise

    def _choice_ids(self) -> tuple[int, int]:
        out = []
        for c in self.rubric.choices:
            ids = self.tokenizer.encode(c, add_special_tokens=False)
            if len(ids) != 1:
                raise RlkitError(f"{self.what} {self.path}: the rubric's choice {c!r} ({self.rubric.path}) is "
                                 f"{len(ids)} tokens of its tokenizer, not one; the verdict is read from the one token "
                                 "the judge writes next: pick choices that are single tokens of this judge (e.g. "
                                 "\" yes\" for many BPE tokenizers, \"Y\" for a character-level one)")
            out.append(ids[0])
        if out[0] == out[1]:
            raise RlkitError(f"{self.what} {self.path}: the rubric's two choices are the same token")
        return out[0], out[1]

    def load(self) -> Judge:
        if self.model is None and self.engine == "hf":
            from rlkit.io import checkpoints

            self.model = checkpoints.load_teacher(self.path, self.device, self.trust_remote_code, self.dtype)
        return self

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        from rlkit.io import data

        return data.encode_prompts(self.tokenizer, list(texts), False)

    def first_choice(self, texts: Sequence[str], batch_tokens: int = 16384) -> tuple[list[float], list[float]]:
        """For each rendered text: (P(first choice) / (P(first) + P(second)), P(first) + P(second)), both read
        from the next-token distribution after the text, one forward pass each, batched by `batch_tokens`.
        The mass says how much of the judge's next token goes to the two choices at all."""
        import torch

        from rlkit import devices
        from rlkit.io.data import token_batches
        from rlkit.ops.logprobs import hidden_states
        from rlkit.ops.packing import layout

        self.load()
        ids = self.encode(texts)
        a, b = self.choice_ids
        probs: list[float] = [0.0] * len(ids)
        mass: list[float] = [0.0] * len(ids)
        device = devices.model_device(self.model)
        head = self.model.get_output_embeddings()
        for idx in token_batches([len(x) + 1 for x in ids], batch_tokens):
            # each text followed by one scored token: the position that predicts it is the verdict's
            seqs = layout([[*ids[i], a] for i in idx], [len(ids[i]) for i in idx], pad_id=self.tokenizer.pad_token_id
                          or 0).to(device)
            with torch.no_grad():
                h = hidden_states(self.model, seqs)[seqs.pos]  # (r, H), one position a text
                logp = torch.log_softmax(head(h).float(), dim=-1)
            p = first_choice_prob(logp[:, a], logp[:, b]).cpu()
            m = (logp[:, a].exp() + logp[:, b].exp()).cpu()
            for k, s in enumerate(seqs.seq.tolist()):
                probs[idx[s]], mass[idx[s]] = float(p[k]), float(m[k])
        return probs, mass

    def generate(self, texts: Sequence[str], batch_tokens: int = 16384) -> list[str]:
        """The judge's greedy answers (a score rubric's), through the sampling driver: on the hf engine wrapping the
        judge in memory, or on the engine named (vllm), started once on the judge's directory."""
        from rlkit import sampling

        if self.engine == "hf":
            from rlkit.engines.hf import HFEngine

            self.load()
            engine = HFEngine(self.model, self.tokenizer, batch_tokens=batch_tokens)
        else:
            engine = self._started(batch_tokens)
        prompts = sampling.Prompts(0, [str(i) for i in range(len(texts))], [None] * len(texts), list(texts),
                                   self.encode(texts))
        gen = sampling.sample(engine, prompts, sampling.Sampling(n=1, temperature=0.0,
                                                                 max_new_tokens=self.rubric.max_new_tokens,
                                                                 logprobs=False), 0)
        return self.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)

    def _started(self, batch_tokens: int):
        if getattr(self, "_engine", None) is None:
            from rlkit import engines

            self._engine = engines.create(self.engine, self.path, engines.EngineOptions(
                trust_remote_code=self.trust_remote_code, batch_tokens=batch_tokens))
        return self._engine

    def close(self) -> None:
        """Stop a started generation engine (vllm)."""
        e = getattr(self, "_engine", None)
        if e is not None:
            e.close()
            self._engine = None

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              batch_tokens: int = 16384) -> tuple[list[float], list[str], list[float] | None]:
        """A yes-no or score rubric's reward of each (prompt, response): (rewards, verdicts, choice mass or None).
        yes-no: P(yes) / (P(yes) + P(no)), verdict yes or no; score: the parsed score in [0, 1], verdict parsed,
        unparseable or out_of_range (then 0.0)."""
        texts = [self.rubric.render(prompt=p, response=r) for p, r in zip(prompts, responses, strict=True)]
        if self.rubric.kind == "yes-no":
            p, mass = self.first_choice(texts, batch_tokens)
            return p, ["yes" if x >= 0.5 else "no" for x in p], mass
        answers = self.generate(texts, batch_tokens)
        parsed = [self.rubric.parse_score(a) for a in answers]
        return [v for v, _ in parsed], [r for _, r in parsed], None

    def compare(self, prompts: Sequence[str], first: Sequence[str], second: Sequence[str],
                batch_tokens: int = 16384) -> list[int | None]:
        """A pairwise rubric's preference of each (prompt, first, second), asked in both orders (`prefer`)."""
        ab = [self.rubric.render(prompt=p, response_a=x, response_b=y) for p, x, y in zip(prompts, first, second,
                                                                                           strict=True)]
        ba = [self.rubric.render(prompt=p, response_a=y, response_b=x) for p, x, y in zip(prompts, first, second,
                                                                                           strict=True)]
        p, _ = self.first_choice([*ab, *ba], batch_tokens)
        return [prefer(p[i], p[len(ab) + i]) for i in range(len(ab))]

    def manifest_entry(self) -> dict:
        return {"path": str(self.path), "fingerprint": self.fingerprint, **self.rubric.manifest_entry()}


def refuse_self_judging(judge: Judge, policies: set[str], what: str) -> None:
    """The policy as its own judge (the same weights' fingerprint): its errors are the policy's, so it would reward
    them; one line (`fingerprints.refuse_policy_itself`)."""
    from rlkit.io.fingerprints import refuse_policy_itself

    refuse_policy_itself(f"{judge.what} {judge.path}", judge.fingerprint, policies, what,
                         "a policy that judges its own answers rewards its own mistakes; use a separate judge checkpoint")


JUDGE_SPEC = "[NAME=]DIR[:rubric=FILE][,engine=hf|vllm]"  # how --judge names a judge, in score-ref and build-prefs


@dataclass(frozen=True)
class JudgeSpec:
    """One --judge as given (`parse_judges`): its name (score-ref's `reward/NAME` and `verdict/NAME`), checkpoint,
    rubric file, the flag that gave the rubric (for its errors) and a score rubric's generation engine."""

    name: str
    path: Path
    rubric: Path
    rubric_flag: str | None  # None: the default, DIR/rubric.toml
    engine: str = "hf"

    def load(self, kinds: Sequence[str], device=None, dtype: str = "fp32", trust_remote_code: bool = False) -> Judge:
        """The judge, checked (`Judge`), under its rubric, which must be of one of `kinds`."""
        if self.rubric_flag is None and not self.rubric.is_file():
            raise RlkitError(f"--judge {self.name}: no such rubric file {self.rubric} (a judge's rubric defaults to "
                             "DIR/rubric.toml); pass one with --rubric FILE or --judge DIR:rubric=FILE "
                             "(docs/tasks-rewards.md#naming-a-judge)")
        rubric = load_rubric(self.rubric, kinds, self.rubric_flag or f"--judge {self.name}: rubric")
        return Judge(self.path, rubric, device, dtype, trust_remote_code, f"judge {self.name}", self.engine)


def parse_judges(specs: Sequence[str], rubric: Path | None = None, taken: Sequence[str] = ()) -> list[JudgeSpec]:
    """Each `--judge [NAME=]DIR[:rubric=FILE][,engine=hf|vllm]`, with `--rubric FILE` (`rubric`) as the rubric of
    every judge that names none with rubric=; else DIR/rubric.toml. NAME defaults to DIR's folder name; text before
    the first `=` that holds a `/` is part of DIR, not a NAME. One line for a malformed spec, an unknown option, a
    name given twice or taken by another reward component (`taken`, verifier, env), and a --rubric no judge takes."""
    if rubric is not None and not specs:
        raise RlkitError("--rubric is --judge's: pass --judge DIR too")
    out: list[JudgeSpec] = []
    for spec in specs:
        cut = spec.find(":")
        head, opts = (spec, "") if cut < 0 else (spec[:cut], spec[cut + 1:])
        name, eq, d = head.partition("=")
        if not eq or "/" in name:
            name, d = Path(head).resolve().name, head
        name = name.strip()
        if not name or not d.strip():
            raise RlkitError(f"--judge {spec!r}: expected {JUDGE_SPEC}")
        own, engine = None, "hf"
        for opt in filter(None, opts.split(",")):
            k, eq, v = opt.partition("=")
            if k.strip() not in ("rubric", "engine") or not eq or not v:
                raise RlkitError(f"--judge {spec!r}: unknown option {opt!r}; expected rubric=FILE or engine=hf|vllm "
                                 f"({JUDGE_SPEC})")
            if k.strip() == "rubric":
                own = Path(v)
            else:
                engine = v.strip()
        if name in (s.name for s in out) or name in taken or name in ("verifier", "env"):
            raise RlkitError(f"--judge names {name!r}, which another reward component has; give each its own NAME")
        file, flag = ((own, f"--judge {name}: rubric") if own is not None else (rubric, "--rubric")
                      if rubric is not None else (Path(d) / "rubric.toml", None))
        out.append(JudgeSpec(name, Path(d), file, flag, engine))
    if rubric is not None and all(s.rubric_flag != "--rubric" for s in out):
        raise RlkitError(f"--rubric {rubric} is the rubric of a --judge that names none, and every --judge here names "
                         "its own (rubric=FILE): leave out one of them")
    return out


@dataclass(frozen=True)
class JudgeTask:
    """Judgments of a generated task as SFT and evaluation data for a judge: `judge:task=arithmetic,rubric=FILE`.

    Each example is one of the task's problems with proposed answers, rendered by a rubric (several rubrics,
    `|`-separated, take turns): a yes-no rubric shows the gold answer or a near miss (half each) and wants its
    yes or no choice; a pairwise rubric shows the gold answer and a near miss in a random order and wants the
    choice naming the gold one. The target is that choice; the verifier checks the judge's answer starts with
    it, so sft's held-out evaluation is the judge's agreement with the task's verifier on held-out problems.
    """

    base: object  # the task whose problems are judged (arithmetic)
    rubrics: tuple[Rubric, ...]
    name: str = field(default="judge", init=False)
    max_new_tokens: int = field(default=4, init=False)

    @classmethod
    def from_options(cls, opts: dict[str, str], get_task) -> JudgeTask:
        """`get_task`: `rlkit.tasks.get_task`, which resolves task=NAME (passed in: this module imports no
        registry)."""
        unknown = sorted(set(opts) - {"task", "rubric"})
        if unknown:
            raise RlkitError(f"unknown option {unknown[0]!r} for task judge; expected task=NAME, rubric=FILE[|FILE]")
        if "rubric" not in opts:
            raise RlkitError("task judge needs rubric=FILE (or FILE|FILE...): the rubric the judge learns to answer")
        base = get_task(opts.get("task", "arithmetic"))
        if base.name != "arithmetic":
            raise RlkitError(f"task judge makes judgments of arithmetic problems (near misses of an integer answer); "
                             f"got task={base.name}")
        rubrics = tuple(load_rubric(f, ("yes-no", "pairwise"), "task judge: rubric")
                        for f in opts["rubric"].split("|"))
        return cls(base, rubrics)

    @property
    def spec(self) -> str:
        return f"judge:task={self.base.spec.partition(':')[0]},rubric={'|'.join(r.path for r in self.rubrics)}"

    @property
    def fingerprint(self) -> str:
        """The rubrics' bytes decide the examples: an edited rubric is another task (`task_inputs`)."""
        return "sha256:" + hashlib.sha256("|".join(r.sha256 for r in self.rubrics).encode()).hexdigest()

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        from rlkit.tasks.prefs import near_miss

        check_split(split)
        for i, ex in enumerate(self.base.iter_examples(split, seed, unique)):
            rubric = self.rubrics[i % len(self.rubrics)]
            rng = random.Random(f"judge|{rubric.sha256}|{ex.prompt}|{seed}|{i}")
            gold = int(ex.answer)
            wrong = str(near_miss(gold, rng))
            if rubric.kind == "yes-no":
                right = rng.random() < 0.5
                text = rubric.render(prompt=ex.prompt, response=str(gold) if right else wrong)
                verdict = rubric.choices[0 if right else 1]
            else:
                first = rng.random() < 0.5
                a, b = (str(gold), wrong) if first else (wrong, str(gold))
                text = rubric.render(prompt=ex.prompt, response_a=a, response_b=b)
                verdict = rubric.choices[0 if first else 1]
            yield Example(f"judge-{ex.prompt_id}", text, verdict, split)

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]:
        return list(itertools.islice(self.iter_examples(split, seed, unique), n))

    def completion(self, ex: Example) -> str:
        return ex.answer

    def reward(self, response: str, answer: str) -> float:
        return 1.0 if response.strip().startswith(answer.strip()) else 0.0
