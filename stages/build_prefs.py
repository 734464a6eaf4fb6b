"""`rlkit build-prefs`: a preference table (prompt, chosen, rejected) for reward-model training.

Reads a policy and a task (or, with --from, an existing preference set). Samples --n completions per
train prompt through the sampling driver (`rlkit.sampling`) on `--engine` (hf, vllm, or auto: vLLM when it imports
and a GPU is present; rollout's engine options), verifies them, and pairs a correct answer with a wrong one.
Unlike a set of (good, nonsense) pairs, it adds plausible negatives (a near miss in the same format, a wrong answer in
polished verbose prose) and balances length, so the reward model must learn the task to separate
them (`rlkit/tasks/prefs.py`). `--bias length` builds the deliberately flawed set in which the longer answer
always wins, for the reward-hacking experiment. A stable --eval-fraction of prompts is marked
`split = heldout` for the reward model's pair accuracy.

With `--judge DIR --rubric FILE` (RLAIF; or `--judge DIR:rubric=FILE`, a judge named as score-ref names one) the
labels are an LLM judge's instead (`rlkit.scorers.judge`): each prompt's distinct samples are paired in turn and the
judge, asked which of the two better meets a pairwise rubric in both orders, labels a pair when the two orders
agree; a pair on which they disagree (position bias, or no preference) is a tie, left out and counted. The
manifest's `judge` entry records the judge's fingerprint, the rubric's sha256, the pairs judged, tied and kept, and
how often the judge agrees with the task's verifier where the verifier tells the two responses apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rlkit import stage_options
from rlkit.options import (
    EngineFlags,
    JudgeRubric,
    PromptColumn,
    SamplerFlags,
    Task,
    TrustVerifier,
    engine_options,
)
from rlkit.stage_options import option, splice


@dataclass(frozen=True)
@splice(EngineFlags, before="eval_fraction", omit=("colocate",))
@splice(SamplerFlags)
class BuildPrefsConfig:
    policy: Path | None = option(None, "--policy", panel="Model", help="Policy to sample from (usually the SFT checkpoint).")
    task: str = option("arithmetic", Task)
    trust_verifier: bool = option(False, TrustVerifier)  # use a verifier that pays junk (rlkit.tasks.trust)
    num_prompts: int = option(512, min=1, panel="Data", help="Train prompts to build pairs for.")
    n: int = option(4, "--n", min=1, panel="Data", help="Samples per prompt to find correct and wrong answers.")
    temperature: float = option(1.0, panel="Sampling", help="Sampling temperature.")
    top_p: float = option(1.0, panel="Sampling", help="Nucleus sampling threshold.")
    max_new_tokens: int | None = option(None, min=1, panel="Sampling", help="Longest sampled answer, in tokens. Default: the task's own generation length (arithmetic 16; math 96, 256 with data=; code 40, 512 with data=; a user task's max_new_tokens, else 16); the manifest records the value in force. A warning says so when more than half of the samples are cut there.")
    # (spliced in here: EngineFlags' --engine, --batch-tokens, --tp, ...)
    eval_fraction: float = option(0.1, panel="Data", help="Fraction of prompts marked split=heldout (stable per prompt).")
    # None | "length"
    bias: str | None = option(None, panel="Data", help="'length': the deliberately flawed set where the longer answer always wins.")
    # [NAME=]DIR[:rubric=FILE], as score-ref's --judge (rlkit.scorers.judge.parse_judges)
    judge: str | None = option(None, "--judge", panel="Model", help="LLM judge (RLAIF) [NAME=]DIR[:rubric=FILE] (the rubric defaults to --rubric, else DIR/rubric.toml, and must be a pairwise one; docs/tasks-rewards.md#naming-a-judge): pair two of each prompt's distinct sampled responses and label them by the judge's preference, asked in both orders (a pair on which the orders disagree is a tie: left out and counted); the verifier labels nothing, its agreement with the judge is recorded.")
    rubric: Path | None = option(None, JudgeRubric)
    source: str | None = option(None, "--from", panel="Data", help="Import a preference set instead (.arrow/.parquet/.jsonl or datasets spec).")
    prompt_column: str = option("prompt", PromptColumn)
    chosen_column: str = option("chosen", panel="Data", help="Column of --from holding the preferred response.")
    rejected_column: str = option("rejected", panel="Data", help="Column of --from holding the other response.")


def run(cfg: BuildPrefsConfig) -> Path | None:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims
    from rlkit.scorers.judge import parse_judges

    devices.parse(cfg.device)
    judges = parse_judges([cfg.judge] if cfg.judge is not None else [], cfg.rubric)  # a malformed spec: one line
    with claims.claim_out(cfg.out, "table", {"--policy": cfg.policy, "--from": cfg.source, "--task": cfg.task,
                                             "--judge": [p for j in judges for p in (j.path, j.rubric)]}), \
            checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _run(cfg: BuildPrefsConfig) -> Path | None:
    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import claims, manifests, streams

    if not 0 < cfg.eval_fraction < 1:
        raise RlkitError(f"--eval-fraction {cfg.eval_fraction} must be between 0 and 1 (e.g. 0.1)")
    if cfg.bias not in (None, "length"):
        raise RlkitError(f"--bias {cfg.bias!r} is not supported; the one deliberate bias is 'length'")
    if cfg.source is not None and (cfg.policy is not None or cfg.bias):
        raise RlkitError("--from imports a preference set as it is: leave out --policy and --bias")
    if cfg.source is None and cfg.policy is None and cfg.bias != "length":
        raise RlkitError("pass --policy DIR (sample and verify) or --from FILE (import a preference set)")
    judge = _judge(cfg)
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    if cfg.source is None and cfg.bias != "length":
        from rlkit import engines

        engines.check(cfg.engine, engine_options(cfg))  # a known name; a named engine takes these options
        if not 0 < cfg.top_p <= 1:
            raise RlkitError(f"--top-p {cfg.top_p:g}: expected a number in (0, 1]")
    checks: dict = {}  # the verifier check's outcome (rlkit.tasks.trust), for the manifest
    rows, inputs, cfg, engine, judged = _imported(cfg) if cfg.source else _sampled(cfg, judge, checks)
    if manifests.skip_if_current(out, "build-prefs", cfg, inputs):
        return out
    if not rows["prompt"] and judged:
        raise RlkitError(f"the judge labelled no pair: all {judged['pairs_judged']} pairs were ties (its answer changed "
                         "with the order the two responses were shown in, or it had no preference); check the judge "
                         "and its rubric, or sample more prompts (--num-prompts)")
    if not rows["prompt"]:
        raise RlkitError("no preference pairs came out; sample more prompts (--num-prompts) or check the input")
    held = rows["split"].count("heldout")
    manifest = manifests.make_manifest("prefs", "build-prefs", cfg, inputs, **({"engine": engine} if engine else {}),
                                       **({"judge": judged} if judged else {}), **checks)
    with streams.write_table("prefs", out, manifest) as w:
        w.write(rows)
    kinds: dict[str, int] = {}
    for k in rows["negative"]:
        kinds[k or "imported"] = kinds.get(k or "imported", 0) + 1
    console.info(f"build-prefs: {len(rows['prompt'])} pairs ({held} held out) "
                 f"by kind: {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}" + (f" -> {out}" if out else ""))
    if judged:
        agree = judged["verifier_agreement"]
        console.info(f"build-prefs: the judge labelled {judged['pairs_kept']} of {judged['pairs_judged']} pairs "
                     f"({judged['ties']} ties: its two orders disagreed); it agrees with the verifier on "
                     + (f"{agree:.1%} of the {judged['verifier_decided']} pairs the verifier tells apart"
                        if agree is not None else "no pair (the verifier tells none apart)"))
    return out


def _judge(cfg: BuildPrefsConfig):
    """--judge (and --rubric), checked before any sampling: a pairwise rubric, the judge hash-checked (always) and
    not the policy itself, its choices single tokens of its tokenizer."""
    from rlkit.errors import RlkitError
    from rlkit.rubrics import taken_by
    from rlkit.scorers.judge import parse_judges, refuse_self_judging

    specs = parse_judges([cfg.judge] if cfg.judge is not None else [], cfg.rubric)
    if not specs:
        return None
    if cfg.source is not None or cfg.bias or cfg.policy is None:
        raise RlkitError("--judge labels pairs of the policy's own samples: pass --policy DIR, without --from or --bias")
    from rlkit import devices
    from rlkit.io import fingerprints

    j = specs[0].load(taken_by("build-prefs"), devices.resolve(cfg.device), trust_remote_code=cfg.trust_remote_code)
    refuse_self_judging(j, {fingerprints.fingerprint(cfg.policy)}, f"--policy {cfg.policy}")
    return j


def _judged_pairs(judge, ex, samples: list[list[str]], rewards: list[list[float]], batch_tokens: int):
    """Each prompt's distinct responses paired in sample order ((1st, 2nd), (3rd, 4th), ...) and labelled by the
    judge (`Judge.compare`, both orders). -> ([(example index, chosen, rejected)], the manifest's figures)."""
    cand = []  # (example index, first, second, their verifier rewards)
    for k, (texts, rs) in enumerate(zip(samples, rewards, strict=True)):
        seen: dict[str, float] = {}
        for t, r in zip(texts, rs, strict=True):
            if t.strip() and t not in seen:
                seen[t] = r
        distinct = list(seen.items())
        cand += [(k, *distinct[i], *distinct[i + 1]) for i in range(0, len(distinct) - 1, 2)]
    prefs = judge.compare([ex[k].prompt for k, *_ in cand], [c[1] for c in cand], [c[3] for c in cand],
                          batch_tokens) if cand else []
    kept, agree, decided = [], 0, 0
    for (k, a, ra, b, rb), p in zip(cand, prefs, strict=True):
        if p is None:
            continue
        (chosen, rc), (rejected, rr) = ((a, ra), (b, rb)) if p == 0 else ((b, rb), (a, ra))
        kept.append((k, chosen, rejected))
        if rc != rr:
            decided += 1
            agree += rc > rr
    figures = {**judge.manifest_entry(), "pairs_judged": len(cand), "ties": len(cand) - len(kept),
               "pairs_kept": len(kept), "verifier_decided": decided,
               "verifier_agreement": agree / decided if decided else None}
    return kept, figures


def _sampled(cfg: BuildPrefsConfig, judge=None, checks: dict | None = None):
    import random

    from rlkit import console, engines, sampling, startup
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, data, fingerprints
    from rlkit.tasks import (
        generation_length,
        get_task,
        prefs,
        task_inputs,
        task_sandbox,
        truncation_warning,
        verify,
    )

    task = get_task(cfg.task)
    sandbox = task_sandbox(task, cfg.sandbox, cfg.sandbox_workers)  # the code task's: checked before sampling
    if cfg.bias != "length":  # the verifier labels the samples: checked before the policy loads
        from rlkit.tasks.trust import trusted

        checked = trusted(task, "build-prefs", sandbox=sandbox, trust=cfg.trust_verifier)
        if checks is not None:
            checks["verifier_check"] = checked.entry()
    cfg = replace(cfg, task=task.spec, max_new_tokens=generation_length(task, cfg.max_new_tokens))  # in force, recorded
    inputs = task_inputs(task)
    if cfg.policy is not None:
        checkpoints.check_model_dir(cfg.policy, "policy")
        inputs["policy"] = fingerprints.fingerprint(cfg.policy)
    if judge is not None:
        inputs["judge"] = f"{judge.fingerprint} {judge.rubric.sha256}"
    ex = task.examples("train", cfg.num_prompts, cfg.seed, unique=True)
    rows: dict[str, list] = {k: [] for k in ("prompt_id", "prompt", "chosen", "rejected", "split", "answer", "negative")}
    chosen = None
    if cfg.bias == "length":
        samples = [[] for _ in ex]  # the flawed set ignores what the policy says
    else:
        if cfg.temperature <= 0:
            raise RlkitError(f"--temperature {cfg.temperature:g}: expected a number > 0 (sampling; 0 would be greedy)")
        chosen, why = engines.choose(cfg.engine)
        engine = engines.create(chosen, cfg.policy, engine_options(cfg))
        startup.done()  # its libraries imported and its model loaded (rlkit.startup)
        console.info(f"build-prefs: engine {chosen} ({why})")  # once the checkpoint is good
        try:
            tokenizer = engine.tokenizer
            texts = [e.prompt for e in ex]
            batch = sampling.Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], texts,
                                     data.encode_prompts(tokenizer, texts, False))
            gen = sampling.sample(engine, batch, sampling.Sampling(n=cfg.n, temperature=cfg.temperature,
                                                                   top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens),
                                  cfg.seed)
        finally:
            engine.close()
        cut = truncation_warning("build-prefs", gen.finish_reasons.count("length"), len(gen.finish_reasons),
                                 cfg.max_new_tokens, task)
        if cut:
            console.warn(cut)
        texts = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        samples = [texts[i * cfg.n:(i + 1) * cfg.n] for i in range(len(ex))]
    # every sample verified at once (the code task's programs concurrently, in its sandbox)
    flat = verify(task, [t for s in samples for t in s], [e.answer for e, s in zip(ex, samples, strict=True) for _ in s],
                  sandbox).values
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + len(s))
    if judge is not None:  # RLAIF: the judge labels the pairs (loaded once the policy's engine has closed)
        rewards = [flat[starts[k]:starts[k + 1]] for k in range(len(ex))]
        kept, figures = _judged_pairs(judge, ex, samples, rewards, cfg.batch_tokens)
        for k, c, r in kept:
            e = ex[k]
            for col, v in (("prompt_id", e.prompt_id), ("prompt", e.prompt), ("chosen", c), ("rejected", r),
                           ("split", prefs.split_of(e.prompt_id, cfg.eval_fraction)), ("answer", e.answer),
                           ("negative", "judged")):
                rows[col].append(v)
        return rows, inputs, cfg, chosen, figures
    for k, (e, s) in enumerate(zip(ex, samples, strict=True)):
        rng = random.Random(f"{cfg.seed}|{e.prompt_id}")
        pairs = (prefs.length_biased_pairs(e.answer, rng) if cfg.bias == "length"
                 else prefs.verified_pairs(e.answer, s, flat[starts[k]:starts[k + 1]], rng))
        for p in pairs:
            rows["prompt_id"].append(e.prompt_id)
            rows["prompt"].append(e.prompt)
            rows["chosen"].append(p.chosen)
            rows["rejected"].append(p.rejected)
            rows["split"].append(prefs.split_of(e.prompt_id, cfg.eval_fraction))
            rows["answer"].append(e.answer)
            rows["negative"].append(p.negative)
    return rows, inputs, cfg, chosen, None


