"""`update --follow`'s input side: cut an unbounded stream of rollout record batches into the tables
the trainer trains on, one per step. Arrow only (no torch at import, no model), so it is tested with a
fake reader; `rlkit.io.follow` is the step-directory protocol and `rlkit.algorithms.trainer` the training, neither of
which needs to know how a stream is cut.
"""

from __future__ import annotations


class Batcher:
    """Cuts a stream of rollout record batches into tables of P whole prompt groups (rows of a group
    are contiguous, as `rollout` writes them), dropping the rows whose lag behind the current step
    (step - policy_step) exceeds `max_lag`. With `n` (the group size) a batch is cut as soon as its
    P-th group is complete, so a paced upstream is never waited on for rows it will not send yet."""

    def __init__(self, reader, P: int, n: int | None, max_lag: int) -> None:
        self.reader, self.it, self.P, self.n, self.max_lag = reader, iter(reader), P, n, max_lag
        self.buf = None
        self.ended = False
        self.leftover = 0

    def _cut(self) -> int:
        import numpy as np

        g = self.buf.column("group_id").to_numpy()
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        if len(starts) > self.P:
            return int(starts[self.P])
        if len(starts) == self.P and (self.ended or (self.n and len(g) - starts[-1] >= self.n)):
            return len(g)
        return 0

    def next(self, step: int):
        """(table, lags (rows,) long tensor, rows dropped since the last batch), or None at the end."""
        import numpy as np
        import pyarrow as pa
        import torch

        from rlkit.errors import RlkitError

        dropped = 0
        while True:
            if self.buf is not None and self.buf.num_rows:
                lag = step - self.buf.column("policy_step").to_numpy()
                if (lag < 0).any():
                    raise RlkitError(f"{self.reader.label}: rows sampled by step {int(step - lag.min())}, newer than "
                                     f"this update's step {step}: the rollout follows another directory than --out")
                stale = lag > self.max_lag
                if stale.any():
                    self.buf = self.buf.filter(pa.array(~stale))
                    dropped += int(stale.sum())
                    continue
                cut = self._cut()
                if cut:
                    out, self.buf = self.buf.slice(0, cut), self.buf.slice(cut)
                    return out, torch.from_numpy(np.ascontiguousarray(lag[:cut])).long(), dropped
            if self.ended:
                self.leftover = self.buf.num_rows if self.buf is not None else 0
                return None
            batch = next(self.it, None)
            if batch is None:
                self.ended = True
                continue
            t = pa.Table.from_batches([batch])
            self.buf = t if self.buf is None else pa.concat_tables([self.buf, t])
