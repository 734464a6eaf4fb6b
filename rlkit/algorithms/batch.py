"""Tensors from tables: a rollouts or scored table -> `RLBatch` (`build_batch`), a prefs table scored by the
reference -> `PrefBatch` (`build_pref_batch`). A rollouts table is read once into `RolloutRows`, its columns as
checked lists and the reward components they give, which the batch and the input's metrics
(`rlkit.algorithms.inputs.Rollouts.load`) share. A multi-turn row's `loss_mask` is ANDed into the batch's
`mask` here, and only here.
"""

from __future__ import annotations

from types import EllipsisType
from typing import NamedTuple

import torch
from torch import Tensor

from rlkit.algorithms.shaping import Overlong, reward_columns
from rlkit.errors import RlkitError
from rlkit.io.rows import Limits, check_pair_lengths, loss_masks, row_name
from rlkit.io.schemas import token_rewards_part_of
from rlkit.ops.logprobs import pack_sequences
from rlkit.rewards import combine_rewards


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


def _padded(rows: list[list[float]], C: int) -> Tensor:
    out = torch.zeros((len(rows), C), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


class RolloutRows(NamedTuple):
    """A rollouts/scored table read once (`read_rollouts`): its token columns as lists, checked, and the reward
    components they give. What `build_batch` packs and what `Rollouts.load`'s metrics read, so no column is read,
    checked or summed twice."""

    prompts: list[list[int]]  # prompt_ids
    completions: list[list[int]]  # completion_ids
    old_logprobs: list[list[float]]  # one a completion token
    masks: list[list[int] | None] | None  # loss_mask (`rlkit.io.rows.loss_masks`); None: every token sampled
    teacher: list[list[float]] | None  # teacher_logprobs, one a completion token; None: no such column
    token_rewards: list[list[float]] | None  # token_rewards, one a completion token; None: no such column
    components: dict[str, list[float]]  # name -> one value a row (`rlkit.algorithms.shaping.reward_columns`)


def read_rollouts(table, label: str = "the input", length_penalty: float = 0.0, overlong: Overlong | None = None,
                  masks: list[list[int] | None] | None | EllipsisType = ...) -> RolloutRows:
    """A rollouts/scored Arrow table's columns, checked in one line naming the row: old log-probs one a completion
    token, the `loss_mask` (`masks`: already read by `rlkit.io.rows.loss_masks`; `...`: read here), the per-token
    columns; and the reward components (`length_penalty`, `overlong`: the shaping ones added)."""
    prompts = table.column("prompt_ids").to_pylist()
    comps = table.column("completion_ids").to_pylist()
    old = table.column("old_logprobs").to_pylist()
    for i, (c, o) in enumerate(zip(comps, old, strict=True)):
        if len(c) != len(o):
            raise RlkitError(f"row {i}: {len(c)} completion tokens but {len(o)} old log-probs; the rollouts table is corrupt")
    if masks is ...:
        masks = loss_masks(table, label)
    teacher, tok_rewards = (_per_token(table, name, comps, label) for name in ("teacher_logprobs", "token_rewards"))
    components = reward_columns(table, comps, length_penalty, masks, overlong, tok_rewards)
    return RolloutRows(prompts, comps, old, masks, teacher, tok_rewards, components)


def build_batch(table, pad_id: int, weights: dict[str, float] | None = None,
                length_penalty: float = 0.0, label: str = "the input", overlong: Overlong | None = None,
                mask_truncated: bool = False, rows: RolloutRows | None = None) -> tuple[RLBatch, dict[str, float]]:
    """Tensors from a rollouts/scored Arrow table. `length_penalty` > 0 adds the component
    `length_penalty` = -length_penalty * sampled completion tokens (weight 1) to the reward; `overlong` adds DAPO's
    soft overlong punishment as the component `overlong` (weight 1); `mask_truncated` leaves the rows cut at the
    length limit (finish_reason "length") out of the loss (their rewards still count in their groups' baselines).
    `rows`: the table already read (`read_rollouts`, with the same `length_penalty` and `overlong`).

    A `loss_mask` column (multi-turn rows, `loss_masks`) is ANDed into the batch's `mask` here, and only here:
    everything downstream trains on and counts the tokens the policy sampled."""
    if rows is None:
        rows = read_rollouts(table, label, length_penalty, overlong)
    masks = rows.masks
    ids, attn, targets, mask, start = pack_sequences(rows.prompts, rows.completions, pad_id)
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
    teacher, tok_rewards = rows.teacher, rows.token_rewards
    if length_penalty:
        weights = None if weights is None else {**weights, "length_penalty": 1.0}
    if overlong is not None:
        weights = None if weights is None else {**weights, "overlong": 1.0}
    totals, used = combine_rewards(rows.components, weights)
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
    return RLBatch(ids, attn, targets, mask, start, _padded(rows.old_logprobs, C), ref, rewards, groups, span,
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
            raise RlkitError(f"{label}: {row_name(table, i)} has {got} {name} entries but {len(c)} completion "
                             f"tokens; {name} holds one value a completion token")
        if not all(math.isfinite(x) for x in v):
            raise RlkitError(f"{label}: {row_name(table, i)} has a non-finite value in {name}")
        if name == "teacher_logprobs" and (j := next((j for j, x in enumerate(v) if x > 0), None)) is not None:
            raise RlkitError(f"{label}: {row_name(table, i)} has {v[j]:g} at completion token {j} in {name}, above "
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
        raise RlkitError(f"{label}: {row_name(table, why[0])} is a multi-turn trajectory ({why[1]}); --algo dpo "
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


