"""The two input kinds an algorithm reads, table -> typed in-memory batch: `Rollouts` (a rollouts or
scored table -> `RLBatch`) and `Prefs` (a prefs table scored by the reference -> `PrefBatch`). Each
also says which table kinds `update` opens, what it refuses about the input, and the metrics the
input itself gives (the rewards). Plus what every rollout algorithm reads besides the tensors: the
trainer's own pi_old (`recompute_logprobs`) and how far it is from the engine's (`mismatch_metrics`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlkit.algorithms.config import RLConfig
from rlkit.errors import RlkitError
from rlkit.io.manifests import Manifest
from rlkit.io.schemas import token_rewards_part_of
from rlkit.ops.logprobs import completion_logprobs, pack_sequences
from rlkit.ops.losses import importance_ess
from rlkit.rewards import combine_rewards
from rlkit.training import Precision


class RLBatch(NamedTuple):
    """A rollout batch as tensors. N sequences, L = longest prompt+completion, C = longest completion.

    `mask` is what every loss, aggregation, KL, entropy, advantage and token count reads: the completion
    tokens the policy sampled. In a multi-turn row (a `loss_mask` column) the tokens the environment appended
    (tool results, feedback) are in the sequence, so the model reads them, but off `mask`; `span` then marks
    every completion token, sampled or not (log-probs are computed on all of them)."""

    input_ids: Tensor  # (N, L) long, right-padded
    attn: Tensor  # (N, L)
    targets: Tensor  # (N, C) completion tokens
    mask: Tensor  # (N, C) bool, True on completion tokens sampled by the policy (trained on)
    start: Tensor  # (N,) position whose logits predict completion token 0
    old_logp: Tensor  # (N, C) pi_old, logged at rollout
    ref_logp: Tensor | None  # (N, C) pi_ref from score-ref, or None
    rewards: Tensor  # (N,) combined reward
    groups: Tensor  # (N,) group ids
    span: Tensor | None = None  # (N, C) bool, True on every completion token (environment ones too); None: `mask`
    teacher_logp: Tensor | None = None  # (N, C) a teacher's log-probs of the completion tokens (score-ref --teacher)
    # (N, C) per-token rewards (a `token_rewards` column) times their --reward weight; their row sums are in `rewards`
    token_rewards: Tensor | None = None

    @property
    def completion_mask(self) -> Tensor:
        """(N, C) bool: every completion token, sampled by the policy or appended by the environment."""
        return self.mask if self.span is None else self.span


class PrefBatch(NamedTuple):
    """P preference pairs packed as 2P sequences: rows 0..P-1 the chosen responses, P..2P-1 the rejected."""

    input_ids: Tensor  # (2P, L) long, right-padded prompt + response (+ eos)
    attn: Tensor  # (2P, L)
    targets: Tensor  # (2P, C) response tokens
    mask: Tensor  # (2P, C) bool
    start: Tensor  # (2P,)
    ref_logp: Tensor  # (2P,) summed reference log-probs of each response
    heldout: Tensor  # (P,) bool, split == heldout


class Loaded(NamedTuple):
    """An input table made ready to train on."""

    batch: Any  # RLBatch | PrefBatch
    train: dict[str, Any]  # keyword arguments of Trainer.train (temperature, length_norm, recompute, lags)
    metrics: dict[str, Any]  # what the input says about itself (reward means, ...)
    reward_weights: dict[str, float] | None  # the reward components' weights used (for the manifest)


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


def _row_name(table, i: int, row0: int = 0) -> str:
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
        raise RlkitError(f"{label}: {_row_name(table, row, row0)}, column '{col}', holds token id "
                         f"{flat[k].as_py()}, outside {limits.what}'s vocabulary (0..{limits.vocab - 1}); the table "
                         "was tokenized for another model, or is damaged")
    plen = pc.list_value_length(table.column("prompt_ids")).fill_null(0)
    clen = pc.list_value_length(table.column("completion_ids")).fill_null(0)
    if len(plen) and pc.min(plen).as_py() == 0:
        row = pc.index(plen, pa.scalar(0, plen.type)).as_py()
        raise RlkitError(f"{label}: {_row_name(table, row, row0)} has an empty 'prompt_ids'; a completion is scored "
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
        raise RlkitError(f"{label}: {_row_name(table, row, row0)} is {n} tokens long (prompt {p} + completion "
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
                raise RlkitError(f"{label}: {_row_name(table, i, row0)}: prompt + {side} response is {n} tokens, "
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


def _padded(rows: list[list[float]], C: int) -> Tensor:
    out = torch.zeros((len(rows), C), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def parse_weights(specs: tuple[str, ...]) -> dict[str, float] | None:
    """--reward NAME=W ... -> {NAME: W}; None when none is given (every component with weight 1)."""
    import math

    if not specs:
        return None
    out = {}
    for s in specs:
        name, eq, w = s.partition("=")
        try:
            out[name.strip()] = float(w)
        except ValueError:
            eq = ""
        if eq and not math.isfinite(out[name.strip()]):
            raise RlkitError(f"--reward {s!r}: the weight must be a finite number")
        if not eq or not name.strip():
            raise RlkitError(f"--reward {s!r}: expected NAME=WEIGHT, e.g. verifier=1.0")
    return out


def verdict_fractions(table) -> dict[str, float]:
    """{'verdict/<component>/<reason>': fraction of rows} for each `verdict/<component>` column (the code
    task's passed, wrong_answer, timeout, ...), so a run's metrics show why its rewards are what they are."""
    out: dict[str, float] = {}
    for name in table.column_names:
        if name.startswith("verdict/"):
            vals = table.column(name).to_pylist()
            for r in sorted({v for v in vals if v is not None}):
                out[f"{name}/{r}"] = sum(v == r for v in vals) / max(1, len(vals))
    return out


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
        raise RlkitError(f"{label}: {_row_name(table, i, row0)} has {int(n_mask[i])} loss_mask entries but "
                         f"{int(n_comp[i])} completion tokens; {what}")
    flat = pc.list_flatten(lm)
    values = np.asarray(flat.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    parents = np.asarray(pc.list_parent_indices(lm).to_numpy(zero_copy_only=False), dtype=np.int64)
    wrong = (values != 0) & (values != 1)
    if wrong.any():
        k = int(wrong.argmax())
        v = flat[k].as_py()
        raise RlkitError(f"{label}: {_row_name(table, int(parents[k]), row0)} has loss_mask value {v} at completion "
                         f"token {k - int((parents < parents[k]).sum())}; {what}")
    sampled = np.bincount(parents, weights=values, minlength=len(lm))
    none = present & (n_comp > 0) & (sampled == 0)
    if none.any():
        i = int(none.argmax())
        raise RlkitError(f"{label}: {_row_name(table, i, row0)} has no token sampled by the policy (its loss_mask is "
                         f"all 0 over {int(n_comp[i])} completion tokens): nothing of it can be trained on; drop the "
                         "row, or check the environment that wrote it")
    return lm


def sampled_tokens(table, masks: list[list[int] | None] | None = None) -> list[int]:
    """Each row's completion tokens sampled by the policy: the completion's length, less the environment's
    tokens of a multi-turn row (`masks`: `loss_masks(table)`)."""
    comps = table.column("completion_ids").to_pylist()
    if masks is None:
        return [len(c) for c in comps]
    return [len(c) if m is None else sum(m) for c, m in zip(comps, masks, strict=True)]


class Overlong(NamedTuple):
    """DAPO's soft overlong punishment (`rlkit.ops.shaping.overlong_penalty`): `buffer` tokens below the rollout's
    --max-new-tokens `max_len`, falling to -`penalty`."""

    max_len: int
    buffer: int
    penalty: float


def _reward_columns(table, length_penalty: float, masks: list[list[int] | None] | None = None,
                    overlong: Overlong | None = None,
                    token_rewards: list[list[float]] | None = None) -> dict[str, list[float]]:
    cols = {n.split("/", 1)[1]: table.column(n).to_pylist() for n in table.column_names if n.startswith("reward/")}
    if token_rewards is not None and token_rewards_part_of(table.schema) is None:
        cols["token_rewards"] = [float(sum(v)) for v in token_rewards]  # their row sums are one more component
    if length_penalty:  # the tokens the policy sampled: an environment's tool output costs it nothing
        cols["length_penalty"] = [-length_penalty * n for n in sampled_tokens(table, masks)]
    if overlong is not None:
        from rlkit.ops.shaping import overlong_penalty

        cols["overlong"] = overlong_penalty(sampled_tokens(table), *overlong)
    return cols


def build_batch(table, pad_id: int, weights: dict[str, float] | None = None,
                length_penalty: float = 0.0, label: str = "the input", overlong: Overlong | None = None,
                mask_truncated: bool = False) -> tuple[RLBatch, dict[str, float]]:
    """Tensors from a rollouts/scored Arrow table. `length_penalty` > 0 adds the component
    `length_penalty` = -length_penalty * sampled completion tokens (weight 1) to the reward; `overlong` adds DAPO's
    soft overlong punishment as the component `overlong` (weight 1); `mask_truncated` leaves the rows cut at the
    length limit (finish_reason "length") out of the loss (their rewards still count in their groups' baselines).

    A `loss_mask` column (multi-turn rows, `loss_masks`) is ANDed into the batch's `mask` here, and only here:
    everything downstream trains on and counts the tokens the policy sampled."""
    prompts = table.column("prompt_ids").to_pylist()
    comps = table.column("completion_ids").to_pylist()
    old = table.column("old_logprobs").to_pylist()
    for i, (c, o) in enumerate(zip(comps, old, strict=True)):
        if len(c) != len(o):
            raise RlkitError(f"row {i}: {len(c)} completion tokens but {len(o)} old log-probs; the rollouts table is corrupt")
    masks = loss_masks(table, label)
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, pad_id)
    span = None
    if masks is not None:
        span, sampled = mask, mask.clone()
        for i, m in enumerate(masks):
            if m is not None:
                sampled[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
        mask = sampled & span
    C = targets.shape[1]
    ref = None
    if "ref_logprobs" in table.column_names:
        ref = _padded(table.column("ref_logprobs").to_pylist(), C)
    teacher, tok_rewards = (_per_token(table, name, comps, label) for name in ("teacher_logprobs", "token_rewards"))
    if length_penalty:
        weights = None if weights is None else {**weights, "length_penalty": 1.0}
    if overlong is not None:
        weights = None if weights is None else {**weights, "overlong": 1.0}
    totals, used = combine_rewards(_reward_columns(table, length_penalty, masks, overlong, tok_rewards), weights)
    rewards = torch.tensor(totals, dtype=torch.float64).to(torch.float32)
    # the component they are counted in: their own, or the one they are a share of (`rollout --env`'s: env), so a
    # reward is never counted twice; weighed as that component is
    owner = token_rewards_part_of(table.schema) or "token_rewards"
    tok = None if tok_rewards is None or not used.get(owner) else _padded(tok_rewards, C) * used[owner]
    groups = torch.tensor(table.column("group_id").to_pylist(), dtype=torch.long)
    if mask_truncated:
        cut = torch.tensor([f == "length" for f in table.column("finish_reason").to_pylist()], dtype=torch.bool)
        if bool(cut.all()):
            raise RlkitError(f"{label}: every row was cut at the length limit (finish_reason length), so "
                             "--mask-truncated leaves nothing to train on; raise rollout's --max-new-tokens")
        mask = mask & ~cut.unsqueeze(1)
    return RLBatch(ids, attn, targets, mask, start, _padded(old, C), ref, rewards, groups, span,
                   None if teacher is None else _padded(teacher, C), tok), used


def _per_token(table, name: str, comps: list[list[int]], label: str) -> list[list[float]] | None:
    """A per-token column (`rlkit.io.schemas.TOKEN_FIELDS`): one finite value a completion token, every row, and
    for `teacher_logprobs` none above 0 (a log-probability); None when the table has no such column. One line
    naming the first row that breaks it."""
    import math

    if name not in table.column_names:
        return None
    rows = table.column(name).to_pylist()
    for i, (c, v) in enumerate(zip(comps, rows, strict=True)):
        if v is None or len(v) != len(c):
            got = "none" if v is None else f"{len(v)}"
            raise RlkitError(f"{label}: {_row_name(table, i)} has {got} {name} entries but {len(c)} completion "
                             f"tokens; {name} holds one value a completion token")
        if not all(math.isfinite(x) for x in v):
            raise RlkitError(f"{label}: {_row_name(table, i)} has a non-finite value in {name}")
        if name == "teacher_logprobs" and (j := next((j for j, x in enumerate(v) if x > 0), None)) is not None:
            raise RlkitError(f"{label}: {_row_name(table, i)} has {v[j]:g} at completion token {j} in {name}, above "
                             "0, which no log-probability is; expected the teacher's log-probs (`score-ref --teacher`)")
    return rows


def refuse_multi_turn(table, label: str = "the input") -> None:
    """DPO's input: refuse multi-turn rows (a `loss_mask` with a 0, or `turns` > 1) in one line naming the first.
    A preference pair is two whole text responses; DPO cannot leave an environment's tokens out of them."""
    import pyarrow.compute as pc

    why = None
    if "loss_mask" in table.column_names:
        lm = table.column("loss_mask")
        zero = pc.equal(pc.list_flatten(lm), 0).fill_null(False)
        if pc.any(zero).as_py():
            i = pc.list_parent_indices(lm)[pc.index(zero, True).as_py()].as_py()
            why = (i, "its loss_mask marks environment tokens (0)")
    if why is None and "turns" in table.column_names:
        many = pc.greater(table.column("turns"), 1).fill_null(False)
        if pc.any(many).as_py():
            i = pc.index(many, True).as_py()
            why = (i, f"it has {table.column('turns')[i].as_py()} turns")
    if why is not None:
        raise RlkitError(f"{label}: {_row_name(table, why[0])} is a multi-turn trajectory ({why[1]}); --algo dpo "
                         "trains on whole single-turn responses and cannot keep environment tokens out of its loss: "
                         "build the pairs from single-turn rollouts, or train multi-turn rows with a policy-gradient "
                         "--algo (grpo, ppo, ...)")


def build_pref_batch(table, tokenizer, limits: Limits | None = None, label: str = "the input") -> PrefBatch:
    """Tensors from a prefs table that `score-ref --ref` has scored; `limits`: refuse a pair longer than the
    model's context, naming it."""
    from rlkit.io.data import encode_responses

    refuse_multi_turn(table, label)
    for col in ("ref_chosen_logp", "ref_rejected_logp"):
        if col not in table.column_names or table.column(col).null_count:
            raise RlkitError("--algo dpo needs the reference's log-probs of chosen and rejected: pipe the prefs "
                             "through `rlkit score-ref --ref REF` first")
    prompts = table.column("prompt").to_pylist()
    p_c, r_c = encode_responses(tokenizer, prompts, table.column("chosen").to_pylist())
    p_r, r_r = encode_responses(tokenizer, prompts, table.column("rejected").to_pylist())
    for side, ps, rs in (("chosen", p_c, r_c), ("rejected", p_r, r_r)):
        check_pair_lengths(table, side, ps, rs, limits, label)
    ids, attn, targets, mask, start = pack_sequences(p_c + p_r, r_c + r_r, tokenizer.pad_token_id)
    ref = torch.tensor(table.column("ref_chosen_logp").to_pylist() + table.column("ref_rejected_logp").to_pylist(),
                       dtype=torch.float32)
    held = torch.tensor([s == "heldout" for s in table.column("split").to_pylist()], dtype=torch.bool)
    return PrefBatch(ids, attn, targets, mask, start, ref, held)


def recompute_logprobs(model, batch: RLBatch, temperature: float, chunk_rows: int, prec: Precision | None = None,
                       host: RLBatch | None = None, *, engine=None) -> Tensor:
    """Log-probs of the completion tokens under `model` in precision `prec`, no grad: (N, C) on the batch's
    device, 0 past each completion (a multi-turn row's environment tokens included: they are off `mask`, not
    off this); `chunk_rows` rows per forward pass, packed (`rlkit.ops.packing`). `host`: the same batch on the
    CPU, which sizes the passes without a device sync (default `batch`). `engine`
    (`rlkit.training.engine.Engine`): its model, precision, micro-batches and layout (--no-packing) instead, and
    under torchrun its data-parallel split (`Engine.forward_rows`: each rank recomputes its share of the rows,
    then every rank holds all of them)."""
    from rlkit.ops.packing import from_padded, layout

    host = batch if host is None else host
    tokens, plens = from_padded(host.input_ids, host.attn, host.start)
    rows = torch.arange(len(batch.old_logp))
    out = torch.zeros_like(batch.old_logp)
    if engine is not None:  # data-parallel: each rank its share of the rows, then gathered
        C = out.shape[1]

        def run(c: Tensor) -> Tensor:
            lp, _ = completion_logprobs(engine.model, engine.layout([tokens[i] for i in c], [plens[i] for i in c]),
                                        temperature=temperature)
            return torch.nn.functional.pad(lp, (0, C - lp.shape[1]))

        with engine.prec.autocast():
            engine.forward_rows(rows, host.attn.sum(1), chunk_rows, run, out)
        return out * batch.completion_mask
    with torch.no_grad(), (prec or Precision()).autocast():
        for c in rows.split(chunk_rows):
            seqs = layout([tokens[i] for i in c], [plens[i] for i in c]).to(out.device)
            lp, _ = completion_logprobs(model, seqs, temperature=temperature)
            out[c.to(out.device), : lp.shape[1]] = lp
    return out * batch.completion_mask


def mismatch_metrics(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, lags: Tensor | None = None) -> dict[str, Any]:
    """How far the recomputed pi_old (the proximal policy) is from the behaviour policy's logged
    log-probs: mean/max |difference| per token, the importance weights' normalised ESS and, given each
    row's policy lag (N,), the mismatch on the rows sampled by this very policy (the engine's alone)."""
    gap = (old_logp - engine_logp).abs()[mask]
    out: dict[str, Any] = {"logprob_mismatch": float(gap.mean()) if gap.numel() else 0.0,
                           "logprob_mismatch_max": float(gap.max()) if gap.numel() else 0.0,
                           "is_ess": importance_ess(old_logp, engine_logp, mask)}
    if lags is not None:
        fresh = mask & (lags == 0).unsqueeze(1)
        g = (old_logp - engine_logp).abs()[fresh]
        out["logprob_mismatch_fresh"] = float(g.mean()) if g.numel() else None
    return out


def batch_inputs(batch: RLBatch, old_logp: Tensor, recompute: bool, tis: Tensor | None, uses_ref: bool,
                 model=None) -> dict:
    """What a policy step reads, root causes first, for `rlkit.training.trainer.non_finite_error`: the input
    table's columns that reach the loss (`uses_ref`: a KL term or penalty reads ref_logprobs), the
    rewards, `model`'s weights (the starting ones: pass it on an update's first step only, later a
    diverged step can have made them non-finite), the recomputed pi_old."""
    return {"the input table's old_logprobs": batch.old_logp if not recompute or tis is not None else None,
            "the input table's ref_logprobs": batch.ref_logp if uses_ref else None,
            "the reward (the input table's reward/* columns)": batch.rewards,
            "the starting weights": model,
            "the recomputed pi_old": old_logp if recompute else None}


NO_TEACHER = ("{flag} needs a teacher's log-probs, but the input has none: pipe the rollouts through "
              "`rlkit score-ref --teacher DIR` first")
NO_REF = ("--beta > 0 needs reference log-probs, but the input has none: pipe the rollouts through "
          "`rlkit score-ref --ref REF` first (or pass --beta 0)")


class Rollouts:
    """A rollouts table (`rollout`) or a scored one (`score-ref`: + reference log-probs, reward-model
    and reward-function scores), whole prompt groups."""

    kinds = ("rollouts", "scored")
    # mean_turns and environment_token_fraction: multi-turn batches only (a single-turn one has neither)
    shown = ("reward_mean", "reward_std", "verifier_accuracy", "prompts_sampled", "extra_prompts",
             "informative_group_fraction", "mean_turns", "environment_token_fraction")

    def __init__(self) -> None:
        self.said_reward = self.said_recompute = False

    def check(self, kind: str, cfg: RLConfig) -> None:
        """Before anything is read: a KL leash needs the reference's log-probs."""
        if cfg.beta > 0 and kind == "rollouts":
            raise RlkitError(NO_REF)

    def check_upstream(self, upstream: Manifest, tokenizer, policy) -> None:
        from rlkit.io import checkpoints

        want = upstream.tokenizer
        if want and want != checkpoints.tokenizer_fingerprint(tokenizer):
            raise RlkitError(f"policy {policy} has a different tokenizer from the one that sampled these rollouts")

    def load(self, table, *, upstream: Manifest, tokenizer, rl: RLConfig, dtype: str, weights: dict[str, float] | None,
             length_penalty: float, policy_fingerprint: str | None = None, lags: Tensor | None = None,
             label: str = "the input", limits: Limits | None = None, budget: int | None = None,
             overlong: tuple[int, float] | None = None, mask_truncated: bool = False) -> Loaded:
        """`policy_fingerprint`: warn when the rows were sampled from another checkpoint (one update; under
        --follow every row is, by its lag). `lags` (N,): the rows' policy lags under --follow. `limits`: the
        policy's vocabulary and context, which every row must fit (`check_rows`) before the model runs;
        `budget` (with `limits`): --micro-batch-tokens, which every row must fit too."""
        from rlkit import console
        from rlkit.io import trajectories

        if rl.teacher_coef and "teacher_logprobs" not in table.column_names:
            raise RlkitError(NO_TEACHER.format(flag="--algo distill" if rl.algo == "distill"
                                               else f"--teacher-coef {rl.teacher_coef:g}"))
        for col in ("prompt_ids", "completion_ids", "old_logprobs"):
            if table.column(col).null_count:
                raise RlkitError(f"{label}: column '{col}' has missing values; rollouts need token ids and log-probs")
        if limits is not None:
            check_rows(table, limits, label, budget=budget, budget_flag="--micro-batch-tokens")
        check_not_all_empty(table, label)
        check_loss_mask(table, label)
        if policy_fingerprint is not None and any(
                p != policy_fingerprint for p in set(table.column("policy_fingerprint").to_pylist())):
            console.warn("these rollouts were sampled from another checkpoint than --policy (off-policy); "
                         "the pi_theta/pi_old ratio corrects for it, within the clip range")
        temperature = upstream.temperature
        shape = None
        if overlong is not None:  # (buffer, penalty) against the rollout's single-turn --max-new-tokens
            shape = Overlong(_overlong_limit(upstream.sampling, overlong[0], label), *overlong)
        if mask_truncated and "finish_reason" not in table.column_names:
            raise RlkitError(f"{label} has no finish_reason column, so --mask-truncated cannot tell the truncated rows")
        batch, used = build_batch(table, tokenizer.pad_token_id, weights, length_penalty, label, shape, mask_truncated)
        if not self.said_reward:
            from rlkit.algorithms import registry

            said = "update: reward = " + " + ".join(f"{w:g}*{k}" for k, w in used.items())
            if not getattr(registry.get(rl.algo), "uses_reward", True):
                said += f" (logged; --algo {rl.algo} does not train on it)"
            elif weights is None:
                said += " (the sum of the components present; weigh them with --reward NAME=W)"
            console.info(said)
            self.said_reward = True
        from rlkit import engines

        engine = upstream.engine
        trusted = engines.capabilities(engine).logprobs_match_trainer  # hf: True; vllm, unknown or none: False
        lagged = lags is not None and int(lags.max()) > 0
        recompute = rl.old_logprobs == "recompute" or (rl.old_logprobs == "auto" and (
            not trusted or dtype != "fp32" or lagged))
        if rl.old_logprobs == "auto" and (not trusted or dtype != "fp32") and not self.said_recompute:
            why = (f"rollouts sampled by engine {engine or 'unknown'}" if not trusted else
                   f"--dtype {dtype} computes other log-probs than the fp32 engine")
            console.info(f"update: {why}: recomputing pi_old with the trainer (--old-logprobs engine to trust the engine's)")
            self.said_recompute = True
        comps = _reward_columns(table, length_penalty, loss_masks(table, label) if length_penalty else None, shape,
                                table.column("token_rewards").to_pylist() if "token_rewards" in table.column_names
                                else None)
        rew = batch.rewards
        metrics = {
            "reward_mean": float(rew.mean()),
            "reward_std": float(rew.std()) if len(rew) > 1 else 0.0,
            **{f"reward/{k}": sum(v) / len(v) for k, v in comps.items()},
            **({"verifier_accuracy": sum(v == 1.0 for v in comps["verifier"]) / len(comps["verifier"])}
               if "verifier" in comps else {}),
            **verdict_fractions(table),
        }
        if "prompts_drawn" in table.column_names:  # rollout --min-informative-groups: what its refill cost
            metrics.update(refill_metrics(table, rew))
        if mask_truncated:
            cut = sum(f == "length" for f in table.column("finish_reason").to_pylist())
            metrics["truncated_masked_fraction"] = cut / table.num_rows
        # multi-turn rows: turns and tool calls a trajectory (rlkit report), and the share of the completion tokens
        # the environment wrote (loss_mask 0; read off the column, so rows --mask-truncated leaves out still count
        # their sampled tokens as sampled)
        traj = trajectories.figures(table)
        metrics.update({k: traj[k] for k in ("mean_turns", "mean_tool_calls", "environment_token_fraction")
                        if traj and traj[k] is not None})
        train = {"temperature": temperature, "recompute": recompute, "lags": lags,
                 "length_norm": _length_norm(upstream.sampling, batch)}  # Dr. GRPO's
        return Loaded(batch, train, metrics, used)


def refill_metrics(table, rewards: Tensor) -> dict[str, Any]:
    """A batch of `rollout --min-informative-groups` (DAPO's dynamic sampling): the prompts sampled for its groups
    (each group's `prompts_drawn`, summed: those up to its last group, not the rest of the chunk that completed it),
    how many beyond the groups kept (`extra_prompts`), and the share of its groups whose rewards (the combined reward
    trained on) are not all equal."""
    from rlkit.ops.advantages import degenerate_groups

    drawn: dict[int, int] = {}
    for g, d in zip(table.column("group_id").to_pylist(), table.column("prompts_drawn").to_pylist(), strict=True):
        drawn.setdefault(g, int(d or 0))
    counts = degenerate_groups(rewards, torch.tensor(table.column("group_id").to_pylist()))
    sampled = sum(drawn.values())
    return {"prompts_sampled": sampled, "extra_prompts": sampled - len(drawn),
            "informative_group_fraction": (counts.groups - counts.degenerate) / max(1, counts.groups)}


def shaping(cfg) -> dict:
    """`Rollouts.load`'s length shaping (DAPO's overlong punishment and filtering) from update's options
    (`overlong_buffer`, `overlong_penalty`, `mask_truncated`)."""
    return {"overlong": (cfg.overlong_buffer, cfg.overlong_penalty) if cfg.overlong_buffer else None,
            "mask_truncated": cfg.mask_truncated}


def _overlong_limit(sampling, buffer: int, label: str) -> int:
    """The length the overlong punishment counts to: the rollout's --max-new-tokens, single-turn only."""
    if sampling.get("env"):
        raise RlkitError(f"{label} holds multi-turn trajectories; --overlong-buffer shapes single-turn completions "
                         "against the rollout's --max-new-tokens")
    most = sampling.get("max_new_tokens")
    if not most:
        raise RlkitError(f"{label} does not record the rollout's --max-new-tokens, which --overlong-buffer counts to")
    if buffer >= most:
        raise RlkitError(f"--overlong-buffer {buffer} must be below the rollout's --max-new-tokens {most}")
    return int(most)


def _length_norm(sampling, batch: RLBatch) -> float:
    """Dr. GRPO's constant normaliser: the most tokens a row's policy may sample. A single-turn rollout's
    --max-new-tokens; with --env, the turns times the tokens a turn, at most --max-total-tokens."""
    per_turn = sampling.get("max_new_tokens")
    if not per_turn:
        return float(batch.targets.shape[1])
    if not sampling.get("env"):
        return float(per_turn)
    most = per_turn * int(sampling.get("max_turns") or 1)
    total = sampling.get("max_total_tokens")
    return float(min(most, total) if total else most)


class Prefs:
    """A prefs table (`build-prefs`) scored by `score-ref --ref`: chosen/rejected pairs, train and held out."""

    kinds = ("prefs",)
    shown = ()

    def check(self, kind: str, cfg: RLConfig) -> None:
        """Nothing to refuse before reading: `build_pref_batch` names missing reference scores."""

    def check_upstream(self, upstream: Manifest, tokenizer, policy) -> None:
        """Prefs are text: the policy's tokenizer encodes them."""

    def load(self, table, *, tokenizer, limits: Limits | None = None, label: str = "the input",
             budget: int | None = None, **_: Any) -> Loaded:
        """`budget`: --micro-batch-tokens, which every pair must fit (its two sides run in one forward pass)."""
        batch = build_pref_batch(table, tokenizer, limits, label)
        if budget is not None:
            P = len(batch.heldout)
            n = batch.attn.sum(1)
            pair = n[:P] + n[P:]
            if int(pair.max()) > budget:
                i = int((pair > budget).nonzero()[0])
                raise RlkitError(f"{label}: {_row_name(table, i)}: prompt + chosen and prompt + rejected are {int(n[i])} + "
                                 f"{int(n[P + i])} tokens, which run in one forward pass, more than --micro-batch-tokens "
                                 f"{budget}; raise --micro-batch-tokens to at least {int(pair[i])} if memory allows")
        return Loaded(batch, {}, {}, None)
