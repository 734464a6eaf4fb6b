"""The RL math with hand-derived values, and the vectorised loss against a naive loop."""

import math

import pytest
import torch

from rlkit.ops import advantages, kl, losses
from rlkit.ops.logprobs import gather_logprobs


def test_gather_logprobs_matches_log_softmax_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    targets = torch.randint(0, 11, (3, 7), generator=g)
    for temp in (1.0, 0.7):
        lp, ent = gather_logprobs(logits, targets, chunk=2, temperature=temp, with_entropy=True)
        ref = torch.log_softmax(logits / temp, -1)
        assert torch.allclose(lp, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6)
        assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # log(pi/pi_ref) = log 2
    assert kl.k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl.k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    # k3 = r - 1 - log r with r = pi_ref/pi = 0.5: 0.5 - 1 + log 2
    assert kl.k3(logp, ref).item() == pytest.approx(-0.5 + math.log(2))
    same = torch.randn(4, 5)
    for f in kl.KL_ESTIMATORS.values():
        assert torch.allclose(f(same, same), torch.zeros(4, 5))
    assert (kl.k3(torch.randn(50), torch.randn(50)) >= 0).all()


def test_k3_is_an_unbiased_kl_estimate():
    # pi = [0.7, 0.3], pi_ref = [0.4, 0.6]: KL = 0.7 ln(7/4) + 0.3 ln(3/6)
    p, q = torch.tensor([0.7, 0.3]), torch.tensor([0.4, 0.6])
    exact = float((p * (p / q).log()).sum())
    for f in (kl.k1, kl.k3):
        expect = float((p * f(p.log(), q.log())).sum())
        assert expect == pytest.approx(exact, abs=1e-6)


R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 3.0, 3.0])
G = torch.tensor([0, 0, 0, 0, 5, 5, 9, 9])


def test_grpo_by_hand():
    a = advantages.grpo(R, G, eps=0.0 + 1e-12)
    # group 0: mean 0.75, unbiased std = sqrt(0.25) = 0.5 -> (1-0.75)/0.5 = 0.5, (0-0.75)/0.5 = -1.5
    assert a[:4].tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5])
    # groups 5 and 9 are degenerate: zero advantage
    assert a[4:].tolist() == pytest.approx([0, 0, 0, 0])


def test_dr_grpo_rloo_reinforce_pp_by_hand():
    assert advantages.dr_grpo(R, G)[:4].tolist() == pytest.approx([0.25, -0.75, 0.25, 0.25])
    # RLOO: row 0 baseline = mean(0, 1, 1) = 2/3 -> 1/3; row 1 baseline = 1 -> -1
    assert advantages.rloo(R, G)[:4].tolist() == pytest.approx([1 / 3, -1.0, 1 / 3, 1 / 3])
    assert advantages.rloo(R, G)[4:].tolist() == pytest.approx([0, 0, 0, 0])
    a = advantages.reinforce_pp(R, G)
    assert float(a.mean()) == pytest.approx(0, abs=1e-6) and float(a.std()) == pytest.approx(1, abs=1e-4)
    # rloo is (n/(n-1)) x dr_grpo within a group
    assert torch.allclose(advantages.rloo(R, G)[:4], advantages.dr_grpo(R, G)[:4] * 4 / 3)


def test_degenerate_groups_are_counted():
    mask, n_degen, n_single, n_groups = advantages.degenerate_groups(R, G)
    assert mask.tolist() == [False] * 4 + [True] * 4 and (n_degen, n_single, n_groups) == (2, 0, 3)
    # a group of one is degenerate (nothing to compare with) and counted as a singleton
    c = advantages.degenerate_groups(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 0, 7]))
    assert c.degenerate_mask.tolist() == [False, False, True] and (c.degenerate, c.singletons, c.groups) == (1, 1, 2)


