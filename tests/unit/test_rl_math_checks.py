"""The RL-math defects an independent check found (issue 13), each pinned with hand-derived numbers:
padding that reached an exponential, the KL estimator whose gradient is the reverse KL's, the missing
dual clip, PPO's per-minibatch Dr. GRPO normaliser, and three edge cases decided and documented."""

import contextlib
import math

import pytest
import torch

from rlkit.algorithms.config import RLConfig, resolve
from rlkit.errors import RlkitError
from rlkit.ops import advantages, kl, losses
from rlkit.ops.gae import masked_whiten

# ---------------------------------------------------------------- 1. padding never reaches an exponential


def test_a_pad_token_logprob_of_minus_100_keeps_the_loss_and_its_gradient_finite():
    # Row 0 has 2 real tokens, row 1 has 4. At row 0's two padded positions the policy's log-prob of the
    # pad token is -100 and the reference is padded with 0: k3 there would be e^100 - 101 = inf in fp32
    # (above ~88.7), and inf x 0 (a multiplied mask) is NaN.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logp = torch.tensor([[-0.5, -1.0, -100.0, -100.0], [-0.2, -0.3, -0.4, -0.5]], requires_grad=True)
    ref = torch.tensor([[-0.7, -0.9, 0.0, 0.0], [-0.1, -0.6, -0.4, -0.2]])
    old = logp.detach().clone()
    adv = torch.tensor([1.0, -1.0])
    assert torch.isinf(torch.exp(ref[0, 2] - logp[0, 2].detach()))  # what the old multiply-mask code computed
    for est in kl.KL_ESTIMATORS:
        tl = losses.policy_token_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                                      ref_logp=ref, kl_estimator=est, kl_coef=0.1)
        loss = losses.token_mean(tl.loss, mask)
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), est
        assert (tl.loss[~mask] == 0).all() and (g[~mask] == 0).all()
        # the padded row equals the same row without padding: ratio 1, so -A + 0.1 * KL per real token
        row0 = -1.0 + 0.1 * kl.KL_ESTIMATORS[est](logp[0, :2].detach(), ref[0, :2])
        assert tl.loss[0, :2].detach().tolist() == pytest.approx(row0.tolist(), abs=1e-6)
    # the KL metric path selects too, and the log-ratio is clamped before exp (verl's +-20)
    k = kl.kl_per_token("k3", logp.detach(), ref, mask)
    assert torch.isfinite(k).all() and (k[~mask] == 0).all()
    big = kl.k3(torch.tensor([-100.0]), torch.tensor([0.0])).item()  # d clamped to 20: e^20 - 21
    assert big == pytest.approx(math.exp(20) - 21, rel=1e-6) and math.isfinite(big)


