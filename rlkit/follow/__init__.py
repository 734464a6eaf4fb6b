"""Persistent runs (`--follow`): one live process per stage, weights published and reloaded in place.

- `rollout`: `rollout --follow DIR`'s service (batch after batch, each sampled by DIR's newest step; a worker's
  --shard of every batch; to a stream or, with --spool, batch files in a spool directory).
- `update`: `update --follow`'s loop (one step per batch, published as DIR/step-NNNNNN/: the weights the workers
  load), in one process or under torchrun.
- `source`: where update's batches come from (a stream, or a spool many workers write) and how every rank gets them.
- `batches`: a stream cut into steps' tables.
- `snapshots`: update's resume snapshots (weights and AdamW state, sharded by every rank), apart from the steps the
  workers load.

The file protocols are in `rlkit.io`: `rlkit.io.follow` (step directories) and `rlkit.io.spool` (batch files).
See docs/follow.md and docs/scale-out.md.
"""
