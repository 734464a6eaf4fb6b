"""The RLHF math (preference losses, GAE, value loss, adaptive KL) with hand-derived values, and the
vectorised GAE against a naive per-row loop. No model."""

import json
import math

import pytest
import torch

from rlkit.ops.gae import (
    AdaptiveKLController,
    clipped_value_loss,
    gae,
    kl_penalised_token_rewards,
    masked_whiten,
)
from rlkit.ops.preference import bradley_terry_loss, dpo_loss, pair_accuracy

LOG2 = math.log(2)


# ---- preference -----------------------------------------------------------------------------------

def test_bradley_terry_by_hand():
    # equal scores: -log sigmoid(0) = log 2
    assert bradley_terry_loss(torch.tensor([0.3]), torch.tensor([0.3])).item() == pytest.approx(LOG2)
    # gap 1, margin 0: -log sigmoid(1) = log(1 + e^-1)
    loss = bradley_terry_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]))
    assert loss.shape == (2,)
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-1))] * 2)
    # margin eats the gap: 2 - 1 - 1 = 0 -> log 2; per-pair margin tensor [1, 0] -> [log 2, log(1 + e^-1)]
    assert bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), margin=1.0).item() == pytest.approx(LOG2)
    loss = bradley_terry_loss(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 1.0]), margin=torch.tensor([1.0, 0.0]))
    assert loss.tolist() == pytest.approx([LOG2, math.log1p(math.exp(-1))])
    # stable at huge gaps: gap +1000 -> 0, gap -1000 -> 1000 (naive log(sigmoid) would give inf)
    loss = bradley_terry_loss(torch.tensor([1000.0, 0.0]), torch.tensor([0.0, 1000.0]))
    assert torch.isfinite(loss).all()
    assert loss.tolist() == pytest.approx([0.0, 1000.0])


def test_bradley_terry_gradient_pushes_chosen_up():
    c, r = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(c, r).sum().backward()
    # d/dc [-log sigmoid(c - r)] = -sigmoid(r - c) = -0.5 at a tie
    assert c.grad.item() == pytest.approx(-0.5)
    assert r.grad.item() == pytest.approx(0.5)


def test_pair_accuracy_tie_counts_wrong():
    # pairs: 1>0 right, 2=2 tie (wrong), 3<4 wrong, 0>-1 right -> 2/4
    assert pair_accuracy(torch.tensor([1.0, 2.0, 3.0, 0.0]), torch.tensor([0.0, 2.0, 4.0, -1.0])) == 0.5
    assert isinstance(pair_accuracy(torch.tensor([1.0]), torch.tensor([0.0])), float)
    assert math.isnan(pair_accuracy(torch.zeros(0), torch.zeros(0)))


def test_dpo_at_reference_is_log2_and_gradient_pushes_chosen_up():
    pc = torch.tensor([-3.0, -7.0], requires_grad=True)
    pr = torch.tensor([-5.0, -2.0], requires_grad=True)
    rc, rr = pc.detach().clone(), pr.detach().clone()
    beta = 0.1
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
    # h = 0 -> -log sigmoid(0) = log 2, whatever the log-probs
    assert loss.tolist() == pytest.approx([LOG2, LOG2])
    assert cr.tolist() == pytest.approx([0, 0]) and rj.tolist() == pytest.approx([0, 0])
    loss.sum().backward()
    # dloss/dh = -beta * sigmoid(-beta h) = -beta / 2 at h = 0; h rises with pi_c, falls with pi_r
    assert pc.grad.tolist() == pytest.approx([-beta / 2] * 2)  # descent raises pi_chosen
    assert pr.grad.tolist() == pytest.approx([beta / 2] * 2)  # descent lowers pi_rejected
    # with label smoothing ls: dloss/dh = -beta (1 - ls) / 2 + beta ls / 2 at h = 0 -> still log 2
    loss_ls, _, _ = dpo_loss(rc, rr, rc, rr, beta=beta, label_smoothing=0.1)
    assert loss_ls.tolist() == pytest.approx([LOG2, LOG2])