def _imported(cfg: BuildPrefsConfig):
    from rlkit.errors import RlkitError
    from rlkit.io import data
    from rlkit.tasks import prefs

    src = data.load_source(cfg.source, "prefs", {"prompt": cfg.prompt_column, "chosen": cfg.chosen_column,
                                                  "rejected": cfg.rejected_column})
    t = src.table
    cols = {c: t.column(c).to_pylist() for c in ("prompt_id", "prompt", "chosen", "rejected")}
    prefs.check_pairs(src.label, cols["prompt"], cols["chosen"], cols["rejected"])
    given = t.column("split").to_pylist() if "split" in t.column_names else [None] * t.num_rows
    for i, s in enumerate(given):
        if s not in (None, "", "train", "heldout"):
            raise RlkitError(f"{src.label}: row {i} has split {s!r}; expected train or heldout")
    rows = {**cols,
            "split": [s or prefs.split_of(p, cfg.eval_fraction) for s, p in zip(given, cols["prompt_id"], strict=True)],
            "answer": t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows,
            "negative": [None] * t.num_rows}
    return rows, {"from": src.fingerprint}, cfg, None, None


command = stage_options.command(
    BuildPrefsConfig, "Build preference pairs (chosen/rejected) from verified samples or an LLM judge's labels "
    "(--judge), or import a preference set.")
