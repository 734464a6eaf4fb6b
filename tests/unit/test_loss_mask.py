"""Multi-turn rows (a `loss_mask` column: 1 on the completion tokens the policy sampled, 0 on those an
environment appended) through `update` and `score-ref`, token-exactly, on a real tiny model:

- the environment's tokens reach no loss, gradient, KL or token count: whatever old and reference log-probs
  they carry, every --algo's loss, metrics and every parameter's gradient are bitwise the same (PPO's critic
  and GAE included: GAE steps over them, as over tokens that are not actions);
- a table without the column, with an all-null one or with an all-ones one trains bitwise alike, and the
  written table kinds are the ones single-turn tables always had;
- a bad loss_mask (wrong length, a value other than 0/1, no sampled token) and a multi-turn prefs table for
  DPO are refused in one line naming the row;
- score-ref scores every completion token and carries the multi-turn columns through unchanged.
"""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest
import torch

from rlkit.algorithms.config import RLConfig
from rlkit.errors import RlkitError
from rlkit.io import schemas

from conftest import one_error_line, run_cli_inproc, untrained_checkpoint

# 8 rows in 2 groups of 4. Each row: prompt length, completion length, and its loss_mask as (sampled, env) runs
# (None: a null loss_mask, every token sampled). Row 3 ends on environment tokens (truncated after a tool reply).
PLENS = [3, 6, 2, 5, 4, 7, 2, 3]
RUNS = [[(3, 4), (5, 0)], [(4, 0)], [(2, 3), (2, 2), (3, 0)], [(4, 5)], None, [(1, 6), (2, 0)],
        [(6, 0)], [(2, 2), (1, 3), (2, 0)]]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def _mask(runs) -> list[int] | None:
    return None if runs is None else [v for s, e in runs for v in [1] * s + [0] * e]


MASKS = [_mask(r) for r in RUNS]
CLENS = [len(m) if m is not None else 9 for m in MASKS]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Llama saved as a checkpoint (PPO's critic starts from it), and its tokenizer."""
    return untrained_checkpoint(tmp_path_factory.mktemp("lossmask") / "pol")


@pytest.fixture(scope="module")
def rows(policy):
    """Token ids, and pi_old / pi_ref as a rollout and score-ref would log them: pi_old a noisy copy of the
    policy's own log-probs on the sampled tokens and 0.0 on the environment's (the engine has none), pi_ref
    the reference's on every completion token."""
    from rlkit.algorithms.inputs import RLBatch, recompute_logprobs
    from rlkit.ops.logprobs import pack_sequences

    model, tok, _ = policy
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in PLENS]
    comps = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in CLENS]
    ids, attn, targets, span, start = pack_sequences(prompts, comps, tok.pad_token_id)
    z = torch.zeros(span.shape)
    lp = recompute_logprobs(model, RLBatch(ids, attn, targets, span, start, z, None, z[:, 0], z[:, 0]), 1.0, 8)
    old = lp - 0.3 * (2 * torch.rand(span.shape, generator=g) - 1)
    ref = lp + 0.2 * torch.randn(span.shape, generator=g)
    sampled = [m if m is not None else [1] * c for m, c in zip(MASKS, CLENS, strict=True)]
    old = [[o if s else 0.0 for o, s in zip(old[i, :c].tolist(), sampled[i], strict=True)] for i, c in enumerate(CLENS)]
    ref = [ref[i, :c].tolist() for i, c in enumerate(CLENS)]
    return prompts, comps, old, ref