def test_clipped_surrogate_by_hand():
    # ratio = e^0.5 = 1.6487 > 1.28 with A = +1: clipped to 1.28 -> loss -1.28, counted as clipped
    # ratio = e^-0.5 = 0.6065 < 0.8 with A = -1: clipped to 0.8 -> loss max(0.6065, 0.8) = 0.8
    logp = torch.tensor([[0.5, -0.5]])
    old = torch.zeros(1, 2)
    loss, clipped, ratio, _ = losses.clipped_surrogate(logp, old, torch.tensor([[1.0, -1.0]]), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([-1.28, 0.8])
    assert clipped.tolist() == [[True, True]]
    # inside the range nothing is clipped: loss = -A * ratio
    loss, clipped, _, _ = losses.clipped_surrogate(torch.tensor([[0.1]]), torch.zeros(1, 1), torch.tensor([2.0]))
    assert loss.item() == pytest.approx(-2 * math.exp(0.1)) and not clipped.any()
    # A > 0 with ratio below 1 - clip_low is not clipped (pessimistic bound keeps the gradient)
    loss, clipped, _, _ = losses.clipped_surrogate(torch.tensor([[-1.0]]), torch.zeros(1, 1), torch.tensor([1.0]))
    assert loss.item() == pytest.approx(-math.exp(-1)) and not clipped.any()


def test_aggregations_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert losses.token_mean(x, m).item() == pytest.approx(10 / 4)
    assert losses.seq_mean_token_mean(x, m).item() == pytest.approx((2 + 4) / 2)
    assert losses.seq_mean_token_sum_norm(x, m, 8).item() == pytest.approx(10 / (2 * 8))


def test_vectorised_grpo_loss_matches_a_naive_per_sequence_loop():
    g = torch.Generator().manual_seed(1)
    B, T = 6, 9
    logp, old = torch.randn(B, T, generator=g) * 0.3 - 1, torch.randn(B, T, generator=g) * 0.3 - 1
    lengths = [9, 3, 5, 1, 7, 2]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = advantages.grpo(rewards, groups)
    loss_mat, _, _, _ = losses.clipped_surrogate(logp, old, adv)
    vec = losses.seq_mean_token_mean(loss_mat, mask)
    # naive: per group mean/std, per sequence per token PPO clip, mean over tokens then sequences
    naive_seq = []
    for b in range(B):
        members = [i for i in range(B) if groups[i] == groups[b]]
        rs = [float(rewards[i]) for i in members]
        mu = sum(rs) / len(rs)
        sd = math.sqrt(sum((r - mu) ** 2 for r in rs) / (len(rs) - 1))
        a = (float(rewards[b]) - mu) / (sd + 1e-6)
        toks = []
        for t in range(lengths[b]):
            r = math.exp(float(logp[b, t]) - float(old[b, t]))
            toks.append(max(-a * r, -a * min(max(r, 0.8), 1.28)))
        naive_seq.append(sum(toks) / len(toks))
    assert vec.item() == pytest.approx(sum(naive_seq) / B, rel=1e-5)


def test_gspo_sequence_ratio_and_clip_by_hand():
    """GSPO (rlkit.algorithms.gspo): one ratio per sequence, the geometric mean of its token ratios, clipped
    as a whole at GSPO's 1 - 3e-4 .. 1 + 4e-4, loss averaged per sequence then over sequences."""
    from rlkit import algorithms
    from rlkit.algorithms.gspo import sequence_log_ratio

    d = algorithms.defaults("gspo")
    assert (d.clip_low, d.clip_high, d.loss_agg, d.beta) == (3e-4, 4e-4, "seq-mean-token-mean", 0.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[0.3, 0.1, -100.0], [-0.2, 0.0, -0.1], [1e-4, -1e-4, -100.0]], requires_grad=True)
    old = torch.zeros(3, 3)  # log-ratio = logp on the mask; -100 at the padding never counts
    adv = torch.tensor([1.0, -1.0, 2.0])
    tl = losses.policy_token_loss(logp, old, adv, mask, clip_low=d.clip_low, clip_high=d.clip_high, dual_clip=3.0,
                                  log_ratio=sequence_log_ratio)
    # row 0: mean log-ratio (0.3 + 0.1) / 2 = 0.2, so s = e^0.2 = 1.2214 at both tokens (token ratios e^0.3 and
    #   e^0.1 would get two different clip decisions). A = +1 and s > 1.0004: clipped, loss -1.0004 per token.
    # row 1: mean (-0.2 + 0 - 0.1) / 3 = -0.1, s = e^-0.1 = 0.9048; A = -1 and s < 0.9997: loss
    #   max(s, 0.9997) = 0.9997 per token, clipped (the dual clip's cap -3A = 3 is far above).
    # row 2: mean (1e-4 - 1e-4) / 2 = 0, s = 1, inside the range: loss -A * s = -2 per token, unclipped.
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    assert tl.ratio[mask].tolist() == pytest.approx([s0, s0, s1, s1, s1, 1.0, 1.0], rel=1e-6)
    assert torch.allclose(tl.loss, torch.tensor([[-1.0004, -1.0004, 0], [0.9997] * 3, [-2.0, -2.0, 0]]), rtol=1e-6)
    assert tl.clipped.tolist() == [[True, True, False], [True, True, True], [False, False, False]]
    total = losses.AGGREGATIONS[d.loss_agg](tl.loss, mask)
    assert total.item() == pytest.approx((-1.0004 + 0.9997 - 2.0) / 3, rel=1e-6)  # -0.6669
    total.backward()
    # clipped rows get no gradient; row 2's tokens d/dlogp_t [(1/3) * (1/2) * (-A * s)] = (1/6) * (-2) = -1/3
    assert torch.allclose(logp.grad, torch.tensor([[0, 0, 0], [0, 0, 0], [-1 / 3, -1 / 3, 0]]), atol=1e-6)


