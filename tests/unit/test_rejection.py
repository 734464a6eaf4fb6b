"""Rejection-sampling SFT's pieces without a stage: the filter (`rlkit.training.rejection.select` and `reject` on a
hand-made rollouts table) and sft's cross-entropy with per-token completion masks (a multi-turn row's environment
tokens are read, never trained on)."""

from __future__ import annotations

import copy
import itertools
import random

import pyarrow as pa
import pytest
import torch

from rlkit.errors import RlkitError
from rlkit.training.rejection import reject, select

# ---------------------------------------------------------------- the filter


def _naive(rewards, groups, idx, min_reward, best_of):
    """The definition, row by row: reaches R, and (best_of) no other row of its group that reaches R beats it."""
    ok = [min_reward is None or r >= min_reward for r in rewards]
    out = []
    for i in range(len(rewards)):
        if not ok[i]:
            continue
        if best_of and any(ok[j] and groups[j] == groups[i] and (rewards[j] > rewards[i] or (
                rewards[j] == rewards[i] and idx[j] < idx[i])) for j in range(len(rewards))):
            continue
        out.append(i)
    return out


def test_select_by_hand():
    rewards = [1.0, 0.0, 1.0, 0.5, 0.2, 0.7, 0.7, 0.0]
    groups = [0, 0, 0, 1, 1, 2, 2, 3]
    idx = [0, 1, 2, 0, 1, 1, 0, 0]
    assert select(rewards, groups, idx, 1.0, False) == [0, 2]
    assert select(rewards, groups, idx, 1.0, True) == [0]  # group 0: two 1.0s, sample 0 wins the tie
    assert select(rewards, groups, idx, 0.5, True) == [0, 3, 6]  # group 2's tie: sample_idx 0 (row 6), not row 5
    assert select(rewards, groups, idx, None, True) == [0, 3, 6, 7]  # RAFT: every group's best, even a 0
    assert select(rewards, groups, idx, None, False) == list(range(8))
    assert select(rewards, groups, idx, 2.0, True) == []
    assert select([-1.5, -0.5], [0, 0], [0, 1], -1.0, False) == [1]  # rewards may be negative


def test_select_is_its_definition_on_random_tables():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        rewards = [rng.choice([0.0, 0.5, 1.0, -1.0]) for _ in range(n)]
        groups = [rng.randint(0, 3) for _ in range(n)]
        idx = rng.sample(range(n), n)
        for min_reward, best_of in itertools.product([None, 0.0, 0.5, 1.0], [False, True]):
            assert select(rewards, groups, idx, min_reward, best_of) == _naive(rewards, groups, idx, min_reward, best_of)


def _table(rewards: dict[str, list[float]], groups=None, loss_mask=None) -> pa.Table:
    n = len(next(iter(rewards.values())))
    cols = {"prompt_id": [f"p{g}" for g in groups or range(n)], "group_id": groups or list(range(n)),
            "sample_idx": [0] * n, "prompt_ids": [[1, 5]] * n, "completion_ids": [[7, 8, 2]] * n,
            **{f"reward/{k}": v for k, v in rewards.items()}}
    if loss_mask is not None:
        cols["loss_mask"] = pa.array(loss_mask, pa.list_(pa.int8()))
    return pa.table(cols)


def test_reject_sums_the_components_in_float64():
    # a total of exactly R reaches R: 0.7 through float32 is 0.699999988, which would not
    assert float(torch.tensor(0.7, dtype=torch.float32)) < 0.7
    t = _table({"verifier": [0.7, 0.6, 1.0], "format": [0.0, 0.1, -0.5]})
    kept = reject(t, min_reward=0.7, best_of=False, weights=None, label="t")  # totals 0.7, 0.7, 0.5
    assert kept.rows == [0, 1] and kept.weights == {"verifier": 1.0, "format": 1.0}
    kept = reject(t, min_reward=0.7, best_of=False, weights={"verifier": 1.0}, label="t")  # 0.7, 0.6, 1.0
    assert kept.rows == [0, 2] and kept.weights == {"verifier": 1.0}
    m = kept.metrics
    assert (m["rows_read"], m["rows_kept"], m["groups_read"], m["groups_kept"]) == (3, 2, 3, 2)
    assert m["min_reward"] == 0.7 and m["best_of"] is False
    assert m["reward_mean_kept"] == pytest.approx(0.85) and m["reward_mean_read"] == pytest.approx(2.3 / 3)
    kept = reject(t, min_reward=None, best_of=True, weights={"verifier": 2.0, "format": 1.0}, label="t")
    assert kept.rows == [0, 1, 2] and kept.metrics["min_reward"] is None  # one row a group: every group's best


def test_reject_refusals():
    t = _table({"verifier": [0.0, 0.5]})
    with pytest.raises(RlkitError, match=r"^no completion reaches --min-reward 1 \(best reward 0.5\) in t$"):
        reject(t, min_reward=1.0, best_of=True, weights=None, label="t")
    with pytest.raises(RlkitError, match="t has no reward/<component> columns"):
        reject(t.drop_columns(["reward/verifier"]), min_reward=0.0, best_of=False, weights=None, label="t")
    with pytest.raises(RlkitError, match=r"--reward names \['rm'\]"):
        reject(t, min_reward=0.0, best_of=False, weights={"rm": 1.0}, label="t")
    with pytest.raises(RlkitError, match="loss_mask entries but 3 completion tokens"):
        reject(_table({"env": [1.0]}, loss_mask=[[1, 0]]), min_reward=0.0, best_of=False, weights=None, label="t")


