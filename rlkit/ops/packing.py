"""How r sequences are laid out for one forward pass: padded (one per row) or packed (several per row,
no padding between them), and the index tensors that read each sequence's per-token outputs back.

Packed rows carry per-sequence `position_ids` (0, 1, ... restarting at each sequence) and no attention
mask: transformers then builds the block-diagonal causal mask itself (`masking_utils.
find_packed_sequence_indices`: a position id that is not the previous one + 1 starts a sequence), for
sdpa and eager attention alike, and FlashAttention runs its varlen kernel on them (one row). Attention
therefore never crosses a sequence boundary, and RoPE sees each sequence's own positions: the packed
forward computes what the padded one does, without the padding.

Layouts:
- padded: R = r rows of W = the longest sequence, right-padded, with an attention mask (rlkit's layout
  before packing, and `--no-packing`'s);
- packed, `capacity` set (sdpa/eager attention): sequences best-fit-decreasing into rows of W = max(capacity,
  the longest sequence) tokens; a row's attention costs W^2 whatever its mask, so rows as long as the
  longest sequence make attention no dearer than padding while every other layer (the MLPs, the
  output head) sees only real tokens;
- packed, `capacity=None` (FlashAttention's varlen kernel, which skips the masked blocks): one row of
  every sequence.

Everything per token downstream (loss masks, advantages, per-sequence aggregation, GSPO's sequence
ratio, PPO's values) keeps the (r, C) shape: `scatter` puts the K scored positions back at (sequence,
completion index), so the loss code never sees the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class Seqs(NamedTuple):
    """r sequences laid out for one forward pass; K = their completion tokens in all.

    `pos[k]` is the flat position (row * W + column) whose output predicts scored token `targets[k]`,
    completion token `col[k]` of sequence `seq[k]`; `last[i]` is the flat position of sequence i's last
    token (a reward model or critic reads its score there)."""

    input_ids: Tensor  # (R, W) long
    position_ids: Tensor | None  # (R, W) long, restarting at 0 per sequence (packed); None when padded
    attn: Tensor | None  # (R, W) long attention mask (padded); None when packed
    pos: Tensor  # (K,) long
    targets: Tensor  # (K,) long
    seq: Tensor  # (K,) long, 0..r-1
    col: Tensor  # (K,) long, 0..C-1
    last: Tensor  # (r,) long
    completion: int  # C, the longest completion: per-token outputs come back as (r, C)
    tokens: int  # real tokens, sum of the sequence lengths
    positions: int  # R * W: positions the forward runs (tokens + padding)

    @property
    def rows(self) -> int:
        return len(self.last)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.positions if self.positions else 0.0

    def to(self, device) -> Seqs:
        return Seqs(*(x.to(device, non_blocking=True) if isinstance(x, Tensor) else x for x in self))


def best_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices grouped into rows of at most `capacity` tokens (a longer sequence gets a row of its
    own), best-fit-decreasing: longest first, each into the row it fills the most. Deterministic.

    >>> best_fit_rows([5, 3, 2, 4], 6)
    [[0], [3, 2], [1]]"""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        best = min((k for k in range(len(rows)) if free[k] >= n), key=lambda k: (free[k], k), default=None)
        if best is None:
            rows.append([i])
            free.append(capacity - n)
        else:
            rows[best].append(i)
            free[best] -= n
    return rows


def layout(tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int], *, packed: bool = True,
           capacity: int | None = 0, pad_id: int = 0) -> Seqs:
    """Lay out sequences `tokens` (prompt then completion; prompt i is its first prompt_lens[i] >= 1 tokens)
    for one forward pass, on the CPU (`Seqs.to(device)` moves it).

    packed=False: padded rows. packed=True: `capacity` tokens per row at least (0: the longest sequence,
    sdpa/eager attention's best), or None for a single row (FlashAttention varlen)."""
    r = len(tokens)
    lens = [len(t) for t in tokens]
    if r == 0 or min(lens) == 0:
        raise ValueError("layout needs at least one sequence, each of at least one token")
    C = max(n - p for n, p in zip(lens, prompt_lens, strict=True))
    if not packed:
        rows = [[i] for i in range(r)]
        W = max(lens)
    elif capacity is None:
        rows, W = [list(range(r))], sum(lens)
    else:
        W = max(capacity, max(lens))
        rows = best_fit_rows(lens, W)
    ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    posids = torch.zeros((len(rows), W), dtype=torch.long)
    attn = torch.zeros((len(rows), W), dtype=torch.long) if not packed else None
    pos, targets, seq, col = [], [], [], []
    last = [0] * r
    for ri, members in enumerate(rows):
        off = 0
        for i in members:
            n, p, toks = lens[i], prompt_lens[i], tokens[i]
            ids[ri, off : off + n] = torch.as_tensor(toks, dtype=torch.long)
            posids[ri, off : off + n] = torch.arange(n)
            base = ri * W + off
            c = n - p
            pos.extend(range(base + p - 1, base + p - 1 + c))
            targets.extend(toks[p:] if not isinstance(toks, Tensor) else toks[p:].tolist())
            seq.extend([i] * c)
            col.extend(range(c))
            last[i] = base + n - 1
            off += n
        if packed and off < W:  # the row's tail: its own positions 0.., a segment nothing reads
            posids[ri, off:] = torch.arange(W - off)
        if attn is not None:
            attn[ri, :off] = 1
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return Seqs(ids, posids if packed else None, attn, as_long(pos), as_long(targets), as_long(seq), as_long(col),
                as_long(last), C, sum(lens), len(rows) * W)


def scatter(values: Tensor, seqs: Seqs, fill: float = 0.0) -> Tensor:
    """(K,) per scored token -> (r, C), `fill` where a sequence has no token. Differentiable."""
    out = values.new_full((seqs.rows, seqs.completion), fill)
    return out.index_put((seqs.seq, seqs.col), values)


def from_padded(input_ids: Tensor, attn: Tensor, start: Tensor, rows: Tensor | None = None) -> tuple[list[list[int]], list[int]]:
    """Right-padded (N, L) rows (rlkit's RLBatch/PrefBatch layout, on the CPU) -> (token lists, prompt lengths)
    of `rows` (default all): what `layout` takes."""
    if rows is None:
        rows = torch.arange(len(input_ids))
    lens = attn[rows].sum(1).tolist()
    ids = input_ids[rows].tolist()
    return [x[:n] for x, n in zip(ids, lens, strict=True)], (start[rows] + 1).tolist()