def test_train_on_batch_survives_padding_at_a_low_sampling_temperature(sft_dir):
    """Through the real trainer: at temperature 0.01 the pad token's log-prob at padded positions would be in
    the hundreds below 0, which made k3 in the loss inf x 0 = NaN ("non-finite loss ... lower --lr"); the
    padded positions are never scored now (0 there), with or without packing."""
    from rlkit.algorithms.inputs import RLBatch
    from rlkit.algorithms.trainer import Trainer
    from rlkit.io import checkpoints
    from rlkit.ops.logprobs import completion_logprobs, pack_sequences, padded
    from rlkit.training import TrainOptions

    model, tok = checkpoints.load_policy(sft_dir)
    prompts = [tok.encode("12+7=", add_special_tokens=False)] * 4
    comps = [tok.encode(s, add_special_tokens=False) for s in ("19", "1", "190", "20")]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    temp = 0.01
    with torch.no_grad():
        lp_all, _ = completion_logprobs(model, padded(ids, attn, start), temperature=temp)
    assert lp_all[~mask].abs().max() == 0 and lp_all[mask].min() < -1  # padding is never scored
    old = torch.where(mask, lp_all, 0)
    batch = RLBatch(ids, attn, targets, mask, start, old, old - 0.05 * mask,
                    torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    cfg = RLConfig(beta=0.1, kl_in="loss", kl_estimator="k3", minibatch_size=4, epochs=1, lr=1e-4)
    for packing in (True, False):
        m = Trainer(model, cfg, train=TrainOptions(packing=packing)).train(batch, temperature=temp)
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["optimizer_steps"] == 1


# ---------------------------------------------------------------- 2. which KL estimator pulls where

# Three actions, each a one-token response: pi_ref = [0.5, 0.3, 0.2], rewards [5, 2, 1], beta = 1.
REF = torch.tensor([0.5, 0.3, 0.2])
REW = torch.tensor([5.0, 2.0, 1.0])
# KL(pi || pi_ref)-regularised optimum: pi* ~ pi_ref * exp(r / beta)
FORWARD_OPT = (REF * REW.exp()) / (REF * REW.exp()).sum()
# KL(pi_ref || pi)-regularised optimum: stationary where pi_j (beta + rbar - r_j) = beta * ref_j
REVERSE_OPT = torch.tensor([0.8723, 0.0840, 0.0437])


def test_the_two_optima_by_hand():
    assert FORWARD_OPT.tolist() == pytest.approx([0.964, 0.029, 0.007], abs=6e-4)
    rbar = float((REVERSE_OPT * REW).sum())
    assert (REF / (1 + rbar - REW)).tolist() == pytest.approx(REVERSE_OPT.tolist(), abs=5e-4)


def _expected_grad(est: str, theta: torch.Tensor) -> torch.Tensor:
    """Exact E_{x~pi}[grad est(x)] of the estimator as a loss term (samples not differentiated)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    value = (logp.detach().exp() * kl.KL_ESTIMATORS[est](logp, REF.log())).sum()
    return torch.autograd.grad(value, theta)[0]


def test_expected_gradients_of_the_estimators_in_the_loss():
    theta = torch.tensor([0.3, -0.2, 0.9])
    th = theta.clone().requires_grad_(True)
    lp = torch.log_softmax(th, 0)
    forward_kl_grad = torch.autograd.grad((lp.exp() * (lp - REF.log())).sum(), th)[0]
    th = theta.clone().requires_grad_(True)
    reverse_kl_grad = torch.autograd.grad((REF * (REF.log() - torch.log_softmax(th, 0))).sum(), th)[0]
    assert torch.allclose(_expected_grad("k1", theta), torch.zeros(3), atol=1e-7)  # E_pi[grad log pi] = 0
    assert torch.allclose(_expected_grad("k2", theta), forward_kl_grad, atol=1e-6)
    assert torch.allclose(_expected_grad("k3+", theta), forward_kl_grad, atol=1e-6)
    assert torch.allclose(_expected_grad("k3", theta), reverse_kl_grad, atol=1e-6)
    # k3+ reports k3's value: the same unbiased estimate of KL(pi || pi_ref)
    p = torch.softmax(theta, 0)
    exact = float((p * (p / REF).log()).sum())
    assert float((p * kl.k3_plus(p.log(), REF.log())).sum()) == pytest.approx(exact, abs=1e-6)


def _train_three_logits(est: str, kl_in: str, steps: int = 600) -> torch.Tensor:
    """A few hundred steps of rlkit's own per-token loss on a 3-logit policy, in exact expectation."""
    theta = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=1.0)
    mask = torch.ones(3, 1, dtype=torch.bool)
    ref = REF.log().unsqueeze(1)
    for _ in range(steps):
        logp = torch.log_softmax(theta, 0).unsqueeze(1)  # (3, 1)
        old = logp.detach()
        rewards = REW.clone()
        if kl_in == "reward":  # the trainer's reward path: r - beta * sum_t kl_t(pi_old, pi_ref)
            rewards = rewards - 1.0 * kl.kl_per_token(est, old, ref, mask).sum(1)
        tl = losses.policy_token_loss(logp, old, rewards, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                                      ref_logp=ref, kl_estimator=est, kl_coef=1.0 if kl_in == "loss" else 0.0)
        loss = (old.exp().squeeze(1) * tl.loss[:, 0]).sum()  # E_{x ~ pi_old}
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.softmax(theta.detach(), 0)


@pytest.mark.parametrize(("est", "kl_in", "target"), [
    ("k1", "reward", FORWARD_OPT), ("k3+", "loss", FORWARD_OPT), ("k2", "loss", FORWARD_OPT),
    ("k3", "loss", REVERSE_OPT),
])
def test_kl_estimators_reach_their_optimum_under_rlkits_loss(est, kl_in, target):
    assert _train_three_logits(est, kl_in).tolist() == pytest.approx(target.tolist(), abs=5e-4)


def test_k1_in_the_loss_regularises_nothing_and_is_refused():
    # it drifts to the unregularised optimum: all mass on the best action
    assert _train_three_logits("k1", "loss", steps=300)[0] > 0.999
    with pytest.raises(RlkitError, match="zero expected gradient"):
        RLConfig(kl_in="loss", kl_estimator="k1", beta=0.01).check()
    RLConfig(kl_in="loss", kl_estimator="k1", beta=0.0).check()  # no KL term at all: nothing to refuse
    RLConfig(kl_in="reward", kl_estimator="k1", beta=0.01).check()
    assert resolve(RLConfig()).kl_estimator == "k3+"


