"""DAPO's dynamic sampling (`rollout --min-informative-groups`): which groups of a batch's chunks are written, which
prompts are sampled next (`Refill`), the option checked (`plan`, `check_rewards`) and the column it adds (`columns`). The rollout stage runs it
through `rlkit.sampling.rows.write`."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

from rlkit.errors import RlkitError
from rlkit.io import schemas
from rlkit.rewards import combine_rewards


class RefillPlan(NamedTuple):
    want: int  # informative groups a batch
    limit: int  # prompts a batch may sample at most
    first: int  # prompts of its first round

    def start(self) -> Refill:
        return Refill(self.want, self.limit, self.first)


def plan(cfg: Any, first: int | None) -> RefillPlan | None:
    """--min-informative-groups K of rollout's config `cfg`, checked: K groups out of at most (1 +
    --max-refill-rounds) x `first` prompts (--num-prompts, or --batch-prompts under --follow); None without it."""
    k = cfg.min_informative_groups
    if k is None:
        return None
    if cfg.n < 2:
        raise RlkitError(f"--min-informative-groups needs groups of --n >= 2 samples to compare (got --n {cfg.n})")
    if cfg.shard:
        raise RlkitError("--min-informative-groups samples until enough groups have unequal rewards, so how many "
                         "prompts a job takes is not known in advance: it cannot be cut into --shard jobs")
    if first is not None and k > first:
        what = "--batch-prompts" if cfg.follow is not None else "--num-prompts"
        raise RlkitError(f"--min-informative-groups {k} is more than {what} {first}: the batch is at most that many "
                         "groups")
    return RefillPlan(k, (first or k) * (1 + cfg.max_refill_rounds), first or k)


def columns(extra: list, refill: RefillPlan | None) -> list:
    """The table's columns `extra` (beyond the rollouts kind's) with `refill`: its `prompts_drawn`
    (`rlkit.io.schemas.REFILL_FIELDS`) added, once checked that the rollout gives rewards to compare."""
    if refill is None:
        return extra
    check_rewards(extra)
    return [*extra, *schemas.REFILL_FIELDS]


def check_rewards(columns: list) -> None:
    """Refilling compares each group's rewards, so the rollout must give some (a verifier, --env, --reward-fn)."""
    if not any(f.name.startswith("reward/") for f in columns):
        raise RlkitError("--min-informative-groups compares each group's rewards, but this rollout gives none "
                         "(prompts without gold answers and no --env or --reward-fn); reward models come later, at "
                         "score-ref, where refilling cannot resample")