def _table(rows, masks="mask", old=None, ref=None, kind="scored", turns=True) -> pa.Table:
    """The rows as an Arrow table of `kind`, with `masks` as its loss_mask column ("mask": MASKS; None: no column)."""
    prompts, comps, old0, ref0 = rows
    n = len(prompts)
    cols = {"prompt_id": [f"q{g}" for g in GROUPS], "group_id": GROUPS, "sample_idx": [i % 4 for i in range(n)],
            "prompt": ["p"] * n, "completion": ["c"] * n, "prompt_ids": prompts, "completion_ids": comps,
            "old_logprobs": old if old is not None else old0, "finish_reason": ["stop"] * n,
            "policy_fingerprint": ["x"] * n, "policy_step": [0] * n}
    if kind == "scored":
        cols["ref_logprobs"] = ref if ref is not None else ref0
    extra = []
    if masks is not None:
        cols["loss_mask"] = MASKS if masks == "mask" else masks
        extra.append(pa.field("loss_mask", pa.list_(pa.int8())))
        if turns:
            cols["turns"] = [1 if r is None else sum(s > 0 for s, _ in r) for r in RUNS]
            extra.append(pa.field("turns", pa.int32()))
    cols["reward/verifier"] = REWARDS
    extra.append(pa.field("reward/verifier", pa.float64()))
    schema = schemas.kind(kind).schema(extra)
    return pa.table({f.name: pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type)
                     for f in schema}, schema=schema)


def _perturbed(rows, what=("old", "ref"), sampled_too: bool = False):
    """old/ref log-probs changed at every environment token (`sampled_too`: at a sampled token as well)."""
    prompts, comps, old, ref = rows
    g = torch.Generator().manual_seed(11)
    old, ref = [list(o) for o in old], [list(r) for r in ref]
    for i, m in enumerate(MASKS):
        for t in range(CLENS[i]):
            if (m is not None and m[t] == 0) or (sampled_too and i == 0 and t == 1):
                if "old" in what:
                    old[i][t] = float(-5 * torch.rand((), generator=g))
                if "ref" in what:
                    ref[i][t] = float(-5 * torch.rand((), generator=g))
    return prompts, comps, old, ref


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _update(policy, cfg: RLConfig, table, recompute: bool = False):
    """One `update` (the trainer `rlkit update` runs, one optimizer step) on `table` -> (metrics, policy grads,
    critic grads or {})."""
    from rlkit.algorithms.inputs import build_batch
    from rlkit.algorithms.trainer import Trainer

    model, tok, d = policy
    batch, _ = build_batch(table, tok.pad_token_id)
    t = Trainer(copy.deepcopy(model), cfg, tokenizer=tok)
    if cfg.algo == "ppo":
        t.load(d)
    m = t.train(batch, temperature=1.0, length_norm=16.0, recompute=recompute)
    assert m["optimizer_steps"] == 1
    return m, _grads(t.model), _grads(t.algo.critic.model) if cfg.algo == "ppo" else {}


# what an update reports that depends on its input (not timings or memory)
FIGURES = ("loss", "value_loss", "grad_norm", "kl_per_token", "kl_per_seq", "mean_response_tokens", "clip_fraction",
           "ratio_mean", "ratio_min", "ratio_max", "entropy", "advantage_abs_mean", "values_mean", "returns_mean",
           "explained_variance", "value_clip_fraction", "logprob_mismatch", "logprob_mismatch_max", "is_ess",
           "tis_weight_mean", "tis_capped_fraction", "degenerate_group_fraction")


def _bitwise_same(got, want, label: str) -> None:
    (mg, gg, cg), (mw, gw, cw) = got, want
    for k in FIGURES:
        assert mg.get(k) == mw.get(k), (label, k, mg.get(k), mw.get(k))
    for grads_g, grads_w in ((gg, gw), (cg, cw)):
        assert sorted(grads_g) == sorted(grads_w)
        for n in grads_w:
            assert torch.equal(grads_g[n], grads_w[n]), (label, n)


def _differs(got, want) -> bool:
    return any(not torch.equal(got[1][n], want[1][n]) for n in want[1])


CASES = {"grpo": dict(beta=0.05), "dr-grpo": dict(beta=0.05), "rloo": dict(beta=0.05, loss_agg="seq-mean-token-mean"),
         "gspo": dict(beta=0.05), "ppo": dict(beta=0.05, gamma=0.9)}