# ---------------------------------------------------------------- 3. dual clip


def test_dual_clip_caps_negative_advantages_by_hand():
    ratio4 = torch.tensor([[math.log(4.0)]])
    zero = torch.zeros(1, 1)
    # A = -1, ratio 4: max(4, -(-1) * 1.28) = 4, unbounded in the ratio; C = 3 caps it at -C*A = 3
    loss, _, _, dual = losses.clipped_surrogate(ratio4, zero, torch.tensor([-1.0]), dual_clip=None)
    assert loss.item() == pytest.approx(4.0) and not dual.any()
    logp = ratio4.clone().requires_grad_(True)
    loss, _, _, dual = losses.clipped_surrogate(logp, zero, torch.tensor([-1.0]), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and dual.all()
    assert torch.autograd.grad(loss.sum(), logp)[0].item() == 0.0  # the cap is flat
    # A = -2, ratio 2 < C: not capped, loss = -A * r = 4 with gradient -A * r = 4 in log space
    logp = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, _, _, dual = losses.clipped_surrogate(logp, zero, torch.tensor([-2.0]), dual_clip=3.0)
    assert loss.item() == pytest.approx(4.0) and not dual.any()
    assert torch.autograd.grad(loss.sum(), logp)[0].item() == pytest.approx(4.0)
    # A = +1, ratio 4: the ordinary clip, -1.28; the dual clip never touches positive advantages
    loss, clipped, _, dual = losses.clipped_surrogate(ratio4, zero, torch.tensor([1.0]), dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.28) and clipped.all() and not dual.any()
    # A = -1, ratio 0.5: the lower clip, max(0.5, 0.8) = 0.8, far below the cap
    loss, _, _, dual = losses.clipped_surrogate(torch.tensor([[math.log(0.5)]]), zero, torch.tensor([-1.0]),
                                                dual_clip=3.0)
    assert loss.item() == pytest.approx(0.8) and not dual.any()


def test_dual_clip_default_and_validation():
    assert RLConfig().dual_clip == 3.0  # verl's clip_ratio_c
    for bad in (1.0, 0.5):
        with pytest.raises(RlkitError, match="--dual-clip"):
            RLConfig(dual_clip=bad).check()
    RLConfig(dual_clip=None).check()


# ---------------------------------------------------------------- 4. Dr. GRPO's constant in PPO


def test_seq_mean_token_sum_norm_needs_its_constant():
    x, m = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="constant normaliser"):
        losses.seq_mean_token_sum_norm(x, m)
    assert losses.seq_mean_token_sum_norm(x, m, 16).item() == pytest.approx(6 / (2 * 16))


def test_dr_grpos_constant_is_the_most_tokens_a_row_may_sample():
    """docs/algorithms.md#dr-grpo's L, from the rollout's manifest: --max-new-tokens; under --env x --max-turns, at
    most --max-total-tokens when the rollout set it; a table recording no --max-new-tokens: its completion width."""
    from types import SimpleNamespace

    from rlkit.algorithms.shaping import length_norm as _length_norm

    batch = SimpleNamespace(targets=torch.zeros(3, 7))
    env = {"max_new_tokens": 16, "env": "calc", "max_turns": 4}
    assert _length_norm({"max_new_tokens": 16, "max_turns": 4}, batch) == 16  # single-turn: turns do not count
    assert _length_norm(env, batch) == 64
    assert _length_norm({**env, "max_total_tokens": 40}, batch) == 40
    assert _length_norm({**env, "max_total_tokens": 100}, batch) == 64
    assert _length_norm({}, batch) == 7


class _Steps:
    """Records the loss of each optimizer step (the progress-bar interface the trainers report to)."""

    def __init__(self):
        self.losses = []

    def advance(self, n, loss=None):  # noqa: ARG002
        self.losses.append(loss)