def test_dpo_rewards_and_label_smoothing_by_hand():
    pc, rc = torch.tensor([-3.0], requires_grad=True), torch.tensor([-4.0])
    pr, rr = torch.tensor([-5.0], requires_grad=True), torch.tensor([-4.0])
    beta = 0.1
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
    # chosen reward = 0.1 * (-3 - -4) = 0.1; rejected = 0.1 * (-5 - -4) = -0.1 (detached)
    assert cr.item() == pytest.approx(0.1) and rj.item() == pytest.approx(-0.1)
    assert not cr.requires_grad and not rj.requires_grad
    # h = 1 - (-1) = 2, beta h = 0.2: loss = -log sigmoid(0.2) = log(1 + e^-0.2) = 0.598139
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.2)))
    assert loss.item() == pytest.approx(0.598139, abs=1e-6)
    # ls = 0.1: 0.9 log(1 + e^-0.2) + 0.1 log(1 + e^0.2); log(1 + e^0.2) = 0.2 + log(1 + e^-0.2)
    #   = log(1 + e^-0.2) + 0.1 * 0.2 = 0.598139 + 0.02 = 0.618139
    loss_ls, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=0.1)
    assert loss_ls.item() == pytest.approx(0.618139, abs=1e-6)
    # dloss/dpi_c = beta * (-(1 - ls) sigmoid(-beta h) + ls sigmoid(beta h)). ls = 0.5 makes the loss even
    # in h, so it pulls h back to 0: beta / 2 * (sigmoid(0.2) - sigmoid(-0.2)) = 0.05 * tanh(0.1) > 0
    loss_half, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=0.5)
    loss_half.sum().backward()
    assert pc.grad.item() == pytest.approx(0.05 * math.tanh(0.1))
    assert pc.grad.item() > 0


# ---- GAE ------------------------------------------------------------------------------------------

def naive_gae(rewards, values, mask, gamma, lam):
    """One row at a time, plain Python floats over the row's valid prefix."""
    B, T = rewards.shape
    adv, ret = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(mask[b].sum())
        r, v = rewards[b, :n].tolist(), values[b, :n].tolist()
        a = 0.0
        for t in reversed(range(n)):
            nv = v[t + 1] if t + 1 < n else 0.0
            a = r[t] + gamma * nv - v[t] + gamma * lam * a
            adv[b, t] = a
            ret[b, t] = a + v[t]
    return adv, ret


def test_gae_gamma1_lam1_is_reward_to_go_minus_value():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    # lam = gamma = 1: the V_{t+1} terms telescope, A_t = sum_{k>=t} r_k - V_t, and returns = reward-to-go
    rtg = r.flip(1).cumsum(1).flip(1)
    assert torch.allclose(adv, rtg - v, atol=1e-5)
    assert torch.allclose(ret, rtg, atol=1e-5)


def test_gae_three_tokens_by_hand():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma = 0.9, lam = 0.8 (gamma * lam = 0.72); V_3 = 0 (end)
    # delta_2 = 1 + 0.9 * 0   - 0.7 = 0.3        A_2 = 0.3
    # delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03       A_1 = 0.03 + 0.72 * 0.3   = 0.246
    # delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04       A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    r, v = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(r, v, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3])
    assert ret[0].tolist() == pytest.approx([0.71712, 0.846, 1.0])


def test_gae_rows_of_different_lengths_do_not_leak():
    # row 1 is the 3-token case above, cut to 2 tokens, with junk (100) in its padding
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 100.0, 100.0]])
    v = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.5, 0.6, 100.0, 100.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3, 0.0])
    # row 1: delta_1 = 1 + 0 - 0.6 = 0.4 = A_1 (V_2 is past the end, counted as 0)
    #        delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04, A_0 = 0.04 + 0.72 * 0.4 = 0.328
    assert adv[1].tolist() == pytest.approx([0.328, 0.4, 0.0, 0.0])
    assert ret[1].tolist() == pytest.approx([0.828, 1.0, 0.0, 0.0])
    # padding content is irrelevant
    r2, v2 = r.clone(), v.clone()
    r2[~mask], v2[~mask] = -7.0, 3.0
    adv2, ret2 = gae(r2, v2, mask, gamma=0.9, lam=0.8)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_matches_naive_loop_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    B, T = 7, 12
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lens = torch.tensor([12, 1, 0, 5, 11, 3, 8])
    mask = torch.arange(T).unsqueeze(0) < lens.unsqueeze(1)
    for gamma, lam in [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)]:
        adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
        nadv, nret = naive_gae(r, v, mask, gamma, lam)
        assert torch.allclose(adv.double(), nadv, atol=1e-5)
        assert torch.allclose(ret.double(), nret, atol=1e-5)
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_masked_whiten():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 9, generator=g) * 5 + 3
    mask = torch.arange(9).unsqueeze(0) < torch.tensor([[9], [2], [6], [0]])
    w = masked_whiten(x, mask)
    on = w[mask]
    assert on.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert on.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)
    assert (w[~mask] == 0).all()
    # by hand: [1, 2, 3] on the mask, 100 off it -> mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[True, True, True, False]])
    assert masked_whiten(x, m)[0].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    # shift_mean=False adds the mean back: (x - 2) / 1 + 2 = x on the mask
    assert masked_whiten(x, m, shift_mean=False)[0].tolist() == pytest.approx([1.0, 2.0, 3.0, 0.0], abs=1e-6)


