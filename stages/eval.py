"""`rlkit eval`: greedy held-out accuracy of a policy.

Reads a policy and either a task's held-out split or a prompts file (scored by the task's verifier
against its answer column), and samples one greedy response each through the sampling driver (`rlkit.sampling`)
on `--engine` (hf, vllm, or auto: vLLM when it imports and a GPU is present) with rollout's engine options.
With `--env SPEC` each prompt is one greedy multi-turn trajectory against the environment (its own held-out
prompts when it brings them): `mean_reward` (in place of `accuracy`) is the mean trajectory reward (reward/env),
beside the mean turns, tool calls and how the trajectories ended. Prints accuracy, mean response length and sample responses as a table, or
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
    EngineFlags,
    EnvFlags,
    Metrics,
    PolicyDir,
    PromptColumn,
    SamplerFlags,
    Task,
    TrustVerifier,
    engine_options,
)
from rlkit.stage_options import nested, option, splice


@dataclass(frozen=True)
@splice(EnvFlags, before="engine")
@splice(EngineFlags, before="as_json", omit=("colocate",))
@splice(SamplerFlags, omit=("out", "force"))
class EvalConfig:
    policy: Path = option(..., PolicyDir)
    task: str = option("arithmetic", Task)
    trust_verifier: bool = option(False, TrustVerifier)  # use a verifier that pays junk (rlkit.tasks.trust)
    prompts: str | None = option(None, panel="Data", help="Prompts file (.arrow/.parquet/.jsonl), '-' for a table on stdin, or a datasets spec, instead of the task's held-out split.")
    prompt_column: str = option("prompt", PromptColumn)
    answer_column: str = option("answer", AnswerColumn)
    num: int = option(300, "--num-prompts", min=1, panel="Data", help="Number of held-out prompts.")
    max_new_tokens: int | None = option(None, min=1, panel="Sampling", help="Longest response, in tokens (TRL's max_completion_length, verl's response_length); under --env, the longest model turn (per turn; a whole trajectory is --max-total-tokens). Default: the environment's max_new_tokens under --env, else the task's own generation length (arithmetic 16; math 96, 256 with data=; code 40, 512 with data=; a user task's max_new_tokens, else 16). A response cut there is counted as truncated (verdict `truncated` where the task gives verdicts), and a warning says so when more than half are.")
    # (spliced in here: EnvFlags' --env, --max-turns, ..., then EngineFlags' --engine, --batch-tokens, ...)
    as_json: bool = option(False, "--json", panel="Output & tracking", help="Print JSON to stdout instead of tables.")
    metrics: Path | None = option(None, Metrics)
    tracking: TrackingConfig = nested(TRACKING)  # --report-to, --run-name, --project, --tensorboard
    label: str | None = option(None, panel="Output & tracking", help="A name recorded with the figures (e.g. 'round-3').")
    # also report the mean reward-model score of the same responses
    rm: Path | None = option(None, "--rm", panel="Model", help="Reward model DIR: also report the mean score it gives the same responses.")


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

    from rlkit import console, devices, engines
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, data, metrics_log, tracking
    from rlkit.sampling.evaluate import engine_eval, env_eval
    from rlkit.tasks import generation_length, get_task, heldout_examples, task_sandbox, truncation_warning

    env = None
    if cfg.env is not None:
        from rlkit.envs import get_env

        env = get_env(cfg.env).sandboxed(cfg.sandbox)  # a bad spec, class or option: one line before anything starts
        if cfg.rm is not None:
            raise RlkitError("--rm scores single responses; with --env the environment's rewards score the "
                             "trajectories: leave out one of them")
    task = get_task(cfg.task)
    if env is not None and callable(env.attribute("iter_examples")) and not cfg.prompts:
        from rlkit.envs import env_task

        task = env_task(env)  # the environment brings its own held-out prompts
    if env is not None and cfg.max_new_tokens is None and isinstance(env.attribute("max_new_tokens"), int):
        cfg = replace(cfg, max_new_tokens=env.attribute("max_new_tokens"))  # the environment's turn length
    cfg = replace(cfg, max_new_tokens=generation_length(task, cfg.max_new_tokens))  # the value in force, recorded
    sandbox = task_sandbox(task, cfg.sandbox, cfg.sandbox_workers) if env is None else None  # before the model loads
    tracking.check(cfg.tracking)
    engines.check(cfg.engine, engine_options(cfg))  # a known name; a named engine takes these options
    if cfg.vllm_lora not in ("adapter", "merge"):
        raise RlkitError(f"--vllm-lora {cfg.vllm_lora!r} is not one of adapter, merge")
    checkpoints.check_model_dir(cfg.policy, "policy")
    source = None
    if cfg.prompts:
        source = data.load_source(cfg.prompts, "prompts", {"prompt": cfg.prompt_column, "answer": cfg.answer_column})
    checked = None
    if env is None:  # the verifier that scores the responses: checked before the model loads (rlkit.tasks.trust)
        from rlkit.tasks.trust import trusted

        checked = trusted(task, "eval", sandbox=sandbox, trust=cfg.trust_verifier)
    chosen, why = engines.choose(cfg.engine)
    engine = engines.create(chosen, cfg.policy, engine_options(cfg))
    try:
        tokenizer = engine.tokenizer
        ids = None
        if source is not None:
            source = source.head(cfg.num)
            prompts = data.render_prompts(tokenizer, source, for_sft=False,
                                          tools=env.tool_schemas() if env is not None else None)
            t = source.table
            answers = t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows
            ids = t.column("prompt_id").to_pylist()
        else:
            held = heldout_examples(task, cfg.num, cfg.seed, "eval", "--num-prompts")  # a smaller split: all of it
            prompts, answers, ids = [e.prompt for e in held], [e.answer for e in held], [e.prompt_id for e in held]
        console.info(f"eval: engine {chosen} ({why})")  # once the checkpoint and the prompts are good
        devices.announce("eval", engine.device, getattr(engine, "dtype", None))
        if env is None:
            ev = engine_eval(engine, prompts, answers, task, sandbox=sandbox, chat=bool(source and source.chat),
                             max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        else:
            ev = env_eval(engine, env, prompts, answers, _sampling(cfg), ids=ids, seed=cfg.seed)
    finally:
        engine.close()  # the GPU memory is free for --rm's model
    finished = ev.pop("finish_reasons")
    cut = truncation_warning("eval", finished.count("length"), len(finished), cfg.max_new_tokens, task)
    if cut and env is None:
        console.warn(cut)
    if env is None:
        responses = ev.pop("responses")
    else:
        ev.pop("rewards")
    if cfg.rm is not None:
        from rlkit.scorers.reward_model import load_reward_model, score_texts

        rm, rm_tok = load_reward_model(cfg.rm, cfg.trust_remote_code, device=devices.resolve(cfg.device))
        scores = score_texts(rm, rm_tok, prompts, responses, cfg.batch_tokens)
        ev["rm_score_mean"] = sum(scores) / len(scores)
    result = {
        "policy": str(cfg.policy),
        "step": checkpoints.policy_step(cfg.policy),
        "task": task.spec,
        "prompts": cfg.prompts or f"{task.spec} heldout (seed {cfg.seed})",
        "max_new_tokens": cfg.max_new_tokens,
        "engine": chosen,
        **({"env": env.spec, "max_turns": cfg.max_turns} if env is not None else {}),
        **ev,
        **({"verifier_check": checked.entry()} if checked is not None else {}),
    }
    if cfg.label:
        result["label"] = cfg.label
    row = {"stage": "eval", **{k: v for k, v in result.items() if k not in ("samples", "verifier_check")},
           # the verdicts as fractions too, scalars a tracker plots beside the accuracy
           **{f"verdict/{k}": v / max(1, result["n_scored"]) for k, v in result.get("verdicts", {}).items()}}
    metrics_log.write(row, cfg.metrics)
    with tracking.open_tracking(cfg.tracking, "eval", cfg, policy=cfg.policy) as tracker:
        tracker.log(row)
    if cfg.as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        from rich.table import Table

        acc = result["mean_reward" if env is not None else "accuracy"]
        summary = Table(title=f"eval {cfg.policy} (step {result['step']})", show_header=False)
        if env is not None:
            summary.add_row("mean trajectory reward (reward/env)",
                            "n/a (no prompts)" if acc is None else f"{acc:.4g} over {result['n']} trajectories")
            summary.add_row("mean turns", f"{result['mean_turns']:.2f} (at most {cfg.max_turns})")
            summary.add_row("mean tool calls", f"{result['mean_tool_calls']:.2f}")
            summary.add_row("ended", ", ".join(f"{k} {v}" for k, v in result["end_reasons"].items()))
        else:
            summary.add_row("held-out accuracy", "n/a (no answers)" if acc is None else f"{acc:.1%} of {result['n_scored']}")
        summary.add_row("mean response tokens", f"{result['mean_response_tokens']:.2f}")
        if "rm_score_mean" in result:
            summary.add_row("mean reward-model score", f"{result['rm_score_mean']:.4f} ({cfg.rm})")
        if env is None:
            summary.add_row(f"hit max-new-tokens ({cfg.max_new_tokens})", f"{result['truncated_fraction']:.1%}")
        summary.add_row("engine", result["engine"])
        if "verdicts" in result:
            summary.add_row("verdicts", ", ".join(f"{k} {v}" for k, v in result["verdicts"].items()))
        summary.add_row("prompts", result["prompts"])
        if checked is not None:
            summary.add_row("verifier check", checked.summary())
        samples = Table(title="samples")
        if env is None:
            for col in ("prompt", "response", "answer"):
                samples.add_column(col)
            for s in result["samples"]:
                samples.add_row(s["prompt"], repr(s["response"]), str(s["answer"]))
        else:
            for col in ("conversation", "reward", "ended"):
                samples.add_column(col)
            for s in result["samples"]:
                talk = "\n".join(f"{m['role']}: {m['content']!r}" for m in s["messages"])
                samples.add_row(talk, f"{s['reward']:.4g}", f"{s['end_reason']} after {s['turns']} turns")
        console.err.print(summary)
        console.err.print(samples)
    return result


def _sampling(cfg: EvalConfig):
    """The driver's options for one greedy trajectory per prompt (`rlkit.sampling.Sampling`)."""
    from rlkit.sampling import Sampling

    return Sampling.of(cfg, n=1, temperature=0.0)


command = stage_options.command(EvalConfig, "Greedy held-out accuracy (with --env: mean trajectory reward), response "
                                            "length and sample responses of a policy.")