@dataclass
class Refill:
    """DAPO's dynamic sampling over one batch (Yu et al. 2025, "DAPO"; verl's `filter_groups`): a group whose
    rewards (the components summed, as `update` takes them without --reward) are all equal gives every
    group-normalised advantage 0, so only groups with unequal rewards are written, `want` of them, while at most
    `limit` prompts are sampled: the first round's `first`, then only as many as groups are still missing
    (`chunks`). The uninformative groups are kept aside (up to `want`) to fill the batch up when the limit comes
    first, so it always holds `want` groups (`update --follow` takes whole batches). Every written row carries
    `prompts_drawn` (`rlkit.io.schemas.REFILL_FIELDS`): its group and the uninformative ones sampled since the group
    written before it, so that over a batch they sum to the prompts sampled up to its last group. The prompts that
    the chunk filling the batch sampled after its last group (a first-round chunk) are `tail`, in no group's."""

    want: int
    limit: int
    first: int  # prompts of the first round (--num-prompts, --batch-prompts)
    kept: int = 0  # informative groups written
    drawn: int = 0  # prompts sampled
    informative: int = 0  # groups sampled whose rewards are not all equal: the kept ones and any in the tail
    tail: int = 0  # prompts sampled after the batch was full (the rest of its chunk): dropped, in no prompts_drawn
    since: int = 0  # prompts sampled since the last group written
    spare: list = field(default_factory=list)  # uninformative groups: their columns

    @property
    def done(self) -> bool:
        return self.kept >= self.want or self.drawn >= self.limit

    def chunks(self, chunks, size: int):
        """The stream's prompts (`chunks`: `rlkit.sampling.Prompts` from prompt 0 on) re-cut into the chunks this
        batch samples, each made once the one before it is taken: the first round's `first` prompts in chunks of
        `size`, as a plain rollout of `first` prompts cuts them, then chunks of as many prompts as groups are still
        missing (at most `size`, up to `limit`), so that past the first round no informative group is sampled to be
        dropped. A chunk's seed follows its first prompt (`rlkit.sampling.rows.write`): the same seed gives the same chunks."""
        buf = None  # prompts drawn from `chunks`, not sampled yet
        at = 0  # the next prompt to sample
        while not self.done:
            k = min(size, self.first - at) if at < self.first else min(size, self.want - self.kept, self.limit - at)
            if k <= 0:
                return
            while buf is None or len(buf.ids) < k:
                more = next(chunks, None)
                if more is None:
                    break
                buf = more if buf is None else promptsjoined(buf, more)
            if buf is None or not buf.ids:
                return  # the stream ended (a prompts file, a user task)
            piece, buf = prompts_cut(buf, k)
            at = buf.c0
            yield piece

    def take(self, cols: dict) -> dict | None:
        """A chunk's columns -> those of its informative groups still wanted, each group's rows together (None: none)."""
        comps = {k.split("/", 1)[1]: v for k, v in cols.items() if k.startswith("reward/")}
        total = array("f", combine_rewards(comps, None)[0])  # in float32, as update trains on them
        order: dict[int, list[int]] = {}
        for i, g in enumerate(cols["group_id"]):
            order.setdefault(g, []).append(i)
        out: list[dict] = []
        for rows in order.values():
            if self.drawn >= self.limit:
                break
            self.drawn += 1
            informative = len({total[i] for i in rows}) > 1
            self.informative += informative
            if self.kept >= self.want:  # in the chunk that filled the batch, after its last group: dropped
                self.tail += 1
                continue
            self.since += 1
            if informative:
                group = {k: [v[i] for i in rows] for k, v in cols.items()}
                group["prompts_drawn"] = [self.since] * len(rows)
                self.since = 0
                self.kept += 1
                out.append(group)
            elif len(self.spare) < self.want:
                self.spare.append({k: [v[i] for i in rows] for k, v in cols.items()})
        return joined(out)

    def fill(self) -> dict | None:
        """At the limit with fewer than `want` informative groups: the batch filled up with uninformative ones (the
        first carries the prompts drawn since the last written group). None when nothing is missing."""
        missing = self.want - self.kept
        if missing <= 0 or not self.spare:
            return None
        groups = self.spare[:missing]
        for j, g in enumerate(groups):
            g["prompts_drawn"] = [self.since if j == 0 else 0] * len(g["group_id"])
        self.since = 0
        return joined(groups)


def promptsjoined(a, b):
    """Two `rlkit.sampling.Prompts` of consecutive prompts -> one."""
    return replace(a, **{f.name: None if getattr(a, f.name) is None else getattr(a, f.name) + getattr(b, f.name)
                         for f in fields(a) if f.name != "c0"})


def prompts_cut(p, k: int):
    """`rlkit.sampling.Prompts` -> (its first `k` prompts, the rest, from prompt c0 + k)."""
    def part(sl: slice) -> dict:
        return {f.name: None if getattr(p, f.name) is None else getattr(p, f.name)[sl] for f in fields(p)
                if f.name != "c0"}

    return replace(p, **part(slice(None, k))), replace(p, c0=p.c0 + k, **part(slice(k, None)))


def joined(groups: list[dict]) -> dict | None:
    if not groups:
        return None
    return {k: [x for g in groups for x in g[k]] for k in groups[0]}