# ---- value loss, KL controller, token rewards -----------------------------------------------------

def test_clipped_value_loss_by_hand():
    # v_old = 1, clip = 0.2, R = 2
    # v = 1.5: clipped to 1.2; (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> binds: 0.5 * 0.64 = 0.32
    # v = 1.1: inside [0.8, 1.2]; both (1.1-2)^2 = 0.81 -> 0.405
    # v = 0.5: clipped to 0.8; (0.5-2)^2 = 2.25 > (0.8-2)^2 = 1.44 -> unclipped wins: 1.125
    v = torch.tensor([[1.5, 1.1, 0.5]], requires_grad=True)
    old, R = torch.ones(1, 3), torch.full((1, 3), 2.0)
    loss = clipped_value_loss(v, old, R, clip=0.2)
    assert loss.shape == (1, 3)
    assert loss[0].tolist() == pytest.approx([0.32, 0.405, 1.125])
    loss.sum().backward()
    # where clipping binds there is no gradient; elsewhere d/dv 0.5 (v - R)^2 = v - R
    assert v.grad[0].tolist() == pytest.approx([0.0, -0.9, -1.5])


def test_adaptive_kl_controller_by_hand():
    c = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # kl = 6.6: error = 6.6 / 6 - 1 = 0.1; mult = 1 + 0.1 * 256 / 10000 = 1.00256 -> 0.100256
    assert c.update(6.6, n_steps=256) == pytest.approx(0.100256)
    assert c.value == pytest.approx(0.100256)
    # kl = 60: error 9 clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    c = AdaptiveKLController(0.1, 6.0, 10000)
    assert c.update(60.0, 256) == pytest.approx(0.1 * 1.00512)
    # kl = 0: error -1 clipped to -0.2; mult = 0.99488
    c = AdaptiveKLController(0.1, 6.0, 10000)
    assert c.update(0.0, 256) == pytest.approx(0.1 * 0.99488)
    # state survives JSON
    c.update(7.0, 100)
    back = AdaptiveKLController.from_state(json.loads(json.dumps(c.state_dict())))
    assert back.state_dict() == c.state_dict()
    assert back.update(5.0, 64) == c.update(5.0, 64)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_kl_penalised_token_rewards_by_hand():
    score = torch.tensor([1.0, 2.0, 5.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    out = kl_penalised_token_rewards(score, kl, mask, beta=0.5)
    # row 0 (3 tokens): -0.5 * [0.1, 0.2, 0.3] = [-0.05, -0.1, -0.15]; + 1 at t=2 -> 0.85
    # row 1 (1 token):  -0.5 * 0.4 = -0.2; + 2 at t=0 -> 1.8; zero after
    # row 2 (empty):    nothing, its score 5 is dropped
    assert out.tolist()[0] == pytest.approx([-0.05, -0.1, 0.85])
    assert out.tolist()[1] == pytest.approx([1.8, 0.0, 0.0])
    assert out.tolist()[2] == [0.0, 0.0, 0.0]
    # summed over a row: score - beta * sum(kl on the mask)
    assert out.sum(1).tolist() == pytest.approx([1.0 - 0.3, 2.0 - 0.2, 0.0])