def test_ppo_divides_every_minibatch_by_max_new_tokens(sft_dir):
    """Two minibatches of different lengths (2 and 6 tokens): each loss is its token sum over
    (2 rows x 16), the rollout's max_new_tokens, not over its own longest completion."""
    from rlkit.algorithms.inputs import RLBatch, recompute_logprobs
    from rlkit.algorithms.trainer import Trainer
    from rlkit.io import checkpoints
    from rlkit.ops.gae import gae, kl_penalised_token_rewards
    from rlkit.ops.logprobs import pack_sequences

    model, tok = checkpoints.load_policy(sft_dir)
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("1+2=", "3+4=", "5+6=", "7+8=")]
    comps = [[5, 6], [7, 8], [5, 6, 7, 8, 9, 10], [10, 9, 8, 7, 6, 5]]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    with torch.no_grad():
        old = recompute_logprobs(model, RLBatch(
            ids, attn, targets, mask, start, torch.zeros(mask.shape), None, torch.zeros(4), torch.arange(4)), 1.0, 4)
    rewards = torch.tensor([1.0, -1.0, 2.0, 0.5])
    batch = RLBatch(ids, attn, targets, mask, start, old, None, rewards, torch.arange(4))
    cfg = RLConfig(algo="ppo", beta=0.0, kl_in="reward", loss_agg="seq-mean-token-sum-norm", minibatch_size=2,
                   epochs=1, lr=1e-12, critic_lr=1e-12)
    trainer = Trainer(model, cfg, tokenizer=tok)
    trainer.load(sft_dir)  # the critic, initialised from the policy
    steps = _Steps()
    trainer.train(batch, recompute=True, length_norm=16.0, progress=lambda n: contextlib.nullcontext(steps))
    # the fresh value head is 0, so advantages are GAE of the rewards alone, whitened over the batch
    adv, _ = gae(kl_penalised_token_rewards(rewards, torch.zeros(mask.shape), mask, 0.0), torch.zeros(mask.shape),
                 mask, cfg.gamma, cfg.lam)
    adv = masked_whiten(adv, mask)
    row_sums = [-float(adv[b][mask[b]].sum()) for b in range(4)]  # ratio 1 (lr ~0): loss = -A per token
    # whichever rows the shuffle pairs, each minibatch's loss is (its rows' sum) / (2 * 16)
    pairs = {frozenset((i, j)): (row_sums[i] + row_sums[j]) / (2 * 16) for i in range(4) for j in range(i + 1, 4)}
    assert len(steps.losses) == 2
    for got in steps.losses:
        assert any(got == pytest.approx(v, abs=1e-5) for v in pairs.values()), (got, pairs)
    assert sum(steps.losses) == pytest.approx(sum(row_sums) / 32, abs=1e-5)


# ---------------------------------------------------------------- 5. edge cases, decided


def test_seq_mean_token_mean_leaves_empty_rows_out():
    x = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # row means 2 and 4; the empty row is not a sequence to average over: (2 + 4) / 2, not / 3 (verl's choice)
    assert losses.seq_mean_token_mean(x, m).item() == pytest.approx(3.0)
    assert losses.AGG_WEIGHTS["seq-mean-token-mean"](m).item() == 2
    # data-parallel shares still add up: the weights of two halves sum to the whole's
    assert (losses.AGG_WEIGHTS["seq-mean-token-mean"](m[:1]) + losses.AGG_WEIGHTS["seq-mean-token-mean"](m[1:])) == 2
    assert losses.seq_mean_token_mean(x, torch.zeros_like(m)).item() == 0.0


def test_reinforce_pp_whitens_over_tokens_by_hand():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 1])
    # tokens [1, 1, 1, 0]: mean 0.75, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25 -> std 0.5
    assert advantages.reinforce_pp(r, g, lengths=torch.tensor([3, 1])).tolist() == pytest.approx([0.5, -1.5], abs=1e-5)
    # over sequences (lengths ignored) it would be +-1/sqrt(2)
    assert advantages.reinforce_pp(r, g).tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)
    # equals masked_whiten of the rewards broadcast over each row's tokens
    gen = torch.Generator().manual_seed(3)
    rew = torch.randn(6, generator=gen)
    lengths = torch.tensor([1, 5, 2, 0, 7, 3])
    mask = torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)
    tok = masked_whiten(rew.unsqueeze(1).expand(6, 7).double(), mask)
    a = advantages.reinforce_pp(rew, torch.arange(6), lengths=lengths)
    for b in range(6):
        if lengths[b]:
            assert tok[b, 0].item() == pytest.approx(a[b].item(), abs=1e-5)


def test_a_group_of_one_gets_advantage_zero():
    r, g = torch.tensor([1.0, 0.0, 0.7]), torch.tensor([0, 0, 3])
    for name in advantages.GROUP_BASELINE:
        a = advantages.ADVANTAGES[name](r, g)
        assert a[2].item() == 0.0 and a[0].item() > 0 > a[1].item(), name
    assert advantages.degenerate_groups(r, g).singletons == 1
