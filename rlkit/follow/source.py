"""Where `update --follow` gets each step's batch: a stream (stdin or --in FILE, cut by `rlkit.follow.batches`) or a
spool directory that many rollout workers write batch files into (`rlkit.io.spool`), and, under torchrun, how
every rank gets the batch rank 0 read (`Shared`).

A source gives `header()` (the input's kind, manifest, label and fingerprint, known before the first step) and
`next(step)`: the `Batch` that trains step + 1, or None when the input has ended. `covered(step)` is called once a
snapshot of `step` is written (`rlkit.follow.snapshots`): a spool's files of the steps up to it are then deleted or
kept, and until then they wait in claimed/, to be trained again by an update restarted from that snapshot;
`close(step)` when the run ends cleanly. Arrow and the filesystem only, torch for the lag vector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError


@dataclass
class Header:
    kind: str
    manifest: dict | None
    label: str
    fingerprint: str

    @property
    def record(self):
        from rlkit.io.manifests import Manifest

        return Manifest.parse(self.manifest)


@dataclass
class Batch:
    table: Any  # pa.Table: the rows one step trains on
    lags: Any  # (rows,) long tensor: step - the row's policy_step
    dropped: int  # rows dropped since the last batch (lag above --max-lag)
    files: list = field(default_factory=list)  # a spool's claimed `rlkit.io.spool.BatchFile`s (rank 0's)
    note: str = ""  # what the step should say about its input (a worker that went quiet)


class StreamSource:
    """One stream of rollout record batches (`pending`: the `streams.open_table` future of its reader), cut into P
    whole groups a step."""

    def __init__(self, pending) -> None:
        self.pending = pending
        self.reader = None
        self.batcher = None

    def header(self) -> Header:
        r = self.reader = self.pending.result()
        return Header(r.kind, r.manifest, r.label, r.fingerprint)

    def start(self, step: int, P: int, n: int | None, max_lag: int) -> None:
        from rlkit.follow.batches import Batcher

        self.batcher = Batcher(self.reader, P, n, max_lag)

    def next(self, step: int) -> Batch | None:
        got = self.batcher.next(step)
        return None if got is None else Batch(*got)

    def ended(self) -> str:
        left = self.batcher.leftover if self.batcher is not None else 0
        return f" ({left} rows of an unfinished batch left untrained)" if left else ""

    def covered(self, step: int) -> None:
        pass

    def close(self, step: int) -> None:
        pass


# the settings every worker of one run shares (its --shard and where it writes may differ)
SAME_ROLLOUT = ("task", "batch_prompts", "n", "seed", "chunk_prompts", "temperature", "top_p", "max_new_tokens",
                "min_informative_groups", "env", "prompts")


class SpoolSource:
    """Batch files of M workers in a spool directory. Step `base + b + 1` trains batch b: the files of batch b of
    every worker, in worker order (together the batch one worker sampling every prompt writes), each claimed by a
    rename into claimed/ before it is read. A worker whose file is awaited and whose heartbeat (`spool.heartbeat`)
    has not moved for `timeout` seconds is gone: it is named, and the step trains on the other workers' files; a
    batch no worker wrote is an error. A worker that is alive is waited for, however long its batch takes. Files of
    batches already past (a late worker's) are dropped and counted. A step trained again after a restart (`replay`:
    step -> the names of the files it trained on, from its manifest) takes exactly those files, from claimed/."""

    def __init__(self, root: Path, base_step: int, timeout: float, keep: bool, poll: float | None = None) -> None:
        from rlkit.io import spool

        self.root, self.base, self.timeout, self.keep = root, base_step, timeout, keep
        self.poll = poll or spool.POLL_SECONDS
        self.workers: int | None = None
        self.max_lag = 0
        self.same: dict | None = None
        self.replay: dict[int, list[str]] = {}

    def recover(self, step: int, replay: dict[int, list[str]] | None = None) -> tuple[int, int, int]:
        """With the spool's lock held, after a killed update resumed from (a snapshot of) `step`: its claimed files of
        batches that snapshot covers are disposed of, those the steps published since trained on (`replay`: step ->
        file names) stay claimed to be trained again, the others are put back. -> (disposed, kept, put back)."""
        from rlkit.io import spool

        self.replay = dict(replay or {})
        again = {n for names in self.replay.values() for n in names}
        gone = back = kept = 0
        for f in spool.claimed(self.root):
            if f.batch < step - self.base:
                spool.dispose(self.root, f, self.keep)
                gone += 1
            elif f.path.name not in again:
                spool.unclaim(self.root, f)
                back += 1
            else:
                kept += 1
        (self.root / spool.UPDATE_END).unlink(missing_ok=True)
        return gone, kept, back

    def header(self) -> Header:
        """The manifest of the first batch file to appear (waited for, up to the worker timeout)."""
        from rlkit.io import spool, streams

        seen = time.monotonic()
        beats = spool.heartbeats(self.root)
        while True:
            files = [f for f in spool.claimed(self.root) if f.path.name in self._again()] or spool.scan(self.root)
            now = spool.heartbeats(self.root)
            if now != beats:  # a worker started or beat: alive, its first batch on the way
                beats, seen = now, time.monotonic()
            if files:
                f = files[0]
                try:
                    r = streams.open_table(str(f.path), ["rollouts", "scored"]).result()
                except FileNotFoundError:
                    continue
                except RlkitError as e:
                    if not f.path.exists():  # claimed meanwhile: never, under the lock; or pruned by a late drop
                        continue
                    raise RlkitError(f"spool {self.root}: {e}") from None
                self.kind = r.kind
                self.same = {k: (r.record.sampling or {}).get(k) for k in SAME_ROLLOUT}
                return Header(r.kind, r.manifest, f"spool {self.root}", f"spool:{self.root.resolve()}")
            if time.monotonic() - seen > self.timeout:
                raise RlkitError(f"no worker wrote a batch into the spool {self.root} or gave a sign of life in "
                                 f"{self.timeout:g} s (--worker-timeout): are the workers running `rollout --follow "
                                 "... --spool` (or `| score-ref --spool`) on this directory?")
            time.sleep(self.poll)

    def start(self, step: int, P: int, n: int | None, max_lag: int) -> None:
        self.max_lag = max_lag

    def _read(self, f, step: int):
        """The claimed file's table, checked: its kind and its run's settings those of the first file."""
        from rlkit.io import streams

        r = streams.open_table(str(f.path), ["rollouts", "scored"]).result()
        if r.kind != self.kind:
            raise RlkitError(f"spool {self.root}: {f.path.name} is a {r.kind} table, the spool's first batch a {self.kind} "
                             "one: every worker of one run ends its pipe the same way (all with score-ref, or none)")
        got = {k: (r.record.sampling or {}).get(k) for k in SAME_ROLLOUT}
        diff = [k for k in SAME_ROLLOUT if got[k] != self.same[k]]
        if diff:
            k = diff[0]
            raise RlkitError(f"spool {self.root}: {f.path.name} was sampled with {k} {got[k]!r}, the spool's first "
                             f"batch with {self.same[k]!r}: every worker of one run takes the same settings")
        t = r.read_all(require_rows=False)
        if f.step > step:
            raise RlkitError(f"spool {self.root}: {f.path.name} was sampled by step {f.step}, newer than this update's "
                             f"step {step}: its worker follows another directory than --out")
        return t.replace_schema_metadata(None)

    def _again(self) -> set[str]:
        return {n for names in self.replay.values() for n in names}

    def _replay(self, step: int) -> Batch:
        """The batch step + 1 trained on before a restart: the claimed files its manifest names."""
        import numpy as np
        import pyarrow as pa
        import torch

        from rlkit.io import spool

        tables, lags, taken = [], [], []
        for name in self.replay.pop(step + 1):
            f = spool.parse(self.root / spool.CLAIMED / name)
            if f is None or not f.path.is_file():
                raise RlkitError(f"spool {self.root}: {spool.CLAIMED}/{name}, a batch file step {step + 1} was trained "
                                 "on, is gone; the step cannot be trained again (restore the file, or start a new --out)")
            t = self._read(f, step)
            taken.append(f)
            tables.append(t)
            lags.append(np.full(t.num_rows, step - f.step, dtype=np.int64))
        return Batch(pa.concat_tables(tables), torch.from_numpy(np.concatenate(lags)), 0, taken)

    def next(self, step: int) -> Batch | None:
        import numpy as np
        import pyarrow as pa
        import torch

        from rlkit.io import spool

        if step + 1 in self.replay:
            return self._replay(step)
        b = step - self.base
        t0 = time.monotonic()
        dropped = 0
        beats: dict[int, tuple] = {}  # worker -> (its heartbeat, when this update last saw it move)
        while True:
            files = spool.scan(self.root)
            counts = {f.workers for f in files} | ({self.workers} if self.workers else set())
            if len(counts) > 1:
                raise RlkitError(f"spool {self.root} holds batches of {min(counts)} and of {max(counts)} workers; every "
                                 "worker of one run takes --shard I/M with the same M")
            if counts:
                self.workers = counts.pop()
            for f in files:
                if f.batch < b:  # a late file of a batch trained without it
                    c = spool.claim(f)
                    if c is not None:
                        dropped += self._read(c, step).num_rows
                        spool.dispose(self.root, c, self.keep)
            now = [f for f in files if f.batch == b]
            have = {f.worker for f in now}
            M = self.workers
            ended = {i for i, m in spool.ended_workers(self.root) if m == M}
            waiting = [i for i in range(M or 0) if i not in have and i not in ended]
            note = ""
            clock = time.monotonic()
            for i in waiting:
                hb = spool.heartbeat(self.root, i, M)
                if i not in beats or beats[i][0] != hb:
                    beats[i] = (hb, clock if i in beats else t0)
            gone = all(clock - beats[i][1] > self.timeout for i in waiting)
            if M and not waiting:
                if not now:
                    return None  # every worker ended its stream
            elif gone and clock - t0 > self.timeout:
                quiet = ", ".join(f"{i}/{M}" for i in waiting) if M else "all"
                if not now:
                    raise RlkitError(f"no worker wrote batch {b} into the spool {self.root}, and worker(s) {quiet} gave "
                                     f"no sign of life for {self.timeout:g} s (--worker-timeout)")
                note = (f"worker(s) {quiet} wrote no batch {b} and gave no sign of life for {self.timeout:g} s "
                        f"(--worker-timeout): step {step + 1} trains on the other workers' {len(now)} file(s)")
            else:
                time.sleep(self.poll)
                continue
            tables, lags, taken = [], [], []
            for f in sorted(now):
                c = spool.claim(f)
                if c is None:
                    raise RlkitError(f"spool {self.root}: {f.path.name} was taken by another process; one update "
                                     "consumes a spool")
                t = self._read(c, step)
                lag = step - c.step
                if lag > self.max_lag:
                    dropped += t.num_rows
                    spool.dispose(self.root, c, self.keep)
                    continue
                taken.append(c)
                tables.append(t)
                lags.append(np.full(t.num_rows, lag, dtype=np.int64))
            if not tables:
                raise RlkitError(f"spool {self.root}: every row of batch {b} is more than --max-lag {self.max_lag} "
                                 "steps older than this step (the workers' --max-lag must not exceed update's)")
            table = pa.concat_tables(tables)
            return Batch(table, torch.from_numpy(np.concatenate(lags)), dropped, taken, note)

    def ended(self) -> str:
        return " (every worker ended its stream)"

    def covered(self, step: int) -> None:
        """A snapshot of `step` is written: the claimed files of the batches it covers are deleted (or kept)."""
        from rlkit.io import spool

        for f in spool.claimed(self.root):
            if f.batch < step - self.base:
                spool.dispose(self.root, f, self.keep)

    def close(self, step: int) -> None:
        from rlkit.io import spool

        spool.mark_update_end(self.root, step)


class Shared:
    """A source under torchrun: rank 0 reads it (`inner`; None on the other ranks) and broadcasts each header and
    batch as JSON and Arrow IPC bytes, a read error too (every rank then fails with rank 0's line). The other
    ranks wait for rank 0 in the launcher's store, up to --dist-timeout minutes (`timeout_s`)."""

    def __init__(self, inner, dp, timeout_s: float | None) -> None:
        self.inner, self.dp, self.timeout_s = inner, dp, timeout_s

    def _share(self, what: str, make):
        from rlkit.training.distributed import share

        return share(self.dp, what, make, self.timeout_s)

    def header(self) -> Header:
        def make():
            h = self.inner.header()
            return {"kind": h.kind, "manifest": h.manifest, "label": h.label, "fingerprint": h.fingerprint}, None

        head, _ = self._share("follow-header", make)
        return Header(head["kind"], head["manifest"], head["label"], head["fingerprint"])

    def start(self, step: int, P: int, n: int | None, max_lag: int) -> None:
        if self.inner is not None:
            self.inner.start(step, P, n, max_lag)

    def next(self, step: int) -> Batch | None:
        import torch

        got: list = []

        def make():
            b = self.inner.next(step)
            got.append(b)
            if b is None:
                return {"end": True, "ended": self.inner.ended()}, None
            return {"lags": b.lags.tolist(), "dropped": b.dropped, "note": b.note}, b.table

        head, table = self._share("follow-batch", make)
        self._ended = head.get("ended", "")
        if head.get("end"):
            return None
        if self.dp.main:
            return got[0]
        return Batch(table, torch.tensor(head["lags"], dtype=torch.long), head["dropped"], [], head["note"])

    def ended(self) -> str:
        return getattr(self, "_ended", "")

    def covered(self, step: int) -> None:
        if self.inner is not None:
            self.inner.covered(step)

    def close(self, step: int) -> None:
        if self.inner is not None:
            self.inner.close(step)

