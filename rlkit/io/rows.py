"""Row checks: what a rollouts, scored or prefs table must be before a model reads it, each refusal one line
naming the row as the user can find it. Shared by every stage that feeds a table's token ids to a model
(`score-ref`, `sft --data`, `update`): the ids fit the model's vocabulary and context (`check_rows`,
`check_pair_lengths`), some completion has tokens (`check_not_all_empty`), and a multi-turn row's `loss_mask`
is one 0/1 a completion token with a sampled one among them (`check_loss_mask`, `loss_masks`). Torch-free:
pyarrow and numpy, vectorised.
"""

from __future__ import annotations

from typing import NamedTuple

from rlkit.errors import RlkitError


class Limits(NamedTuple):
    """What a model can take, checked on every row of a table before it runs (`check_rows`)."""

    vocab: int  # rows of the input embedding: valid token ids are 0 .. vocab - 1
    context: int | None  # the longest sequence it was built for (max_position_embeddings), None if unknown
    what: str = "the model"  # named in the messages: "--policy pol/", "reference ref/"

    @classmethod
    def of(cls, model, what: str = "the model") -> Limits:
        emb = model.get_input_embeddings()
        vocab = int(getattr(emb, "num_embeddings", 0) or model.config.vocab_size)
        return cls(vocab, context_length(model.config), what)


# config attributes that hold a model's context length, by architecture family
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(config) -> int | None:
    """A transformers config's context length (max_position_embeddings or its older names); None if it has none."""
    for key in _CONTEXT_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def row_name(table, i: int, row0: int = 0) -> str:
    """'row 3 (prompt_id 'q7', sample 1)': row `i` of `table`, row `row0 + i` of the whole table, as the user
    can find it."""
    names = table.schema.names
    parts = []
    if "prompt_id" in names:
        parts.append(f"prompt_id {table.column('prompt_id')[i].as_py()!r}")
    if "sample_idx" in names:
        parts.append(f"sample {table.column('sample_idx')[i].as_py()}")
    return f"row {row0 + i}" + (f" ({', '.join(parts)})" if parts else "")


def check_rows(table, limits: Limits, label: str, *, row0: int = 0, budget: int | None = None,
               budget_flag: str = "--batch-tokens") -> None:
    """Refuse, in one line naming the row and the column, a rollouts/scored table (or record batch) the model
    cannot take: a token id outside `limits.vocab` (negative or too large: another tokenizer's table), an empty
    prompt, a prompt + completion longer than the model's context, or (`budget`) longer than the token
    budget of one forward batch, which `budget_flag` raises. `row0`: the first row's number in the whole
    table (a stream checked batch by batch). Vectorised: a table of millions of tokens costs milliseconds."""
    import pyarrow as pa

    for batch in table.to_batches() if isinstance(table, pa.Table) else [table]:
        _check_batch(batch, limits, label, row0, budget, budget_flag)
        row0 += batch.num_rows


def _check_batch(table, limits: Limits, label: str, row0: int, budget: int | None, budget_flag: str) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    for col in ("prompt_ids", "completion_ids"):
        ids = table.column(col)
        flat = pc.list_flatten(ids)
        if len(flat) == 0:
            continue
        lo, hi = pc.min_max(flat).values()
        if lo.as_py() >= 0 and hi.as_py() < limits.vocab:
            continue
        bad = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, limits.vocab))
        k = pc.index(bad, pa.scalar(True)).as_py()
        row = pc.list_parent_indices(ids)[k].as_py()
        raise RlkitError(f"{label}: {row_name(table, row, row0)}, column '{col}', holds token id "
                         f"{flat[k].as_py()}, outside {limits.what}'s vocabulary (0..{limits.vocab - 1}); the table "
                         "was tokenized for another model, or is damaged")
    plen = pc.list_value_length(table.column("prompt_ids")).fill_null(0)
    clen = pc.list_value_length(table.column("completion_ids")).fill_null(0)
    if len(plen) and pc.min(plen).as_py() == 0:
        row = pc.index(plen, pa.scalar(0, plen.type)).as_py()
        raise RlkitError(f"{label}: {row_name(table, row, row0)} has an empty 'prompt_ids'; a completion is scored "
                         "given its prompt, which needs at least one token (the BOS token)")
    total = pc.add(plen, clen)
    longest = pc.max(total).as_py() if len(total) else 0
    for limit, what in ((limits.context, f"{limits.what}'s context of {limits.context} tokens "
                                         "(max_position_embeddings)"),
                        (budget, f"{budget_flag} {budget}, the token budget of one forward batch")):
        if limit is None or longest <= limit:
            continue
        row = pc.index(pc.greater(total, limit), pa.scalar(True)).as_py()
        n, p = total[row].as_py(), plen[row].as_py()
        fix = ("drop or shorten such rows (rollout --max-new-tokens caps completions)" if limit == limits.context
               else f"raise {budget_flag} to at least {n} if memory allows")
        raise RlkitError(f"{label}: {row_name(table, row, row0)} is {n} tokens long (prompt {p} + completion "
                         f"{n - p}), more than {what}; {fix}")


