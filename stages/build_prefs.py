"""`rlkit build-prefs`: a preference table (prompt, chosen, rejected) for reward-model training.

Reads a policy and a task (or, with --from, an existing preference set). Samples --n completions per
train prompt through the sampling driver (`rlkit.sampling`) on `--engine` (hf, vllm, or auto: vLLM when it imports
and a GPU is present; rollout's engine options), verifies them, and pairs a correct answer with a wrong one.
Unlike a set of (good, nonsense) pairs, it adds plausible negatives (a near miss in the same format, a wrong answer in
polished verbose prose) and balances length, so the reward model must learn the task to separate
them (`rlkit/tasks/prefs.py`). `--bias length` builds the deliberately flawed set in which the longer answer
always wins, for the reward-hacking experiment. A stable --eval-fraction of prompts is marked
`split = heldout` for the reward model's pair accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rlkit import stage_options
from rlkit.options import (
    Device,
    EnforceEager,
    EngineName,
    Force,
    GpuMemoryUtilization,
    MaxModelLen,
    NoPlan,
    NoVerify,
    OutTable,
    PromptColumn,
    SamplingDtype,
    SamplingEngine,
    SandboxKind,
    SandboxWorkers,
    Seed,
    Task,
    TensorParallel,
    TrustRemoteCode,
    VllmLora,
)
from rlkit.stage_options import option


@dataclass(frozen=True)
class BuildPrefsConfig:
    policy: Path | None = option(None, "--policy", panel="Model", help="Policy to sample from (usually the SFT checkpoint).")
    task: str = option("arithmetic", Task)
    num_prompts: int = option(512, min=1, panel="Data", help="Train prompts to build pairs for.")
    n: int = option(4, "--n", min=1, panel="Data", help="Samples per prompt to find correct and wrong answers.")
    temperature: float = option(1.0, panel="Sampling", help="Sampling temperature.")
    top_p: float = option(1.0, panel="Sampling", help="Nucleus sampling threshold.")
    max_new_tokens: int | None = option(None, min=1, panel="Sampling", help="Longest sampled answer, in tokens. Default: the task's own generation length (arithmetic 16; math 96, 256 with data=; code 40, 512 with data=; a user task's max_new_tokens, else 16); the manifest records the value in force. A warning says so when more than half of the samples are cut there.")
    engine: EngineName = option("auto", SamplingEngine)
    batch_tokens: int = option(16384, min=16, panel="Optimization", help="Token budget per generation batch (hf engine).")
    tp: int = option(1, TensorParallel)
    gpu_memory_utilization: float | None = option(None, GpuMemoryUtilization)
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option("auto", SamplingDtype)
    max_model_len: int | None = option(None, MaxModelLen)
    enforce_eager: bool = option(False, EnforceEager)
    vllm_lora: Literal["adapter", "merge"] = option("adapter", VllmLora)
    eval_fraction: float = option(0.1, panel="Data", help="Fraction of prompts marked split=heldout (stable per prompt).")
    # None | "length"
    bias: str | None = option(None, panel="Data", help="'length': the deliberately flawed set where the longer answer always wins.")
    source: str | None = option(None, "--from", panel="Data", help="Import a preference set instead (.arrow/.parquet/.jsonl or datasets spec).")
    prompt_column: str = option("prompt", PromptColumn)
    chosen_column: str = option("chosen", panel="Data", help="Column of --from holding the preferred response.")
    rejected_column: str = option("rejected", panel="Data", help="Column of --from holding the other response.")
    sandbox: str | None = option(None, SandboxKind)  # where the code task's programs run (default bwrap)
    sandbox_workers: int | None = option(None, SandboxWorkers)
    seed: int = option(0, Seed)
    device: str = option("auto", Device)  # where the policy samples (rlkit.devices)
    out: Path | None = option(None, OutTable)
    trust_remote_code: bool = option(False, TrustRemoteCode)
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory check before vLLM starts on a GPU
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the policy (never for a reference)
    force: bool = option(False, Force)


def run(cfg: BuildPrefsConfig) -> Path | None:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims

    devices.parse(cfg.device)
    with claims.claim_out(cfg.out, "table", {"--policy": cfg.policy, "--from": cfg.source, "--task": cfg.task}), \
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
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    if cfg.source is None and cfg.bias != "length":
        from rlkit import engines

        engines.check(cfg.engine, _engine_options(cfg))  # a known name; a named engine takes these options
        if not 0 < cfg.top_p <= 1:
            raise RlkitError(f"--top-p {cfg.top_p:g}: expected a number in (0, 1]")
    rows, inputs, cfg, engine = _imported(cfg) if cfg.source else _sampled(cfg)
    if manifests.skip_if_current(out, "build-prefs", cfg, inputs):
        return out
    if not rows["prompt"]:
        raise RlkitError("no preference pairs came out; sample more prompts (--num-prompts) or check the input")
    held = rows["split"].count("heldout")
    manifest = manifests.make_manifest("prefs", "build-prefs", cfg, inputs, **({"engine": engine} if engine else {}))
    with streams.write_table("prefs", out, manifest) as w:
        w.write(rows)
    kinds: dict[str, int] = {}
    for k in rows["negative"]:
        kinds[k or "imported"] = kinds.get(k or "imported", 0) + 1
    console.info(f"build-prefs: {len(rows['prompt'])} pairs ({held} held out) "
                 f"by kind: {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}" + (f" -> {out}" if out else ""))
    return out


def _sampled(cfg: BuildPrefsConfig):
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
    cfg = replace(cfg, task=task.spec, max_new_tokens=generation_length(task, cfg.max_new_tokens))  # in force, recorded
    inputs = task_inputs(task)
    if cfg.policy is not None:
        checkpoints.check_model_dir(cfg.policy, "policy")
        inputs["policy"] = fingerprints.fingerprint(cfg.policy)
    ex = task.examples("train", cfg.num_prompts, cfg.seed, unique=True)
    rows: dict[str, list] = {k: [] for k in ("prompt_id", "prompt", "chosen", "rejected", "split", "answer", "negative")}
    chosen = None
    if cfg.bias == "length":
        samples = [[] for _ in ex]  # the flawed set ignores what the policy says
    else:
        if cfg.temperature <= 0:
            raise RlkitError(f"--temperature {cfg.temperature:g}: expected a number > 0 (sampling; 0 would be greedy)")
        chosen, why = engines.choose(cfg.engine)
        engine = engines.create(chosen, cfg.policy, _engine_options(cfg))
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
    return rows, inputs, cfg, chosen


def _engine_options(cfg: BuildPrefsConfig):
    """The engine's share of the config (`engines.EngineOptions`)."""
    from rlkit import engines

    return engines.EngineOptions(seed=cfg.seed, trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens,
                                 tp=cfg.tp, gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=cfg.dtype,
                                 max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager, lora=cfg.vllm_lora,
                                 device=cfg.device, plan=cfg.plan)


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
    return rows, {"from": src.fingerprint}, cfg, None


command = stage_options.command(
    BuildPrefsConfig, "Build preference pairs (chosen/rejected) from verified samples, or import a preference set.")