@pytest.mark.parametrize("algo", list(CASES))
def test_environment_tokens_reach_no_loss_gradient_or_metric(algo, policy, rows):
    cfg = RLConfig(algo=algo, minibatch_size=8, epochs=1, lr=1e-3, grad_clip=1e9, **CASES[algo])
    want = _update(policy, cfg, _table(rows))
    assert max(float(g.abs().max()) for g in want[1].values()) > 1e-5  # a real gradient
    # old and reference log-probs at the environment's tokens: changed (for PPO they are its per-token rewards'
    # inputs, the KL penalty): nothing moves, bitwise
    _bitwise_same(_update(policy, cfg, _table(_perturbed(rows))), want, algo)
    # the comparison can fail: the same change at one sampled token moves the gradient, and so does training
    # on the environment's tokens (the table without its loss_mask)
    assert _differs(_update(policy, cfg, _table(_perturbed(rows, sampled_too=True))), want)
    assert _differs(_update(policy, cfg, _table(rows, masks=None)), want)
    sampled = sum(sum(m) if m is not None else c for m, c in zip(MASKS, CLENS, strict=True))
    assert want[0]["mean_response_tokens"] == sampled / len(MASKS)


def test_recomputed_pi_old_and_tis_ignore_the_environments_tokens(policy, rows):
    """--old-logprobs recompute with --tis-cap: the engine's 0.0 at the environment's tokens (it has no log-prob
    there) is no mismatch; the ratio, the TIS weights and the mismatch and ESS figures read sampled tokens only."""
    cfg = RLConfig(algo="grpo", beta=0.05, minibatch_size=8, epochs=1, lr=1e-3, grad_clip=1e9, tis_cap=2.0)
    want = _update(policy, cfg, _table(rows), recompute=True)
    _bitwise_same(_update(policy, cfg, _table(_perturbed(rows, what=("old",))), recompute=True), want, "recompute")
    # the figures are those of the sampled tokens alone: the engine's pi_old at them against the trainer's
    from rlkit.algorithms.inputs import build_batch, recompute_logprobs

    model, tok, _ = policy
    b, _ = build_batch(_table(rows), tok.pad_token_id)
    lp = recompute_logprobs(model, b, 1.0, 8)
    assert bool((lp[b.span & ~b.mask] != 0).all())  # log-probs at every completion token, the environment's too
    gap = (lp - b.old_logp).abs()[b.mask]
    assert want[0]["logprob_mismatch"] == pytest.approx(float(gap.mean()), rel=1e-5)
    assert want[0]["logprob_mismatch_max"] == pytest.approx(0.3, abs=0.01)  # the noise, not an environment token's lp


def test_a_table_without_loss_mask_trains_as_one_with_an_all_ones_or_null_loss_mask(policy, rows):
    ones = [[1] * c for c in CLENS]
    for algo in ("grpo", "ppo", "gspo"):
        cfg = RLConfig(algo=algo, minibatch_size=8, epochs=1, lr=1e-3, grad_clip=1e9, **CASES[algo])
        want = _update(policy, cfg, _table(rows, masks=None))
        _bitwise_same(_update(policy, cfg, _table(rows, masks=ones)), want, f"{algo} all ones")
        _bitwise_same(_update(policy, cfg, _table(rows, masks=[None] * len(CLENS))), want, f"{algo} null")
    from rlkit.algorithms.inputs import build_batch

    b, _ = build_batch(_table(rows, masks=None), policy[1].pad_token_id)
    assert b.span is None  # single-turn: the batch it always was


def test_single_turn_tables_keep_their_columns():
    """The multi-turn columns (and the per-token and refill ones) are not written unless a writer passes them: a
    single-turn table's schema (and so its bytes) is what it was; rollouts and scored tables accept them,
    type-checked when present."""
    optional = [*schemas.MULTI_TURN_FIELDS, *schemas.TOKEN_FIELDS, *schemas.REFILL_FIELDS]
    for k in ("rollouts", "scored"):
        names = schemas.kind(k).schema().names
        assert not schemas.CARRIED_NAMES & set(names), names
        assert [f.name for f in schemas.kind(k).accepted] == [f.name for f in optional]
    base = schemas.kind("rollouts").schema()
    schemas.validate_schema(base.append(pa.field("loss_mask", pa.list_(pa.int64()))), ["rollouts"], "t")
    schemas.validate_schema(base.append(pa.field("loss_mask", pa.null())), ["rollouts"], "t")
    with pytest.raises(RlkitError, match="column 'loss_mask' has type list<item: string>"):
        schemas.validate_schema(base.append(pa.field("loss_mask", pa.list_(pa.string()))), ["rollouts"], "t")


