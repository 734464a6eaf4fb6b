"""`rlkit prompts`: write a task's prompts, or its SFT pairs, as a table.

Reads a task spec; writes a 'prompts' table (prompt_id, prompt, answer, split) or, with --sft, an
'sft' table (prompt, completion). Users edit such files and hand them to stages with --prompts or
--data; a stage rerun after the edit sees a new fingerprint and does the work again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rlkit import stage_options
from rlkit.options import Force, OutTable, Seed, Task
from rlkit.stage_options import option


@dataclass(frozen=True)
class PromptsConfig:
    task: str = option("arithmetic", Task)
    split: Literal["train", "heldout"] = option("train", panel="Data", help="Which split: train or heldout (they never overlap).")
    num: int = option(1000, "--num-prompts", min=1, panel="Data", help="Number of rows.")
    sft: bool = option(False, "--sft", panel="Data", help="Write prompt/completion pairs (an 'sft' table) instead.")
    seed: int = option(0, Seed)
    out: Path | None = option(None, OutTable)
    force: bool = option(False, Force)


def run(cfg: PromptsConfig) -> Path | None:
    from rlkit.io import claims

    with claims.claim_out(cfg.out, "table", {"--task": cfg.task}):
        return _run(cfg)


def _run(cfg: PromptsConfig) -> Path | None:
    from rlkit.io import claims, manifests, streams
    from rlkit.tasks import get_task, task_inputs

    task = get_task(cfg.task)
    cfg = replace(cfg, task=task.spec)
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    inputs = task_inputs(task)
    if manifests.skip_if_current(out, "prompts", cfg, inputs):
        return out
    import itertools

    examples = itertools.islice(task.iter_examples(cfg.split, cfg.seed), cfg.num)
    kind = "sft" if cfg.sft else "prompts"
    written = 0
    with streams.write_table(kind, out, manifests.make_manifest(kind, "prompts", cfg, inputs)) as w:
        while chunk := list(itertools.islice(examples, 4096)):
            written += len(chunk)
            cols = {
                "prompt_id": [e.prompt_id for e in chunk],
                "prompt": [e.prompt for e in chunk],
                "split": [e.split for e in chunk],
            }
            if cfg.sft:
                cols["completion"] = [task.completion(e) for e in chunk]
            else:
                cols["answer"] = [e.answer for e in chunk]
            w.write(cols)
    if cfg.split == "heldout" and 0 < written < cfg.num:  # a smaller held-out split is written whole (one rule)
        from rlkit import console

        console.info(f"prompts: the held-out split of task {task.spec} holds {written} example"
                     f"{'s' * (written > 1)}, fewer than --num-prompts {cfg.num}: wrote {'all ' * (written > 1)}of them")
    return out


command = stage_options.command(PromptsConfig, "Write a task's prompts (or SFT pairs) as an Arrow table.")
