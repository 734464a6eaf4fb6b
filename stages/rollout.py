"""`rlkit rollout`: sample n completions per prompt from the policy and score them with the task's
verifier.

Reads a policy checkpoint and prompts (a task's train split, or --prompts FILE). Writes a 'rollouts'
table, streamed batch by batch: prompt and completion token ids, the sampling policy's log-prob of
each completion token (pi_old, at the sampling temperature), the finish reason, the checkpoint's
fingerprint and step, and each reward component as a `reward/<name>` column (`reward/verifier`).
Same seed and inputs give the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import typer

from rlkit.options import AnswerColumn, Force, OutTable, PolicyDir, PromptColumn, Seed, Task, TrustRemoteCode


@dataclass(frozen=True)
class RolloutConfig:
    policy: Path
    out: Path | None = None
    task: str = "arithmetic"
    prompts: str | None = None
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    num_prompts: int | None = None  # task default 64; a prompts file: all rows
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0
    engine: str = "auto"
    batch_tokens: int = 16384
    tp: int = 1
    gpu_memory_utilization: float | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False
    chunk_prompts: int = 64
    shard: str | None = None  # "i/N": this job's share of the prompts (whole chunks), see rlkit.shards
    trust_remote_code: bool = False
    force: bool = False


def run(cfg: RolloutConfig) -> Path | None:
    import pyarrow as pa

    from rlkit import artifacts, checkpoints, console, data, engines, shards
    from rlkit.errors import RlkitError
    from rlkit.tasks import get_task

    task = get_task(cfg.task)
    if cfg.engine not in engines.ENGINES:
        raise RlkitError(f"--engine {cfg.engine!r} is not one of {', '.join(engines.ENGINES)}")
    if cfg.engine == "hf" and (cfg.tp != 1 or cfg.gpu_memory_utilization or cfg.max_model_len or cfg.enforce_eager):
        raise RlkitError("--tp, --gpu-memory-utilization, --max-model-len and --enforce-eager are vLLM options; "
                         "pass --engine vllm (or auto) with them")
    if cfg.temperature <= 0 or not (0 < cfg.top_p <= 1):
        raise RlkitError("sampling needs --temperature > 0 and 0 < --top-p <= 1 (use `rlkit eval` for greedy)")
    checkpoints.check_model_dir(cfg.policy, "policy")
    out = artifacts.resolve_out(cfg.out)
    artifacts.check_out(out, "table")
    cfg = replace(cfg, task=task.spec)
    inputs = {"policy": artifacts.fingerprint(cfg.policy)}
    if cfg.prompts:
        source = data.load_source(cfg.prompts, "prompts", {"prompt": cfg.prompt_column, "answer": cfg.answer_column})
        inputs["prompts"] = source.fingerprint
        source = source.head(cfg.num_prompts)
        t = source.table
        ids, answers = t.column("prompt_id").to_pylist(), (
            t.column("answer").to_pylist() if "answer" in t.column_names else [None] * t.num_rows)
    else:
        source = None
        cfg = replace(cfg, num_prompts=cfg.num_prompts or 64)
        ex = task.examples("train", cfg.num_prompts, cfg.seed)
        ids, answers = [e.prompt_id for e in ex], [e.answer for e in ex]
    span = range(len(ids))
    if cfg.shard:
        span = shards.prompt_span(shards.parse(cfg.shard), len(ids), cfg.chunk_prompts)
    if artifacts.skip_if_current(out, "rollout", cfg, inputs):
        return out

    chosen, why = engines.choose(cfg.engine)
    console.info(f"rollout: engine {chosen} ({why})")
    if chosen == "vllm":
        tokenizer = checkpoints.load_tokenizer(cfg.policy, cfg.trust_remote_code)
        opts = engines.VLLMOptions(tp=cfg.tp, gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=cfg.dtype,
                                   max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager)
        engine = engines.VLLMEngine(cfg.policy, tokenizer, opts, cfg.seed, cfg.trust_remote_code)
    else:
        if cfg.dtype not in ("auto", "fp32"):
            raise RlkitError(f"--dtype {cfg.dtype}: the hf engine samples in fp32 (pass --engine vllm for other dtypes)")
        model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code)
        engine = engines.HFEngine(model, tokenizer, cfg.batch_tokens)
    texts = data.render_prompts(tokenizer, source, for_sft=False) if source else [e.prompt for e in ex]
    prompt_ids = data.encode_prompts(tokenizer, texts, bool(source and source.chat))
    scored = all(a is not None for a in answers)
    if not scored:
        console.warn("some prompts have no gold answer: no verifier reward column is written")
    extra = [pa.field("reward/verifier", pa.float64())] if scored else []
    fp, step = inputs["policy"], checkpoints.policy_step(cfg.policy)
    manifest = artifacts.make_manifest("rollouts", "rollout", cfg, inputs,
                                       tokenizer=checkpoints.tokenizer_fingerprint(tokenizer), engine=engine.name,
                                       **shards.manifest_entry(cfg.shard, span, len(ids), artifacts.jsonable(cfg),
                                                               inputs))
    n = cfg.n
    with artifacts.write_table("rollouts", out, manifest, extra) as w, \
            console.progress("rollout", len(span) * n) as bar:
        # chunks keep their global position and seed whatever the shard, so shards concatenate into the
        # table one job gives
        for c0 in range(span.start, span.stop, cfg.chunk_prompts):
            c1 = min(span.stop, c0 + cfg.chunk_prompts)
            gen = engine.sample(prompt_ids[c0:c1], n=n, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, seed=cfg.seed * 1_000_003 + c0)
            comps = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
            rows = [(c0 + k // n, k % n) for k in range(len(comps))]
            cols = {
                "prompt_id": [ids[p] for p, _ in rows],
                "group_id": [p for p, _ in rows],
                "sample_idx": [j for _, j in rows],
                "prompt": [texts[p] for p, _ in rows],
                "completion": comps,
                "prompt_ids": [prompt_ids[p] for p, _ in rows],
                "completion_ids": gen.completion_ids,
                "old_logprobs": gen.logprobs,
                "finish_reason": gen.finish_reasons,
                "policy_fingerprint": [fp] * len(rows),
                "policy_step": [step] * len(rows),
                "answer": [answers[p] for p, _ in rows],
            }
            if scored:
                cols["reward/verifier"] = [task.reward(c, answers[p]) for c, (p, _) in zip(comps, rows, strict=True)]
            w.write(cols)
            bar.advance(len(rows), **({"reward": sum(cols["reward/verifier"]) / len(rows)} if scored else {}))
    if isinstance(engine, engines.VLLMEngine):
        engine.close()
    return out


def command(
    policy: PolicyDir,
    task: Task = "arithmetic",
    prompts: Annotated[str | None, typer.Option(help="Prompts file (.arrow/.parquet/.jsonl), '-' for stdin, or datasets spec; default: the task's train split.")] = None,
    prompt_column: PromptColumn = "prompt",
    answer_column: AnswerColumn = "answer",
    num_prompts: Annotated[int | None, typer.Option(min=1, help="Prompts to sample for (task default 64; a file: all rows).")] = None,
    n: Annotated[int, typer.Option("--n", min=1, help="Completions per prompt (the group size).")] = 8,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Longest completion, in tokens.")] = 16,
    engine: Annotated[str, typer.Option(help="Rollout engine: hf, vllm, or auto (vLLM when it imports and a GPU is present, else hf).")] = "auto",
    batch_tokens: Annotated[int, typer.Option(min=16, help="Token budget per generation batch (hf engine).")] = 16384,
    tp: Annotated[int, typer.Option("--tp", min=1, help="vLLM tensor-parallel size (GPUs per engine).")] = 1,
    gpu_memory_utilization: Annotated[float | None, typer.Option(min=0.01, max=1.0, help="vLLM memory fraction (default 0.9 on a GPU, 0.3 on vLLM's CPU backend).")] = None,
    dtype: Annotated[str, typer.Option(help="vLLM weights/compute dtype: auto (the checkpoint's), float32, bfloat16, float16.")] = "auto",
    max_model_len: Annotated[int | None, typer.Option(min=16, help="vLLM context length (default: the model's).")] = None,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="vLLM: no CUDA graphs (faster start-up).")] = False,
    shard: Annotated[str | None, typer.Option(help="I/N: sample only this job's share of the prompts (0 <= I < N); `rlkit cat` joins the N shards into the table one job gives.")] = None,
    seed: Seed = 0,
    out: OutTable = None,
    trust_remote_code: TrustRemoteCode = False,
    force: Force = False,
) -> None:
    """Sample n completions per prompt with log-probs and verifier rewards; streams a rollouts table."""
    run(RolloutConfig(policy=policy, out=out, task=task, prompts=prompts, prompt_column=prompt_column,
                      answer_column=answer_column, num_prompts=num_prompts, n=n, temperature=temperature,
                      top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, engine=engine,
                      batch_tokens=batch_tokens, tp=tp, gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                      max_model_len=max_model_len, enforce_eager=enforce_eager, shard=shard,
                      trust_remote_code=trust_remote_code, force=force))