def test_length_penalty_counts_sampled_tokens(policy, rows):
    from rlkit.algorithms.inputs import build_batch

    b, used = build_batch(_table(rows), policy[1].pad_token_id, length_penalty=0.01)
    n = [sum(m) if m is not None else c for m, c in zip(MASKS, CLENS, strict=True)]
    assert b.rewards.tolist() == pytest.approx([r - 0.01 * k for r, k in zip(REWARDS, n, strict=True)])
    assert b.mask.sum(1).tolist() == n and b.span.sum(1).tolist() == CLENS
    assert set(used) == {"verifier", "length_penalty"}


def test_gae_steps_over_the_environments_tokens():
    """GAE on a row with holes in its mask is GAE on the row with the holes cut out; rewards and values in the
    holes are never read; the policy's tokens on either side of one bootstrap each other undiscounted."""
    from rlkit.ops.gae import gae

    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]],
                        dtype=torch.bool)
    rewards, values = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    noisy = torch.where(mask, 0, torch.randn(mask.shape, generator=g) * 100)
    adv2, ret2 = gae(rewards + noisy, values - noisy, mask, gamma=0.9, lam=0.8)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all())
    for i in range(len(mask)):
        k = int(mask[i].sum())
        a, r = gae(rewards[i][mask[i]].unsqueeze(0), values[i][mask[i]].unsqueeze(0),
                   torch.ones(1, k, dtype=torch.bool), gamma=0.9, lam=0.8)
        assert torch.equal(adv[i][mask[i]], a[0]) and torch.equal(ret[i][mask[i]], r[0])
    # the check can fail: stepping through the holes as time steps gives other advantages
    full = torch.tensor([[1] * 7 + [0], [1] * 5 + [0] * 3, [1] * 6 + [0] * 2], dtype=torch.bool)
    assert not torch.equal(gae(rewards * mask, values * mask, full, 0.9, 0.8)[0] * mask, adv)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_policy_loss_has_zero_gradient_at_masked_tokens(agg):
    from rlkit.algorithms.gspo import sequence_log_ratio
    from rlkit.ops.losses import AGGREGATIONS, policy_token_loss, token_log_ratio

    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    logp = (-torch.rand(mask.shape, generator=g) * 3).requires_grad_()
    old, ref = logp.detach() + 0.1 * torch.randn(mask.shape, generator=g), -torch.rand(mask.shape, generator=g) * 3
    for log_ratio in (token_log_ratio, sequence_log_ratio):
        tl = policy_token_loss(logp, old, torch.tensor([1.0, -0.5]), mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                               tis=torch.rand(mask.shape, generator=g), ref_logp=ref, kl_estimator="k3+", kl_coef=0.1,
                               log_ratio=log_ratio)
        (grad,) = torch.autograd.grad(AGGREGATIONS[agg](tl.loss, mask, 6.0), logp)
        assert bool((grad[~mask] == 0).all()) and bool((grad[mask] != 0).all()), (agg, log_ratio.__name__)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("masks,match", [
    ([_mask([(2, 1)]) if i == 2 else m for i, m in enumerate(MASKS)],
     r"^the input: row 2 \(prompt_id 'q0', sample 2\) has 3 loss_mask entries but 12 completion tokens; "),
    ([[2 if t == 4 else v for t, v in enumerate(m)] if i == 5 else m for i, m in enumerate(MASKS)],
     r"^the input: row 5 \(prompt_id 'q1', sample 1\) has loss_mask value 2 at completion token 4; "),
    ([[0] * len(m) if i == 3 else m for i, m in enumerate(MASKS)],
     r"^the input: row 3 \(prompt_id 'q0', sample 3\) has no token sampled by the policy \(its loss_mask is all 0 "),
])
def test_a_bad_loss_mask_is_refused_naming_the_row(policy, rows, masks, match):
    from rlkit.algorithms.inputs import build_batch

    with pytest.raises(RlkitError, match=match) as e:
        build_batch(_table(rows, masks=masks), policy[1].pad_token_id)
    assert "\n" not in str(e.value)


