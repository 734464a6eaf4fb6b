"""The shape of the work `rlkit plan` sizes, and where each figure came from: the stage's input table, read and
checked as the stage reads it (`read_input`), its longest prompt and completion (`longest`), the prompt and
completion tokens and rows planned for (`work_of`), and the micro-batches a rank runs (`micro_batches`).
"""

from __future__ import annotations


def read_input(stage: str, s):
    """The stage's input table, read and checked as the stage reads and checks it -> (table, label), or None
    (no input named: the plan does not read stdin)."""
    from rlkit.io import data, streams

    if stage in ("update", "pipe"):
        if not s.inp or s.inp == "-":
            return None
        from rlkit import algorithms

        inp = algorithms.get(s.rl.algo).input()
        table, reader = streams.read_table(s.inp, list(inp.kinds), require_rows=False)
        inp.check(reader.kind, s.rl)
        return table, f"--in {s.inp}"
    if stage == "score-ref":
        if not s.inp or s.inp == "-":
            return None
        table, _ = streams.read_table(s.inp, ["rollouts", "scored", "prefs"], require_rows=False)
        return table, f"--in {s.inp}"
    if stage == "train-rm":
        if s.prefs == "-":
            return None
        src = data.load_source(s.prefs, "prefs", {})
        from rlkit.tasks import prefs

        t = src.table.to_pydict()
        prefs.check_pairs(src.label, t["prompt"], t["chosen"], t["rejected"])
        return None  # pairs of text: their lengths are the tokenizer's, --max-length bounds them
    if stage == "sft" and s.data:
        data.load_source(s.data, "sft", {"prompt": s.prompt_column, "completion": s.completion_column})
    return None


def longest(got) -> tuple[int, int, int] | None:
    """(longest prompt, longest completion, rows) of a token table (rollouts, scored), or None."""
    if got is None:
        return None
    import pyarrow.compute as pc

    table = got[0]
    names = table.schema.names
    if "prompt_ids" not in names or "completion_ids" not in names or not table.num_rows:
        return None
    p = pc.max(pc.list_value_length(table.column("prompt_ids"))).as_py() or 1
    c = pc.max(pc.list_value_length(table.column("completion_ids"))).as_py() or 1
    return int(p), int(c), table.num_rows


DEFAULT_TOKENS = 256  # prompt and completion each, where nothing else gives them (at most half the model's context)


def work_of(stage: str, s, cfg, config: dict, rows: tuple[int, str], limit: tuple[int, int, str] | None = None,
          table=None):
    """The shape planned for: prompt and completion tokens from --prompt-tokens/--completion-tokens, else the input
    table's longest, else the stage's own limit `limit` (prompt, completion, its flag), else DEFAULT_TOKENS each
    (half the model's context where that is shorter); `rows` (value, where from). Refused past the model's
    context. `cfg`: plan's options (--prompt-tokens, --completion-tokens). -> planner.Work, with `origin` saying
    where each figure came from."""
    from rlkit import planner
    from rlkit.errors import RlkitError

    ctx = int(config.get("max_position_embeddings") or 0)
    got = longest(table)
    batch_rows = None
    if got is not None:
        prompt, completion = (got[0], f"{table[1]}, its longest"), (got[1], f"{table[1]}, its longest")
        batch_rows = got[2]
    elif limit is not None:
        prompt, completion = (limit[0], limit[2]), (limit[1], limit[2])
    else:
        d = min(DEFAULT_TOKENS, ctx // 2) if ctx else DEFAULT_TOKENS
        why = (f"the default {DEFAULT_TOKENS}" if d == DEFAULT_TOKENS else
               f"half the model's {ctx}-token context: the default {DEFAULT_TOKENS} is longer")
        prompt, completion = (d, why), (d, why)
    if cfg.prompt_tokens:
        prompt = (cfg.prompt_tokens, "--prompt-tokens")
    if cfg.completion_tokens:
        completion = (cfg.completion_tokens, "--completion-tokens")
    if ctx and prompt[0] + completion[0] > ctx:
        raise RlkitError(f"plan {stage}: a sequence of {prompt[0]:,} prompt ({prompt[1]}) + {completion[0]:,} completion "
                         f"({completion[1]}) tokens is longer than the model's context of {ctx:,} tokens "
                         f"(max_position_embeddings); expected at most {ctx:,} together")
    origin = {"prompt_tokens": prompt[1], "completion_tokens": completion[1], "rows": rows[1]}
    if batch_rows is not None:
        origin["batch_rows"] = f"{table[1]}, its rows"
    return planner.Work(prompt[0], completion[0], rows[0], batch_rows, origin)


def check_world(stage: str, work, hw, flag: str) -> None:
    from rlkit.errors import RlkitError

    if hw.gpus > work.rows:
        raise RlkitError(f"plan {stage}: --gpus {hw.gpus} is more GPUs than the {work.rows:,} rows of one optimizer step "
                         f"({flag}); expected at most {work.rows:,} (each GPU trains at least one row)")


def micro_batches(train, work, hw) -> dict:
    """The micro-batches a rank runs, as the trace cuts them, and where their size came from."""
    from rlkit.training import GPU_MICRO_BATCH_TOKENS

    per_rank = -(-work.rows // hw.gpus)
    length = work.prompt + work.completion
    if train.micro_batch_size is not None:
        size, why = train.micro_batch_size, "--micro-batch-size"
    else:
        tokens = train.micro_batch_tokens or GPU_MICRO_BATCH_TOKENS
        size = max(1, tokens // length)
        why = (f"--micro-batch-tokens {tokens:,}" if train.micro_batch_tokens else
               f"the GPU's default budget of {tokens:,} tokens")
    size = min(size, per_rank)
    return {"rows_per_gpu": per_rank, "micro_batch_rows": size, "micro_batches_per_gpu": -(-per_rank // size),
            "micro_batch_from": why}