def check_pair_lengths(table, side: str, prompts: list[list[int]], responses: list[list[int]], limits: Limits | None,
                       label: str, row0: int = 0, budget: int | None = None) -> None:
    """A prefs table's pairs, tokenized: refuse a prompt + `side` response longer than the model's context (or
    than `budget`, --batch-tokens), naming the pair."""
    checks = []
    if limits is not None and limits.context is not None:
        checks.append((limits.context, f"{limits.what}'s context of {limits.context} tokens (max_position_embeddings)",
                       "drop or shorten such pairs"))
    if budget is not None:
        checks.append((budget, f"--batch-tokens {budget}, the token budget of one forward batch",
                       "raise --batch-tokens to at least {n} if memory allows"))
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        for limit, what, fix in checks:
            if n > limit:
                raise RlkitError(f"{label}: {row_name(table, i, row0)}: prompt + {side} response is {n} tokens, "
                                 f"more than {what}; {fix.format(n=n)}")


def check_not_all_empty(table, label: str) -> None:
    """A table whose every completion has no token gives no loss to descend: one line, not autograd's error.
    (Some empty completions are fine: they weigh nothing.)"""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(table.column("completion_ids")).fill_null(0)
    if table.num_rows and pc.max(lengths).as_py() == 0:
        raise RlkitError(f"{label}: every completion is empty (0 tokens in all {table.num_rows} rows): nothing to "
                         "train on; sample again (rollout --max-new-tokens must be > 0, and the policy must not end "
                         "every answer at once)")


def loss_masks(table, label: str = "the input", row0: int = 0) -> list[list[int] | None] | None:
    """A rollouts/scored table's `loss_mask` column (multi-turn rows: 1 on the completion tokens the policy
    sampled, 0 on those the environment appended), checked (`check_loss_mask`): None when the table has none or
    every row is null (single-turn: every completion token sampled), else one list a row (None: that row's
    tokens all sampled)."""
    lm = check_loss_mask(table, label, row0)
    return None if lm is None else lm.to_pylist()


def check_loss_mask(table, label: str = "the input", row0: int = 0):
    """Refuse, in one line naming the row, a `loss_mask` whose length is not its completion's, a value other than
    0 or 1, or a non-empty completion with no sampled token (nothing of it to train on). Vectorised.
    -> the column as one Arrow array, or None when the table has none or every row of it is null."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if "loss_mask" not in table.column_names:
        return None
    lm = table.column("loss_mask")
    if lm.null_count == len(lm):
        return None
    if isinstance(lm, pa.ChunkedArray):
        lm = lm.combine_chunks()
    what = ("loss_mask holds one entry a completion token: 1 where the policy sampled it, 0 where the "
            "environment added it")
    n_mask = pc.list_value_length(lm).to_numpy(zero_copy_only=False)
    n_comp = pc.list_value_length(table.column("completion_ids")).fill_null(0).to_numpy(zero_copy_only=False)
    present = ~np.asarray(lm.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    bad = present & (np.nan_to_num(n_mask, nan=0).astype(np.int64) != n_comp)
    if bad.any():
        i = int(bad.argmax())
        raise RlkitError(f"{label}: {row_name(table, i, row0)} has {int(n_mask[i])} loss_mask entries but "
                         f"{int(n_comp[i])} completion tokens; {what}")
    flat = pc.list_flatten(lm)
    values = np.asarray(flat.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    parents = np.asarray(pc.list_parent_indices(lm).to_numpy(zero_copy_only=False), dtype=np.int64)
    wrong = (values != 0) & (values != 1)
    if wrong.any():
        k = int(wrong.argmax())
        v = flat[k].as_py()
        raise RlkitError(f"{label}: {row_name(table, int(parents[k]), row0)} has loss_mask value {v} at completion "
                         f"token {k - int((parents < parents[k]).sum())}; {what}")
    sampled = np.bincount(parents, weights=values, minlength=len(lm))
    none = present & (n_comp > 0) & (sampled == 0)
    if none.any():
        i = int(none.argmax())
        raise RlkitError(f"{label}: {row_name(table, i, row0)} has no token sampled by the policy (its loss_mask is "
                         f"all 0 over {int(n_comp[i])} completion tokens): nothing of it can be trained on; drop the "
                         "row, or check the environment that wrote it")
    return lm