def test_update_refuses_a_bad_loss_mask_in_one_line_exit_2(policy, rows, tmp_path):
    from rlkit.io import manifests, streams

    bad = [[7] * len(m) if i == 0 else m for i, m in enumerate(MASKS)]
    t = _table(rows, masks=bad, kind="rollouts")
    src = tmp_path / "bad.arrow"
    with streams.write_table("rollouts", src, manifests.make_manifest("rollouts", "rollout", {}, {}),
                             [f for f in t.schema if f.name in ("loss_mask", "turns", "reward/verifier")]) as w:
        w.write(t.to_batches()[0])
    out = tmp_path / "out"
    r = run_cli_inproc("update", "--policy", str(policy[2]), "--in", str(src), "--out", str(out), "--beta", "0",
                       "--device", "cpu")
    line = one_error_line(r)
    assert r.returncode == 2 and f"{src}: row 0 (prompt_id 'q0', sample 0) has loss_mask value 7" in line, line
    assert not out.exists()


def test_dpo_refuses_multi_turn_prefs(policy):
    from rlkit.algorithms.inputs import build_pref_batch

    tok = policy[1]
    base = {"prompt_id": ["a", "b"], "prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": ["3", "5"],
            "split": ["train", "train"], "ref_chosen_logp": [-1.0, -2.0], "ref_rejected_logp": [-3.0, -4.0]}
    build_pref_batch(pa.table({**base, "loss_mask": pa.array([[1], None], pa.list_(pa.int8())),
                               "turns": pa.array([1, 1], pa.int32())}), tok)  # single-turn columns: fine
    for extra, why in (({"loss_mask": pa.array([[1], [1, 0, 1]], pa.list_(pa.int8()))},
                        r"its loss_mask marks environment tokens \(0\)"),
                       ({"turns": pa.array([1, 3], pa.int32())}, "it has 3 turns")):
        with pytest.raises(RlkitError, match=rf"^t: row 1 \(prompt_id 'b'\) is a multi-turn trajectory \({why}\); "
                                             "--algo dpo ") as e:
            build_pref_batch(pa.table({**base, **extra}), tok, label="t")
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- score-ref, then update, through the CLI