def test_gspo_token_form_has_the_sequence_objectives_gradient():
    """GSPO-token with sequence-mean aggregation equals the paper's sequence-level objective
    mean_i -A_i * s_i(theta), s_i = exp(mean_t(logp - old)), in value and gradient (no clip binding)."""
    from rlkit.algorithms.gspo import sequence_log_ratio

    g = torch.Generator().manual_seed(3)
    B, T, lengths = 4, 6, [6, 2, 4, 1]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    base, old = torch.randn(B, T, generator=g) * 0.2 - 1, torch.randn(B, T, generator=g) * 0.2 - 1
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    a = base.clone().requires_grad_()
    tl = losses.policy_token_loss(a, old, adv, mask, clip_low=10.0, clip_high=10.0, log_ratio=sequence_log_ratio)
    losses.seq_mean_token_mean(tl.loss, mask).backward()
    b_ = base.clone().requires_grad_()
    naive = sum(-adv[i] * torch.exp((b_[i, :n] - old[i, :n]).mean()) for i, n in enumerate(lengths)) / B
    naive.backward()
    assert losses.seq_mean_token_mean(tl.loss, mask).item() == pytest.approx(naive.item(), rel=1e-6)
    assert torch.allclose(a.grad, b_.grad, atol=1e-7)


def test_chunked_scoring_equals_the_training_path():
    """Without grad the output head runs 32 positions at a time; values must not change."""
    from rlkit.ops.logprobs import completion_logprobs, pack_sequences, padded
    from rlkit.tiny import TinyConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(TinyConfig(layers=1, hidden=32, heads=2, intermediate=64), tok, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (3, 9)]
    comps = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (70, 5)]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    lp_grad, ent_grad = completion_logprobs(model, padded(ids, attn, start), 0.9, with_entropy=True)
    with torch.no_grad():
        lp, ent = completion_logprobs(model, padded(ids, attn, start), 0.9, with_entropy=True)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits / 0.9, -1)
    assert torch.allclose(lp_grad.detach()[mask], lp[mask], atol=1e-5)
    assert torch.allclose(ent_grad[mask], ent[mask], atol=1e-5)
    for b, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        naive = full[b, len(p) - 1 : len(p) - 1 + len(c)].gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(lp[b, : len(c)], naive, atol=1e-5)


def test_truncated_is_weights_by_hand():
    from rlkit.ops.losses import truncated_is_weights

    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    eng = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)]])
    w = truncated_is_weights(old, eng, cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 3.0]]))  # 0.5/0.25, 0.2/0.4, min(9, 3)
    assert not w.requires_grad
