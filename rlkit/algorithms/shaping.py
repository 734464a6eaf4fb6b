"""Length shaping of a rollout batch's reward and its loss normaliser, from update's options and the rollout's
manifest: the `length_penalty` component (the sampled tokens' cost), DAPO's soft overlong punishment
(`Overlong`, against the rollout's --max-new-tokens), --mask-truncated (`shaping`), and Dr. GRPO's constant
normaliser (`length_norm`). Also the reward components a rollouts table gives (`reward_columns`).
"""

from __future__ import annotations

from typing import NamedTuple

from rlkit.errors import RlkitError
from rlkit.io.schemas import token_rewards_part_of


def sampled_tokens(comps: list[list[int]], masks: list[list[int] | None] | None = None) -> list[int]:
    """Each row's completion tokens sampled by the policy: the completion's length (`comps`: the rows'
    completion_ids), less the environment's tokens of a multi-turn row (`masks`: `rlkit.io.rows.loss_masks`)."""
    if masks is None:
        return [len(c) for c in comps]
    return [len(c) if m is None else sum(m) for c, m in zip(comps, masks, strict=True)]


class Overlong(NamedTuple):
    """DAPO's soft overlong punishment (`rlkit.ops.shaping.overlong_penalty`): `buffer` tokens below the rollout's
    --max-new-tokens `max_len`, falling to -`penalty`."""

    max_len: int
    buffer: int
    penalty: float


def reward_columns(table, comps: list[list[int]], length_penalty: float,
                   masks: list[list[int] | None] | None = None, overlong: Overlong | None = None,
                   token_rewards: list[list[float]] | None = None) -> dict[str, list[float]]:
    """The reward components of a rollouts/scored table, one value a row: its `reward/<name>` columns, the row sums
    of `token_rewards` (unless they are a share of another component), and the shaping ones (`length_penalty`,
    `overlong`). `comps`: the rows' completion_ids; `masks`: their loss_masks."""
    cols = {n.split("/", 1)[1]: table.column(n).to_pylist() for n in table.column_names if n.startswith("reward/")}
    if token_rewards is not None and token_rewards_part_of(table.schema) is None:
        cols["token_rewards"] = [float(sum(v)) for v in token_rewards]  # their row sums are one more component
    if length_penalty:  # the tokens the policy sampled: an environment's tool output costs it nothing
        cols["length_penalty"] = [-length_penalty * n for n in sampled_tokens(comps, masks)]
    if overlong is not None:
        from rlkit.ops.shaping import overlong_penalty

        cols["overlong"] = overlong_penalty(sampled_tokens(comps), *overlong)
    return cols


def shaping(cfg) -> dict:
    """`Rollouts.load`'s length shaping (DAPO's overlong punishment and filtering) from update's options
    (`overlong_buffer`, `overlong_penalty`, `mask_truncated`)."""
    return {"overlong": (cfg.overlong_buffer, cfg.overlong_penalty) if cfg.overlong_buffer else None,
            "mask_truncated": cfg.mask_truncated}


def overlong_limit(sampling, buffer: int, label: str) -> int:
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


def length_norm(sampling, batch) -> float:
    """Dr. GRPO's constant normaliser: the most tokens a row's policy may sample. A single-turn rollout's
    --max-new-tokens; with --env, the turns times the tokens a turn, at most --max-total-tokens. `batch`: the
    `RLBatch` (its width, when the manifest records no --max-new-tokens)."""
    per_turn = sampling.get("max_new_tokens")
    if not per_turn:
        return float(batch.targets.shape[1])
    if not sampling.get("env"):
        return float(per_turn)
    most = per_turn * int(sampling.get("max_turns") or 1)
    total = sampling.get("max_total_tokens")
    return float(min(most, total) if total else most)


