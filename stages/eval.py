"""`rlkit eval`: greedy held-out accuracy of a policy.

Reads a policy and either a task's held-out split or a prompts file (scored by the task's verifier
against its answer column). Prints accuracy, mean response length and sample responses as a table, or
JSON with --json (each sample with the prompt token ids the model saw: chat template and special tokens); --metrics appends the figures as one JSON line to the file `update --metrics` writes
(held-out accuracy beside reward, KL and length, per round), --report-to sends them to experiment trackers.
Responses are up to the task's generation length unless --max-new-tokens says otherwise; one cut there is
counted (`truncated_fraction`, verdict `truncated`) and a warning line names --max-new-tokens when most are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rlkit import stage_options
from rlkit.io.tracking import TrackingConfig
from rlkit.options import (
    TRACKING,
    AnswerColumn,
    Device,
    Metrics,
    NoVerify,
    PolicyDir,
    PromptColumn,
    SandboxKind,
    SandboxWorkers,
    Seed,
    Task,
    TrustRemoteCode,
)
from rlkit.stage_options import nested, option


@dataclass(frozen=True)
class EvalConfig:
    policy: Path = option(..., PolicyDir)
    task: str = option("arithmetic", Task)
    prompts: str | None = option(None, panel="Data", help="Prompts file (.arrow/.parquet/.jsonl), '-' for a table on stdin, or a datasets spec, instead of the task's held-out split.")
    prompt_column: str = option("prompt", PromptColumn)
    answer_column: str = option("answer", AnswerColumn)
    num: int = option(300, "--num-prompts", min=1, panel="Data", help="Number of held-out prompts.")
    max_new_tokens: int | None = option(None, min=1, panel="Sampling", help="Longest response, in tokens (TRL's max_completion_length, verl's response_length). Default: the task's own generation length (arithmetic 16; math 96, 256 with data=; code 40, 512 with data=; a user task's max_new_tokens, else 16). A response cut there is counted as truncated (verdict `truncated` where the task gives verdicts), and a warning says so when more than half are.")
    batch_tokens: int = option(16384, min=16, panel="Optimization", help="Token budget per generation batch.")
    as_json: bool = option(False, "--json", panel="Output & tracking", help="Print JSON to stdout instead of tables.")
    metrics: Path | None = option(None, Metrics)
    tracking: TrackingConfig = nested(TRACKING)  # --report-to, --run-name, --project, --tensorboard
    label: str | None = option(None, panel="Output & tracking", help="A name recorded with the figures (e.g. 'round-3').")
    # also report the mean reward-model score of the same responses
    rm: Path | None = option(None, "--rm", panel="Model", help="Reward model DIR: also report the mean score it gives the same responses.")
    sandbox: str | None = option(None, SandboxKind)  # where the code task's programs run (default bwrap)
    sandbox_workers: int | None = option(None, SandboxWorkers)
    seed: int = option(0, Seed)
    device: str = option("auto", Device)
    trust_remote_code: bool = option(False, TrustRemoteCode)
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the policy (never for a reference)


def run(cfg: EvalConfig) -> dict:
    """Claims its outputs, --metrics and the trackers' (see `claims.claim_out`: never an input, never a
    file it did not make) and runs the stage."""
    from rlkit import devices
    from rlkit.io import checkpoints, claims, tracking

    devices.parse(cfg.device)
    inputs = {"--policy": cfg.policy, "--prompts": cfg.prompts, "--rm": cfg.rm, "--task": cfg.task}
    side = {"--metrics": (cfg.metrics, "metrics"), **tracking.outputs(cfg.tracking, "eval", cfg.policy)}
    with claims.claim_out(None, "file", inputs, side), checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _run(cfg: EvalConfig) -> dict:
    import json
    import sys

    from rlkit import console, devices
    from rlkit.io import checkpoints, data, metrics_log, tracking
    from rlkit.tasks import generation_length, get_task, task_sandbox, truncation_warning
    from rlkit.tasks.evaluate import greedy_eval

    task = get_task(cfg.task)
    cfg = replace(cfg, max_new_tokens=generation_length(task, cfg.max_new_tokens))  # the value in force, recorded
    sandbox = task_sandbox(task, cfg.sandbox, cfg.sandbox_workers)  # checked before the model loads
    tracking.check(cfg.tracking)
    checkpoints.check_model_dir(cfg.policy, "policy")
    source = None
    if cfg.prompts:
        source = data.load_source(cfg.prompts, "prompts", {"prompt": cfg.prompt_column, "answer": cfg.answer_column})
    dev = devices.resolve(cfg.device)
    model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code, merged=True)  # LoRA: merged
    model.to(dev)
    if source is not None:
        source = source.head(cfg.num)
        prompts = data.render_prompts(tokenizer, source, for_sft=False)
        t = source.table
        answers = t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows
    else:
        held = task.examples("heldout", cfg.num, cfg.seed)
        prompts, answers = [e.prompt for e in held], [e.answer for e in held]
    devices.announce("eval", dev, "fp32")
    ev = greedy_eval(model, tokenizer, prompts, answers, task, sandbox=sandbox, chat=bool(source and source.chat),
                     max_new_tokens=cfg.max_new_tokens, batch_tokens=cfg.batch_tokens)
    responses = ev.pop("responses")
    finished = ev.pop("finish_reasons")
    cut = truncation_warning("eval", finished.count("length"), len(finished), cfg.max_new_tokens, task)
    if cut:
        console.warn(cut)
    if cfg.rm is not None:
        from rlkit.tasks.reward_model import load_reward_model, score_texts

        rm, rm_tok = load_reward_model(cfg.rm, cfg.trust_remote_code, device=dev)
        scores = score_texts(rm, rm_tok, prompts, responses, cfg.batch_tokens)
        ev["rm_score_mean"] = sum(scores) / len(scores)
    result = {
        "policy": str(cfg.policy),
        "step": checkpoints.policy_step(cfg.policy),
        "task": task.spec,
        "prompts": cfg.prompts or f"{task.spec} heldout (seed {cfg.seed})",
        "max_new_tokens": cfg.max_new_tokens,
        **ev,
    }
    if cfg.label:
        result["label"] = cfg.label
    row = {"stage": "eval", **{k: v for k, v in result.items() if k != "samples"},
           # the verdicts as fractions too, scalars a tracker plots beside the accuracy
           **{f"verdict/{k}": v / max(1, result["n_scored"]) for k, v in result.get("verdicts", {}).items()}}
    metrics_log.write(row, cfg.metrics)
    with tracking.open_tracking(cfg.tracking, "eval", cfg, policy=cfg.policy) as tracker:
        tracker.log(row)
    if cfg.as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        from rich.table import Table

        acc = result["accuracy"]
        summary = Table(title=f"eval {cfg.policy} (step {result['step']})", show_header=False)
        summary.add_row("held-out accuracy", "n/a (no answers)" if acc is None else f"{acc:.1%} of {result['n_scored']}")
        summary.add_row("mean response tokens", f"{result['mean_response_tokens']:.2f}")
        if "rm_score_mean" in result:
            summary.add_row("mean reward-model score", f"{result['rm_score_mean']:.4f} ({cfg.rm})")
        summary.add_row(f"hit max-new-tokens ({cfg.max_new_tokens})", f"{result['truncated_fraction']:.1%}")
        if "verdicts" in result:
            summary.add_row("verdicts", ", ".join(f"{k} {v}" for k, v in result["verdicts"].items()))
        summary.add_row("prompts", result["prompts"])
        samples = Table(title="samples")
        for col in ("prompt", "response", "answer"):
            samples.add_column(col)
        for s in result["samples"]:
            samples.add_row(s["prompt"], repr(s["response"]), str(s["answer"]))
        console.err.print(summary)
        console.err.print(samples)
    return result


command = stage_options.command(EvalConfig, "Greedy held-out accuracy, response length and sample responses of a policy.")