# ---------------------------------------------------------------- cross-entropy with completion masks


@pytest.fixture(scope="module")
def tiny_model():
    from rlkit import tiny

    tok = tiny.build_tokenizer()
    return tiny.build_model(tiny.TinyConfig(layers=2, hidden=32, heads=4, intermediate=64), tok, seed=0), tok


# three rows: a multi-turn one that ends on environment tokens (a truncated trajectory), a single-turn one (None),
# one with environment tokens in the middle
PLENS = [3, 2, 4]
MASKS = [[1, 1, 0, 0, 1, 0, 0], None, [1, 0, 0, 1, 1]]


def _rows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clens = [len(m) if m is not None else 6 for m in MASKS]
    return [torch.randint(4, vocab, (p + c,), generator=g).tolist() for p, c in zip(PLENS, clens, strict=True)]


def _step(model, tokens, masks, train=None):
    """One engine step of CrossEntropy -> (loss, the gradients)."""
    from rlkit.training import Optim, TrainOptions
    from rlkit.training.engine import Engine
    from rlkit.training.supervised import CrossEntropy

    objective = CrossEntropy()
    e = Engine(copy.deepcopy(model), objective, Optim(lr=1e-3, grad_clip=None), train=train or TrainOptions())
    plan = objective.plan(tokens, PLENS, masks)
    fig = e.step(plan, plan.rows, first=True)
    return fig.terms["loss"], {n: p.grad.clone() for n, p in e.model.named_parameters() if p.grad is not None}


def test_the_masked_loss_is_the_mean_log_prob_of_the_sampled_tokens(tiny_model):
    from rlkit.ops.logprobs import completion_logprobs
    from rlkit.ops.packing import layout

    model, tok = tiny_model
    tokens = _rows(len(tok))
    loss, _ = _step(model, tokens, MASKS)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, layout(tokens, PLENS, packed=False))
    # by hand: the sampled tokens' log-probs, row by row, over their count (3 + 6 + 3 = 12)
    picked = [float(lp[i, t]) for i, m in enumerate(MASKS) for t in range(lp.shape[1])
              if (m is None and t < len(tokens[i]) - PLENS[i]) or (m is not None and t < len(m) and m[t])]
    assert len(picked) == 12
    assert loss == pytest.approx(-sum(picked) / 12, rel=1e-5)
    # masks of all ones (and None) are the unmasked loss
    plain, _ = _step(model, tokens, None)
    ones, _ = _step(model, tokens, [[1] * (len(t) - p) for t, p in zip(tokens, PLENS, strict=True)])
    assert ones == pytest.approx(plain, rel=1e-6) and loss != pytest.approx(plain, rel=1e-3)


def test_an_environment_token_is_no_target(tiny_model):
    """Row 0 ends on two environment tokens: as the last ones, they are context for nothing, and as targets they are
    masked, so any value there leaves the loss and every gradient as they were. The same change with the mask
    off (every token a target) changes the loss: the check can fail."""
    model, tok = tiny_model
    tokens = _rows(len(tok))
    other = [list(t) for t in tokens]
    other[0][-1] = 4 + (other[0][-1] - 4 + 7) % (len(tok) - 4)
    other[0][-2] = 4 + (other[0][-2] - 4 + 3) % (len(tok) - 4)
    assert other[0] != tokens[0]
    loss, grads = _step(model, tokens, MASKS)
    loss2, grads2 = _step(model, other, MASKS)
    assert loss2 == loss
    assert all(torch.equal(grads[k], grads2[k]) for k in grads)
    assert _step(model, tokens, None)[0] != pytest.approx(_step(model, other, None)[0], rel=1e-4)


def test_masked_cross_entropy_is_the_same_in_micro_batches_and_packings(tiny_model):
    """--micro-batch-size, --micro-batch-tokens and --no-packing: the loss still averages over the whole step's
    sampled tokens (the plan's weights count them), so the gradient is the one-forward gradient."""
    from rlkit.training import TrainOptions

    model, tok = tiny_model
    tokens = _rows(len(tok), seed=1)
    loss, want = _step(model, tokens, MASKS)
    scale = max(float(g.abs().max()) for g in want.values())
    for train in (TrainOptions(micro_batch_size=1), TrainOptions(micro_batch_size=2, packing=False),
                  TrainOptions(micro_batch_tokens=max(len(t) for t in tokens) + 2)):
        got_loss, got = _step(model, tokens, MASKS, train)
        assert got_loss == pytest.approx(loss, rel=1e-5), train
        assert max(float((got[k] - want[k]).abs().max()) for k in want) / scale < 1e-5, train


def test_a_mask_of_the_wrong_length_is_a_bug_said_at_once():
    from rlkit.training.supervised import CrossEntropy

    with pytest.raises(ValueError, match="sequence 0 has 2 completion tokens but a mask of 3"):
        CrossEntropy().plan([[1, 2, 3, 4]], [2], [[1, 1, 0]])