def test_score_ref_scores_every_token_and_carries_the_multi_turn_columns(policy, rows, tmp_path):
    from rlkit.io import manifests, streams
    from rlkit.stages.freeze_ref import FreezeRefConfig
    from rlkit.stages.freeze_ref import run as freeze

    model, tok, d = policy
    ref = tmp_path / "ref"
    freeze(FreezeRefConfig(policy=d, out=ref, dtype="fp32"))
    t = _table(rows, kind="rollouts")
    n = t.num_rows
    more = {"turn_rewards": pa.array([[0.0, 1.0]] * n, pa.list_(pa.float64())), "terminated": pa.array([True] * n),
            "truncated": pa.array([False] * n), "end_reason": pa.array(["terminated"] * n),
            "tool_calls": pa.array([1] * n, pa.int32()), "observation_tokens": pa.array([[2]] * n, pa.list_(pa.int32())),
            "messages": pa.array([[{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]] * n,
                                 schemas.MULTI_TURN_FIELDS[-1].type)}
    for k, v in more.items():
        t = t.append_column(pa.field(k, v.type), v)
    src, scored = tmp_path / "roll.arrow", tmp_path / "scored.arrow"
    extra = [f for f in t.schema if f.name in schemas.MULTI_TURN_NAMES or f.name.startswith("reward/")]
    with streams.write_table("rollouts", src, manifests.make_manifest("rollouts", "rollout", {}, {}), extra) as w:
        w.write(t.select([f.name for f in w.schema]).to_batches()[0])
    r = run_cli_inproc("score-ref", "--ref", str(ref), "--in", str(src), "--out", str(scored), "--device", "cpu")
    assert r.returncode == 0, r.stderr.decode()
    out, _ = streams.read_table(scored, ["scored"])
    for name in schemas.MULTI_TURN_NAMES:
        assert out.schema.field(name) == t.schema.field(name) and out.column(name).equals(t.column(name)), name
    from rlkit.scorers.logprobs import score_tokens

    want = score_tokens(model, rows[0], rows[1], tok.pad_token_id, 1.0, 4096)
    got = out.column("ref_logprobs").to_pylist()
    for g_row, w_row, c in zip(got, want, CLENS, strict=True):
        assert len(g_row) == c and all(x != 0 for x in g_row)  # the environment's tokens scored too
        assert g_row == pytest.approx(w_row, abs=1e-5)
    # and update trains on it: the sampled tokens only
    upd = tmp_path / "pol2"
    r = run_cli_inproc("update", "--policy", str(d), "--in", str(scored), "--out", str(upd), "--beta", "0.05",
                       "--device", "cpu", "--epochs", "1")
    assert r.returncode == 0, r.stderr.decode()
    m = manifests.read_manifest(upd)["metrics"]
    sampled = sum(sum(x) if x is not None else c for x, c in zip(MASKS, CLENS, strict=True))
    assert m["mean_response_tokens"] == sampled / n
    assert m["environment_token_fraction"] == pytest.approx(1 - sampled / sum(CLENS))


def test_update_shows_mean_turns_and_the_environments_token_share(policy, rows, tmp_path):
    """update's table on a multi-turn batch shows mean_turns and environment_token_fraction (the completion tokens
    with loss_mask 0 over all completion tokens), the figures its manifest records; a row --mask-truncated leaves
    out of the loss still counts its sampled tokens as sampled."""
    from rlkit.io import manifests, streams

    t = _table(rows, kind="rollouts")
    cut = ["length"] + ["stop"] * (t.num_rows - 1)  # row 0 (3 sampled, 4 environment tokens) hit the limit
    i = t.schema.get_field_index("finish_reason")
    t = t.set_column(i, t.schema.field(i), pa.array(cut, t.schema.field(i).type))
    src = tmp_path / "mt.arrow"
    with streams.write_table("rollouts", src, manifests.make_manifest("rollouts", "rollout", {}, {}),
                             [f for f in t.schema if f.name in ("loss_mask", "turns", "reward/verifier")]) as w:
        w.write(t.to_batches()[0])
    out = tmp_path / "out"
    r = run_cli_inproc("update", "--policy", str(policy[2]), "--in", str(src), "--out", str(out), "--beta", "0",
                       "--device", "cpu", "--epochs", "1", "--mask-truncated", env={"COLUMNS": "160"})
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    m = manifests.read_manifest(out)["metrics"]
    sampled = sum(sum(x) if x is not None else c for x, c in zip(MASKS, CLENS, strict=True))
    turns = [1 if x is None else sum(s > 0 for s, _ in x) for x in RUNS]
    assert m["environment_token_fraction"] == pytest.approx(1 - sampled / sum(CLENS))
    assert m["mean_turns"] == pytest.approx(sum(turns) / len(turns))
    shown = {line.split()[1]: line.split()[3] for line in r.stderr.decode().splitlines()
             if len(line.split()) == 5 and line.split()[1] in ("mean_turns", "environment_token_fraction")}
    assert shown == {"mean_turns": f"{m['mean_turns']:.4g}",
                     "environment_token_fraction": f"{m['environment_token_fraction']:.4g}"}, r.stderr.decode()


def test_updates_table_says_its_figures_are_the_batchs_under_follow(monkeypatch):
    import io

    from rich.console import Console

    from rlkit import console
    from rlkit.algorithms.grpo import GRPO
    from rlkit.algorithms.inputs import Rollouts
    from rlkit.algorithms.record import show

    metrics = {"step": 3, "reward_mean": 0.5, "mean_turns": 2.5, "environment_token_fraction": 0.25}
    for follow in (False, True):
        buf = io.StringIO()
        monkeypatch.setattr(console, "err", Console(file=buf, width=120, highlight=False, markup=False))
        show(metrics, Rollouts(), GRPO, follow=follow)
        text = " ".join(buf.getvalue().split())
        assert "mean_turns" in text and "2.5" in text and "environment_token_fraction" in text and "0.25" in text
        assert ("figures of this step's batch, not running means" in text) == follow
