"""CISPO (`--algo cispo`, rlkit.ops.losses.cispo): the clipped importance weight, detached, times the advantage and
the log-prob of every token, against a gradient computed by hand; the policy-loss registry it plugs into."""

from __future__ import annotations

import math

import pytest
import torch

from rlkit.algorithms import registry
from rlkit.algorithms.config import RLConfig, resolve
from rlkit.ops.losses import AGGREGATIONS, POLICY_LOSSES, policy_token_loss


def test_cispo_gradient_by_hand():
    # two rows of three tokens, the last token of row 2 padding; ratios e^(logp - old)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
    delta = torch.tensor([[math.log(2.0), 0.0, math.log(0.5)], [math.log(1.1), math.log(3.0), 99.0]])
    logp = (old + delta).clone().requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -2.0])
    tl = policy_token_loss(logp, old, adv, mask, clip_low=1.0, clip_high=0.28, policy_loss="cispo")
    loss = AGGREGATIONS["token-mean"](tl.loss, mask)
    loss.backward()
    # d/d logp_t of mean_t(-w_t A log r_t) = -w_t A / n, w_t = clip(r_t, 0, 1.28), n = 5 tokens
    w = [[1.28, 1.0, 0.5], [1.1, 1.28, 0.0]]
    want = torch.tensor([[-w[i][j] * float(adv[i]) / 5 if mask[i, j] else 0.0 for j in range(3)] for i in range(2)])
    torch.testing.assert_close(logp.grad, want)
    # its value: -w A (1 + log r) (-A on-policy), and the tokens whose weight was clipped (r = 2 and r = 3)
    row1 = -1.0 * (1.28 * (1 + math.log(2.0)) + 1.0 * 1 + 0.5 * (1 + math.log(0.5)))  # A = 1
    row2 = 2.0 * (1.1 * (1 + math.log(1.1)) + 1.28 * (1 + math.log(3.0)))  # A = -2
    assert float(loss.detach()) == pytest.approx((row1 + row2) / 5)
    assert tl.clipped.tolist() == [[True, False, False], [False, True, False]] and not tl.dual_clipped.any()


def test_the_clipped_surrogate_drops_the_gradient_cispo_keeps():
    """A token whose ratio rose past 1 + clip_high under a positive advantage: no gradient from the clipped
    surrogate, the clipped weight's from CISPO."""
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(2.0)).clone().requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for name, want in (("clipped", 0.0), ("cispo", -1.28)):
        logp.grad = None
        tl = policy_token_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28, policy_loss=name)
        tl.loss.sum().backward()
        assert float(logp.grad) == pytest.approx(want)


def test_cispo_is_registered_with_the_papers_defaults():
    assert set(POLICY_LOSSES) >= {"clipped", "cispo"}
    cls = registry.get("cispo")
    assert cls.policy_loss == "cispo" and cls.estimator == "grpo"
    cfg = resolve(RLConfig(algo="cispo"))
    assert (cfg.clip_low, cfg.clip_high, cfg.beta, cfg.loss_agg) == (1.0, 0.28, 0.0, "token-mean")
    cfg.check()
    assert registry.get("grpo").policy_loss == "clipped"
