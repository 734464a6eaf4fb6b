"""The rewards `rlkit rollout` writes and its tally of them (`Verifier`): the task's verifier, the environment's
reward, each --reward-fn's, each on its reading of a multi-turn row, and the progress and closing lines."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from rlkit.rewards import combine_rewards


@dataclass
class Verifier:
    """The rewards rollout writes and how: the task's verifier (a chunk's rows at once, `rlkit.tasks.verify`; the
    code task's programs in `sandbox`, concurrently; a completion cut at --max-new-tokens gets the verdict
    `truncated`), under --env the environment's `reward/env`, each component's reading of a multi-turn row
    (`rlkit.tasks.multi_turn`), and the run's tally for the progress and summary lines: the verdict reasons, the
    completions cut, and the sum of each reward component and of their total."""

    task: object  # where the prompts come from
    sandbox: object = None
    max_new_tokens: int = 0
    env: object = None  # --env's EnvSpec: trajectories (reward/env)
    scorer: object = None  # the task whose verifier scores the rows (reward/verifier); None: no verifier
    reads: dict = field(default_factory=dict)  # component -> its reading of a multi-turn row
    counts: dict = field(default_factory=dict)
    rows: int = 0
    cut: int = 0
    sums: dict = field(default_factory=dict)  # reward/<name> -> sum over rows; "reward" -> the total's
    refills: list = field(default_factory=list)  # --min-informative-groups: each batch's `rlkit.sampling.refill.Refill`
    max_turns: int = 0  # --env: --max-turns (the closing line's warning)
    trajectories: object = None  # --env: the run's `rlkit.sampling.tally.TrajectoryTally`
    checked: object = None  # the verifier check's `rlkit.tasks.trust.Outcome` (the manifest's verifier_check)

    def __post_init__(self) -> None:
        if self.env is not None:
            from rlkit.sampling.tally import TrajectoryTally

            self.trajectories = TrajectoryTally()

    @property
    def verdicts(self) -> bool:
        """Whether the task gives a reason with each reward (a `verdict/verifier` column)."""
        return self.scores and getattr(self.scorer, "score_batch", None) is not None

    @property
    def scores(self) -> bool:
        """Whether a task's verifier scores the rows: always without --env; with it only when --task names the task
        (the environment's rewards score its trajectories)."""
        return self.scorer is not None

    def readings(self, specs: tuple[str, ...], fns) -> dict[str, str]:
        """Each component's reading of a multi-turn row: the defaults, and --reads (checked: one line)."""
        from rlkit.tasks import multi_turn

        defaults = {**({"verifier": multi_turn.default_reads(self.scorer)} if self.scores else {}),
                    **{f.name: multi_turn.default_reads() for f in fns}}
        return multi_turn.parse_reads(specs, defaults, "rollout")

    def env_inputs(self) -> dict[str, str]:
        """What --env adds to the input fingerprints: its class's file (an edited environment reruns), and a named
        verifier's task when the environment brings the prompts."""
        from rlkit.tasks import task_inputs

        if self.env is None:
            return {}
        scorer = task_inputs(self.scorer) if self.scores and self.scorer is not self.task else {}
        return {"env": self.env.fingerprint, **({"verifier": scorer["task"]} if scorer else {})}

    def composition(self, fns) -> str:
        """What `reward` is: `env + verifier (task X)` and each --reward-fn, as said on stderr and in the manifest."""
        parts = (["env"] if self.env is not None else []) + ([f"verifier (task {self.scorer.name})"] if self.scores
                                                             else []) + [f"{f.name} (--reward-fn {f.label})" for f in fns]
        return " + ".join(parts) or "none"

    def manifest_entry(self, fns) -> dict:
        """The manifest's `reward`: the composition, each component's reading of a multi-turn row (under --env),
        and what `token_rewards` are a share of; and `verifier_check`, the verifier check's outcome."""
        entry = {"composition": self.composition(fns)}
        if self.env is not None:
            entry.update(reads=dict(self.reads), token_rewards="env")
        return {"reward": entry, **({"verifier_check": self.checked.entry()} if self.checked is not None else {})}

    def announce(self, fns, prompts: str | None) -> None:
        """rollout's line under --env on what its reward is: `reward = env` (the environment's prompts, a task's or
        --prompts FILE's), `reward = env + verifier (task X)` when --task names X, and each --reward-fn; with what
        each scorer reads of a trajectory."""
        from rlkit import console
        from rlkit.tasks import multi_turn

        if self.env is None:
            return
        line = f"rollout: reward = {self.composition(fns)}"
        if self.reads:
            line += "; " + ", ".join(f"{k} reads {multi_turn.READINGS[v]}" for k, v in self.reads.items())
        if not self.scores:
            src = (f"--prompts {prompts}" if prompts else "the environment's own prompts"
                   if getattr(self.task, "from_env", False) else f"task {self.task.name}'s prompts")
            line += f" (on {src}; --task NAME adds that task's verifier)"
        console.info(line)

    def fields(self, scored: bool, fns) -> list:
        """The table's columns beyond the rollouts kind's: each reward component (and the verifier's verdicts),
        and with --env the trajectories' (`rlkit.io.schemas.MULTI_TURN_FIELDS`) and their per-turn `token_rewards`
        (a share of reward/env)."""
        import pyarrow as pa

        from rlkit.io import schemas

        names = [*(["env"] if self.env is not None else []), *(["verifier"] if scored and self.scores else []),
                 *(f.name for f in fns)]
        extra = [pa.field(f"reward/{n}", pa.float64()) for n in names]
        extra += [pa.field("verdict/verifier", pa.string())] if scored and self.verdicts else []
        if self.env is None:
            return extra
        return [*extra, *schemas.MULTI_TURN_FIELDS, schemas.token_rewards_field("env")]

    def __call__(self, completions: list[str], answers: list[str], finish_reasons: list[str]):
        from rlkit.tasks import verify

        scores = verify(self.scorer, completions, answers, self.sandbox, finish_reasons=finish_reasons)
        for r in scores.reasons or ():
            self.counts[r] = self.counts.get(r, 0) + 1
        return scores

    def score(self, cols: dict, answers: list, fins: list[str], scored: bool, fns, row0: int,
              environments=None) -> None:
        """Add the chunk's reward columns to `cols`: the verifier's (and its verdicts) and each --reward-fn's, each
        on its reading of the rows (`rlkit.tasks.multi_turn`); the rows of a trajectory an environment error ended
        are not scored (every component 0, verdict `env_error`). `environments`: each row's instance (rollout --env,
        for the functions that read them)."""
        from rlkit.tasks import multi_turn

        skip = multi_turn.ended_by_error(cols)
        if scored and self.scores:
            reads = multi_turn.texts(self.reads.get("verifier", "final"), cols)
            got = {}

            def verify(rows):
                s = self([reads[i] for i in rows], [answers[i] for i in rows], [fins[i] for i in rows])
                got["reasons"] = s.reasons
                return s.values

            cols["reward/verifier"] = multi_turn.score_kept(skip, verify, 0.0)
            if self.verdicts:
                it = iter(got.get("reasons") or ())
                cols["verdict/verifier"] = [multi_turn.ENV_ERROR if s else next(it) for s in skip]
                self.counts[multi_turn.ENV_ERROR] = self.counts.get(multi_turn.ENV_ERROR, 0) + sum(skip)
        for f in fns:
            reads = multi_turn.texts(self.reads.get(f.name, "conversation"), cols)
            envs = environments if f.reads_environments else None

            def run(rows, f=f, reads=reads, envs=envs):
                sub = multi_turn.subset(cols, rows)
                sub["completion"] = [reads[i] for i in rows]
                return f.score(sub, row0=row0, environments=None if envs is None else [envs[i] for i in rows])

            cols[f"reward/{f.name}"] = multi_turn.score_kept(skip, run, 0.0)

    def record(self, cols: dict, env_wait: float = 0.0) -> dict[str, float]:
        """Tally a chunk's written columns -> the running means for the progress line: `reward`, the total
        update trains on (`rlkit.rewards.combine_rewards`: the components summed at weight 1, as update takes them
        without --reward), then each `reward/<name>`; under --env also `turns` (per trajectory), with `env_wait` the
        seconds the chunk's turn loop waited on its environment."""
        self.rows += len(cols["finish_reason"])
        self.cut += sum(f == "length" for f in cols["finish_reason"])
        extra = {}
        if self.trajectories is not None and "end_reason" in cols:
            self.trajectories.add(cols, env_wait)
            extra = {"turns": self.trajectories.mean_turns}
        comps = {k.split("/", 1)[1]: v for k, v in cols.items() if k.startswith("reward/")}
        if not comps:
            return extra
        total = array("f", combine_rewards(comps, None)[0])  # in float32, as update trains on them
        for k, v in (("reward", float(sum(total))), *((f"reward/{n}", float(sum(c))) for n, c in comps.items())):
            self.sums[k] = self.sums.get(k, 0.0) + v
        return {**{k: v / self.rows for k, v in self.sums.items()}, **extra}

    def say(self) -> None:
        from rlkit import console
        from rlkit.tasks import truncation_warning

        if self.sums:
            means = {k: v / self.rows for k, v in self.sums.items()}
            parts = [f"{k} {v:.4g}" for k, v in means.items() if k != "reward"]
            console.info(f"rollout: mean reward {means['reward']:.4g} over {self.rows} completions ("
                         + (" + ".join(parts) if len(parts) > 1 else parts[0])
                         + "; update trains on this sum, or on the components weighed by its --reward)")
        if self.trajectories is not None:
            for line in self.trajectories.lines("rollout"):
                console.info(line)
            own = self.env.attribute("max_turns")
            for line in self.trajectories.warnings("rollout", self.max_turns, own if isinstance(own, int) else None):
                console.warn(line)
        if self.counts:
            total = sum(self.counts.values())
            console.info(f"rollout: {self.scorer.name} verdicts of {total} responses: "
                         + ", ".join(f"{k} {v} ({v / total:.1%})" for k, v in sorted(self.counts.items(),
                                                                                        key=lambda kv: -kv[1])))
        if self.refills:
            drawn, kept = sum(r.drawn for r in self.refills), sum(r.kept for r in self.refills)
            want, first = sum(r.want for r in self.refills), sum(r.first for r in self.refills)
            informative, tail = sum(r.informative for r in self.refills), sum(r.tail for r in self.refills)
            line = (f"rollout: dynamic sampling: informative {informative} of {drawn} sampled "
                    f"({informative / max(1, drawn):.0%}); kept {kept}")
            if drawn > first:
                line += f"; {drawn - first} sampled after the first round's {first}"
            if tail:
                line += f"; {tail} sampled after the last group kept, in its chunk, dropped (in no prompts_drawn)"
            if kept < want:
                console.warn(line + f"; --max-refill-rounds reached: {want - kept} uninformative groups fill the batch")
            else:
                console.info(line)
        cut = truncation_warning("rollout", self.cut, self.rows, self.max_new_tokens, self.task)
        if cut:
            console.warn(cut)
