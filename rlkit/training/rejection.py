"""Rejection-sampling SFT's input (`rlkit sft --data ROLLOUTS --min-reward R [--best-of]`): the completions of a
rollouts or scored table that pass a reward filter, as the token ids the policy sampled.

With r_i = sum_k w_k reward/k of row i (every `reward/<k>` column, w_k = 1 unless --reward NAME=W weighs them:
`rlkit.rewards.combine_rewards`) and G(i) the rows of row i's prompt group (`group_id`):

    --min-reward R            keep i  iff  r_i >= R
    --best-of                 keep i  iff  i = argmax_{j in G(i)} (r_j, -sample_idx_j)
    --min-reward R --best-of  keep i  iff  r_i >= R  and  i = argmax_{j in G(i), r_j >= R} (r_j, -sample_idx_j)

so --best-of keeps at most one completion a prompt (ties: the lowest sample_idx). With R it is DeepSeek-R1's
stage 3 (2025: sample, keep the correct, fine-tune on them); --best-of alone keeps every group's best whatever its
reward, RAFT's best-of-n (Dong et al. 2023).

A kept row is trained on as it was sampled: `prompt_ids` + `completion_ids`, never re-tokenised from its text (a
round trip through text need not give back the ids the policy sampled); a multi-turn row's `loss_mask` goes with
it (`CrossEntropy`'s masks: the environment's tokens are context, not targets). The table's tokenizer (its
manifest's fingerprint) must be the base model's.

A kept row longer than --max-length (or the model's context) is refused, not truncated as text sft truncates: the
filter judged the whole completion, and a cut one is a response nobody scored (for a correct answer, often the
part that makes it correct), without its eos; a multi-turn row would lose the turns after the cut. The message
names the row and the --max-length that holds every kept row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rlkit.errors import RlkitError


def select(rewards: Sequence[float], groups: Sequence[int], sample_idx: Sequence[int], min_reward: float | None,
           best_of: bool) -> list[int]:
    """The rows kept, in table order: those with reward >= `min_reward` (all when None), and with `best_of` only
    the best of each group among them (highest reward, then lowest sample_idx). (N,) each -> indices.

    >>> select([1.0, 0.0, 1.0, 0.5], [0, 0, 0, 1], [2, 0, 1, 0], 1.0, True)
    [2]
    """
    kept = [i for i, r in enumerate(rewards) if min_reward is None or r >= min_reward]
    if not best_of:
        return kept
    best: dict[int, int] = {}
    for i in kept:
        j = best.get(groups[i])
        if j is None or (rewards[i], -sample_idx[i]) > (rewards[j], -sample_idx[j]):
            best[groups[i]] = i
    return sorted(best.values())


class Kept(NamedTuple):
    """What the filter kept of a table (`reject`)."""

    rows: list[int]  # table row indices, in table order
    weights: dict[str, float]  # the reward components' weights used
    metrics: dict[str, Any]  # min_reward, best_of, rows/groups read and kept, mean rewards


def reject(table, *, min_reward: float | None, best_of: bool, weights: Mapping[str, float] | None,
           label: str) -> Kept:
    """Filter a rollouts/scored table (`select` on its total rewards). Refused in one line: missing token ids, no
    reward column, no row reaching `min_reward`, a bad loss_mask (`check_loss_mask`)."""
    from rlkit.io.rows import check_loss_mask
    from rlkit.rewards import combine_rewards

    for col in ("prompt_ids", "completion_ids"):
        if table.column(col).null_count:
            raise RlkitError(f"{label}: column '{col}' has missing values; rejection-sampling SFT trains on the "
                             "sampled token ids")
    cols = {n.split("/", 1)[1]: table.column(n).to_pylist() for n in table.column_names if n.startswith("reward/")}
    if not cols:
        raise RlkitError(f"{label} has no reward/<component> columns, so --min-reward/--best-of have nothing to "
                         "filter on; sample with a task that has a verifier, or add rewards (rollout --reward-fn, "
                         "score-ref --rm)")
    rewards, used = combine_rewards(cols, dict(weights) if weights else None)
    check_loss_mask(table, label)
    groups = table.column("group_id").to_pylist()
    comps = table.column("completion_ids").to_pylist()
    empty = {i for i, c in enumerate(comps) if not c}  # nothing to learn from
    rows = [i for i in select(rewards, groups, table.column("sample_idx").to_pylist(), min_reward, best_of)
            if i not in empty]
    if not rows:
        best = max(rewards[i] for i in range(len(rewards)) if i not in empty) if len(empty) < len(rewards) else None
        if best is None:
            raise RlkitError(f"{label}: every completion is empty (0 tokens): nothing to train on")
        raise RlkitError(f"no completion reaches --min-reward {min_reward:g} (best reward {best:g}) in {label}")
    metrics = {"min_reward": min_reward, "best_of": best_of, "rows_read": len(rewards), "rows_kept": len(rows),
               "groups_read": len(set(groups)), "groups_kept": len({groups[i] for i in rows}),
               "reward_mean_read": sum(rewards) / len(rewards),
               "reward_mean_kept": sum(rewards[i] for i in rows) / len(rows)}
    return Kept(rows, used, metrics)


def training_rows(table, kept: Kept, max_len: int, limits, label: str
                  ) -> tuple[list[list[int]], list[int], list[list[int] | None] | None]:
    """(token ids, prompt lengths, completion masks) of the kept rows, for `CrossEntropy.plan`: prompt_ids +
    completion_ids as they are, and each row's loss_mask (None: the table has none, every token was sampled).
    Refused in one line naming the row: a token id outside the model's vocabulary (`limits`,
    `rlkit.io.rows.Limits`), a row longer than `max_len` (--max-length) or the model's context."""
    from rlkit.io.rows import Limits, check_rows, loss_masks, row_name

    check_rows(table, Limits(limits.vocab, None, limits.what), label)  # every row's ids: the length check is below
    sub = table.take(kept.rows)
    prompts = sub.column("prompt_ids").to_pylist()
    comps = sub.column("completion_ids").to_pylist()
    masks = loss_masks(sub, label)
    most = min(max_len, limits.context or max_len)
    lengths = [len(p) + len(c) for p, c in zip(prompts, comps, strict=True)]
    if max(lengths) > most:
        k = next(k for k, n in enumerate(lengths) if n > most)
        p = len(prompts[k])
        where = (f"more than --max-length {max_len}" if most == max_len else
                 f"more than {limits.what}'s context of {limits.context} tokens (max_position_embeddings)")
        fix = (f"raise --max-length to {max(lengths)} (the longest kept row), or sample shorter completions "
               "(rollout --max-new-tokens)" if most == max_len else
               "sample shorter completions (rollout --max-new-tokens)")
        raise RlkitError(f"{label}: {row_name(table, kept.rows[k])} is {lengths[k]} tokens long (prompt {p} + "
                         f"completion {lengths[k] - p}), {where}; sft trains on a kept completion whole, never cut: "
                         f"{fix}")
    ids = [[*p, *c] for p, c in zip(prompts, comps, strict=True)]
    return ids, [len(p) for p in prompts], masks


def check_tokenizer(upstream, tokenizer, model: str, label: str) -> None:
    """The table's token ids mean text only under the tokenizer that sampled them: its manifest's fingerprint must
    be the base model's (`upstream`: the table's `Manifest`; a table that records none is checked by vocabulary
    alone)."""
    from rlkit.io import checkpoints

    want, got = upstream.tokenizer, checkpoints.tokenizer_fingerprint(tokenizer)
    if want and want != got:
        raise RlkitError(f"--model {model} has a different tokenizer from the one that sampled {label} ({got} vs "
                         f"{want}); train on rollouts from the same model family, or re-sample them with this model")
