"""LLM judges (RLAIF): a frozen causal LM asked, through a written rubric (`rlkit.rubrics`), whether a response meets
it (a yes/no verdict or a score) or which of two responses meets it better, as a reward source beside verifiers and
reward models (Bai et al. 2022, "Constitutional AI"; Lee et al. 2023, "RLAIF").

`Judge` loads a judge checkpoint frozen and hash-checked (always, as a reference is), runs it forward-only in
batches of a token budget, and generates greedily through the sampling driver (the hf engine on the judge in
memory) for score rubrics. `parse_judges` reads `--judge [NAME=]DIR[:rubric=FILE][,engine=...]` and `--rubric FILE`
the same way for every stage that takes a judge (score-ref, build-prefs). `JudgeScorer` is a judge as score-ref's
scorer (`reward/NAME` and `verdict/NAME`). A rubric's kind (`rlkit.rubrics.KINDS`) says what a verdict is; the
`judge` task that makes a judge's training data is `rlkit.tasks.judge`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.rubrics import RUBRIC_KINDS, Rubric, load_rubric, taken_by
from rlkit.scorers.base import Rows, Scorer

__all__ = ["JUDGE_SPEC", "RUBRIC_KINDS", "Judge", "JudgeScorer", "JudgeSpec", "Rubric", "first_choice_prob",
           "load_rubric", "parse_judges", "prefer", "refuse_self_judging"]


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
        self.choice_ids = self._choice_ids() if rubric.spec.choices is not None else ()  # none: it writes an answer
        self.fingerprint = fingerprints.fingerprint(self.path)
        self.device, self.dtype, self.trust_remote_code = device, dtype, trust_remote_code
        self.engine = engine  # a score rubric's generation engine (rlkit.engines): hf (the model in memory) or vllm
        self.model = None
        if engine != "hf" and rubric.spec.choices is not None:
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
        kind = self.rubric.spec  # its registry entry: a verdict read from the two choices, or from an answer written
        if kind.choices is not None:
            judged, mass = self.first_choice(texts, batch_tokens)
        else:
            judged, mass = self.generate(texts, batch_tokens), None
        parsed = [kind.verdict(self.rubric, x) for x in judged]
        return [v for v, _ in parsed], [r for _, r in parsed], mass

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


SELF_JUDGING = "a policy that judges its own answers rewards its own mistakes; use a separate judge checkpoint"


def refuse_self_judging(judge: Judge, policies: set[str], what: str) -> None:
    """The policy as its own judge (the same weights' fingerprint): its errors are the policy's, so it would reward
    them; one line (`fingerprints.refuse_policy_itself`)."""
    from rlkit.io.fingerprints import refuse_policy_itself

    refuse_policy_itself(f"{judge.what} {judge.path}", judge.fingerprint, policies, what, SELF_JUDGING)


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




class JudgeScorer(Scorer):
    """A --judge as score-ref's scorer: `reward/NAME`, its verdict's reward on each (prompt, response) under a
    rubric score-ref takes (`rlkit.rubrics.taken_by`), and `verdict/NAME`; never the sampling policy itself."""

    kind, lm, refusal = "--judge", True, SELF_JUDGING

    def __init__(self, spec: JudgeSpec, device=None, dtype: str = "fp32", trust_remote_code: bool = False,
                 batch_tokens: int = 16384) -> None:
        self.judge = spec.load(taken_by("score-ref"), device, dtype, trust_remote_code)
        self.name, self.column, self.batch_tokens = spec.name, f"reward/{spec.name}", batch_tokens
        self.model_dir, self.fingerprint = self.judge.path, self.judge.fingerprint
        self.what, self.said = f"{self.judge.what} {self.judge.path}", f"judge {spec.name} ({self.judge.path})"

    def fields(self) -> list:
        import pyarrow as pa

        return [pa.field(self.column, pa.float64()), pa.field(f"verdict/{self.name}", pa.string())]

    def inputs(self) -> dict[str, str]:
        return {f"judge:{self.name}": f"{self.judge.fingerprint} {self.judge.rubric.sha256}"}

    def manifest_entry(self) -> dict:
        return {"judges": {self.name: self.judge.manifest_entry()}}

    def load(self) -> None:
        self.judge.load()

    def score(self, rows: Rows) -> dict:
        import pyarrow as pa

        from rlkit.tasks.multi_turn import ENV_ERROR

        texts, got = rows.texts(self.reads), {}

        def judge(keep):
            rewards, got["verdicts"], _ = self.judge.score([rows.prompts[i] for i in keep], [texts[i] for i in keep],
                                                           self.batch_tokens)
            return rewards

        out = {self.column: pa.array(rows.kept(judge), pa.float64())}
        it = iter(got.get("verdicts") or ())
        out[f"verdict/{self.name}"] = pa.array([ENV_ERROR if s else next(it) for s in rows.skip], pa.string())
        return out

    def close(self) -> None:
        self.judge.close()  # its generation engine (vllm), when one was started
