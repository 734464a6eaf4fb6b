"""The two input kinds an algorithm reads, table -> typed in-memory batch: `Rollouts` (a rollouts or
scored table -> `RLBatch`) and `Prefs` (a prefs table scored by the reference -> `PrefBatch`). Each
also says which table kinds `update` opens, what it refuses about the input, and the metrics the
input itself gives (the rewards).

The jobs beside the loaders live in modules of their own: the tensors (`rlkit.algorithms.batch`), the row checks
every stage shares (`rlkit.io.rows`), length shaping (`rlkit.algorithms.shaping`) and pi_old
(`rlkit.algorithms.pi_old`); their public names are re-exported here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlkit.algorithms.batch import (  # noqa: F401 (re-exported)
    PrefBatch,
    RLBatch,
    RolloutRows,
    build_batch,
    build_pref_batch,
    read_rollouts,
    refuse_multi_turn,
)
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.pi_old import batch_inputs, mismatch_metrics, recompute_logprobs  # noqa: F401 (re-exported)
from rlkit.algorithms.shaping import (  # noqa: F401 (re-exported)
    Overlong,
    length_norm,
    overlong_limit,
    sampled_tokens,
    shaping,
)
from rlkit.errors import RlkitError
from rlkit.io.manifests import Manifest
from rlkit.io.rows import (  # noqa: F401 (re-exported)
    Limits,
    check_loss_mask,
    check_not_all_empty,
    check_pair_lengths,
    check_rows,
    context_length,
    loss_masks,
    row_name,
)


class Loaded(NamedTuple):
    """An input table made ready to train on."""

    batch: Any  # RLBatch | PrefBatch
    train: dict[str, Any]  # keyword arguments of Trainer.train (temperature, length_norm, recompute, lags)
    metrics: dict[str, Any]  # what the input says about itself (reward means, ...)
    reward_weights: dict[str, float] | None  # the reward components' weights used (for the manifest)


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
        masks = loss_masks(table, label)  # checked once, here: the batch and the metrics read these
        if policy_fingerprint is not None and any(
                p != policy_fingerprint for p in set(table.column("policy_fingerprint").to_pylist())):
            console.warn("these rollouts were sampled from another checkpoint than --policy (off-policy); "
                         "the pi_theta/pi_old ratio corrects for it, within the clip range")
        temperature = upstream.temperature
        shape = None
        if overlong is not None:  # (buffer, penalty) against the rollout's single-turn --max-new-tokens
            shape = Overlong(overlong_limit(upstream.sampling, overlong[0], label), *overlong)
        if mask_truncated and "finish_reason" not in table.column_names:
            raise RlkitError(f"{label} has no finish_reason column, so --mask-truncated cannot tell the truncated rows")
        rows = read_rollouts(table, label, length_penalty, shape, masks)
        batch, used = build_batch(table, tokenizer.pad_token_id, weights, length_penalty, label, shape, mask_truncated,
                                  rows)
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
        comps = rows.components
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
        traj = trajectories.figures(table, sampled_tokens(rows.completions, rows.masks))
        metrics.update({k: traj[k] for k in ("mean_turns", "mean_tool_calls", "environment_token_fraction")
                        if traj and traj[k] is not None})
        train = {"temperature": temperature, "recompute": recompute, "lags": lags,
                 "length_norm": length_norm(upstream.sampling, batch)}  # Dr. GRPO's
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
                raise RlkitError(f"{label}: {row_name(table, i)}: prompt + chosen and prompt + rejected are {int(n[i])} + "
                                 f"{int(n[P + i])} tokens, which run in one forward pass, more than --micro-batch-tokens "
                                 f"{budget}; raise --micro-batch-tokens to at least {int(pair[i])} if memory allows")
        return Loaded(batch, {}, {}, None)
