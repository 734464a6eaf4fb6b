"""The one training engine (`rlkit.training.engine`) and its layouts (`rlkit.ops.packing`), checked on tiny models
built from configs, in fp32:

- packed sequences (rows of several sequences with per-sequence position ids, or one varlen row) give the
  log-probs and reward-model scores that padded rows give, for Llama and Qwen2 with sdpa and eager attention;
  the layout places every token once and restarts positions per sequence;
- micro-batches (--micro-batch-size, even and uneven; --micro-batch-tokens) and --no-packing leave the
  accumulated GRADIENTS of one optimizer step as they are without them, through the real `Trainer` for every
  --algo and every --loss-agg (PPO's critic included), and through an `Engine` step for sft's cross-entropy
  and train-rm's Bradley-Terry loss. Gradients, not weights: AdamW's first step moves every weight by about
  lr whatever its gradient, so the weights after one step cannot tell two gradients apart;
- the log-prob backward writes its gradient in place: one logits tensor less at the peak than autograd over
  chunks (rlkit's previous fp32 path), the same gradients.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlkit import algorithms
from rlkit.algorithms.config import RLConfig
from rlkit.ops.losses import AGGREGATIONS
from rlkit.ops.packing import best_fit_rows, layout
from rlkit.training import Optim, TrainOptions

# sequence lengths from 1 to 200 tokens; a length-1 sequence is a prompt alone (no completion token)
LENGTHS = [1, 2, 5, 17, 60, 123, 200, 3, 41]


def _sequences(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    return tokens, [max(1, n // 3) for n in LENGTHS]


# every layout the engine and the scorers use: padded, packed rows as long as the longest sequence (sdpa/eager),
# one varlen row (FlashAttention's), and rows of 256 positions holding several sequences each
LAYOUTS = {"padded": dict(packed=False), "rows": dict(packed=True, capacity=0), "one-row": dict(packed=True, capacity=None),
           "capacity-256": dict(packed=True, capacity=256)}


def _config(arch: str, attn: str, **kw):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, attn_implementation=attn, pad_token_id=0, **kw)


# ---------------------------------------------------------------- 1. packed == padded


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_packed_logprobs_equal_padded_logprobs(arch, attn):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from rlkit.ops.logprobs import completion_logprobs

    torch.manual_seed(0)
    model = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[arch](_config(arch, attn)).eval()
    tokens, plens = _sequences(101)
    got = {}
    with torch.no_grad():
        for name, kw in LAYOUTS.items():
            seqs = layout(tokens, plens, **kw)
            got[name], _ = completion_logprobs(model, seqs)
            if name == "capacity-256":  # the case it is there for: a row holding three or more sequences
                assert seqs.input_ids.shape[0] < len(tokens) - 2, seqs.input_ids.shape
        want = got.pop("padded")
        assert want.shape == (len(LENGTHS), max(n - p for n, p in zip(LENGTHS, plens, strict=True)))
        assert (want != 0).sum() == sum(n - p for n, p in zip(LENGTHS, plens, strict=True))  # every completion token
        for name, lp in got.items():
            torch.testing.assert_close(lp, want, rtol=0, atol=1e-5, msg=name)
        # the comparison can fail: positions running on across a packed row's sequences (no restart) change them
        seqs = layout(tokens, plens, packed=True, capacity=256)
        wrong = seqs._replace(position_ids=torch.arange(seqs.input_ids.shape[1]).expand_as(seqs.input_ids))
        assert (completion_logprobs(model, wrong)[0] - want).abs().max() > 1e-3


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("llama", "eager")])
def test_packed_reward_scores_equal_padded_scores(arch, attn):
    """A reward model's score (the head at each sequence's last token, `Seqs.last`) packed or padded."""
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification

    from rlkit.scorers.reward_model import forward_scores, seq_scores

    torch.manual_seed(1)
    cls = {"llama": LlamaForSequenceClassification, "qwen2": Qwen2ForSequenceClassification}[arch]
    model = cls(_config(arch, attn, num_labels=1)).eval()
    tokens, _ = _sequences(101, seed=1)
    with torch.no_grad():
        want = forward_scores(model, tokens, 0, packed=False)
        torch.testing.assert_close(forward_scores(model, tokens, 0, packed=True), want, rtol=0, atol=1e-5)
        for name, kw in LAYOUTS.items():
            torch.testing.assert_close(seq_scores(model, layout(tokens, [len(t) for t in tokens], **kw)), want,
                                       rtol=0, atol=1e-5, msg=name)
        # each score is the sequence's own: a sequence scored alone gives it too
        torch.testing.assert_close(forward_scores(model, [tokens[6]], 0), want[6:7], rtol=0, atol=1e-5)
    assert want.std() > 1e-3  # not one constant


def test_best_fit_rows():
    assert best_fit_rows([5, 3, 2, 4], 6) == [[0], [3, 2], [1]]  # the docstring's example
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        lengths = torch.randint(1, 60, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        cap = int(torch.randint(1, 130, (1,), generator=g))
        rows = best_fit_rows(lengths, cap)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # each sequence once
        for r in rows:  # within capacity, or a longer sequence alone
            assert sum(lengths[i] for i in r) <= cap or len(r) == 1
        assert best_fit_rows(lengths, cap) == rows  # deterministic


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_places_every_token_once(name):
    tokens, plens = _sequences(101, seed=3)
    kw = LAYOUTS[name]
    s = layout(tokens, plens, pad_id=0, **kw)
    R, W = s.input_ids.shape
    flat, taken = s.input_ids.flatten(), torch.zeros(R * W, dtype=torch.int)
    pos = s.position_ids.flatten() if s.position_ids is not None else None
    for i, (t, p) in enumerate(zip(tokens, plens, strict=True)):
        n, end = len(t), int(s.last[i]) + 1
        assert end - n >= 0 and (end - 1) // W == (end - n) // W  # one sequence, one row
        assert flat[end - n : end].tolist() == t
        taken[end - n : end] += 1
        if pos is not None:  # positions restart at every sequence
            assert pos[end - n : end].tolist() == list(range(n))
        k = s.seq == i  # its scored tokens: each predicted by the position before it
        assert s.col[k].tolist() == list(range(n - p)) and s.targets[k].tolist() == t[p:]
        assert s.pos[k].tolist() == list(range(end - n + p - 1, end - 1))
    assert taken.max() == 1 and int(taken.sum()) == sum(LENGTHS) == s.tokens  # every token once
    assert s.positions == R * W and s.padding_fraction == pytest.approx(1 - sum(LENGTHS) / (R * W))
    assert (flat[taken == 0] == 0).all()  # the rest is padding
    if kw["packed"]:
        assert s.attn is None and s.completion == max(n - p for n, p in zip(LENGTHS, plens, strict=True))
        assert W == (sum(LENGTHS) if kw["capacity"] is None else max(kw["capacity"], max(LENGTHS)))
    else:
        assert s.position_ids is None and s.attn.sum(1).tolist() == LENGTHS and (R, W) == (len(LENGTHS), max(LENGTHS))
    if name == "one-row":
        assert R == 1 and s.padding_fraction == 0.0


# ---------------------------------------------------------------- 2. micro-batches through the real Trainer


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Llama (rlkit.tiny's architecture, smaller) saved as a checkpoint (PPO's critic starts from it),
    and its tokenizer."""
    from rlkit import tiny
    from rlkit.io import checkpoints, manifests

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.TinyConfig(layers=2, hidden=32, heads=4, intermediate=64), tok, seed=0)
    d = tmp_path_factory.mktemp("engine") / "pol"
    d.mkdir()
    checkpoints.save_model(model, tok, d, manifests.make_manifest("model", "test", {}, {}, step=0))
    return model, tok, d


# one optimizer step of each setting against one forward of the whole step, packed
SETTINGS = {"micro-2": TrainOptions(micro_batch_size=2), "micro-3": TrainOptions(micro_batch_size=3),
            "tokens": None,  # --micro-batch-tokens: set per batch, a few rows per micro-batch
            "no-packing": TrainOptions(packing=False),
            "no-packing-micro-3": TrainOptions(packing=False, micro_batch_size=3)}


def _settings(longest: int) -> dict[str, TrainOptions]:
    return {k: v if v is not None else TrainOptions(micro_batch_tokens=longest + 6) for k, v in SETTINGS.items()}


def _rl_batch(model, tok):
    """8 rollouts in 2 groups of 4, prompts of 2-7 tokens, completions of 0-14 (one empty), pi_old a noisy copy of
    the policy's own log-probs (so ratios are clipped either way), the reference near it, rewards that vary."""
    from rlkit.algorithms.inputs import RLBatch, recompute_logprobs
    from rlkit.ops.logprobs import pack_sequences

    g = torch.Generator().manual_seed(4)
    plens, clens = [3, 6, 2, 5, 4, 7, 2, 3], [5, 0, 12, 3, 9, 1, 14, 7]
    vocab = len(tok)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in plens]
    comps = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in clens]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    zeros = torch.zeros(mask.shape)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch = RLBatch(ids, attn, targets, mask, start, zeros, None, rewards, groups)
    lp = recompute_logprobs(model, batch, 1.0, 8)
    old = (lp - 0.3 * (2 * torch.rand(mask.shape, generator=g) - 1)) * mask
    ref = (old + 0.2 * torch.randn(mask.shape, generator=g)) * mask
    # a teacher's log-probs (on-policy distillation) and per-token rewards (read by ppo; --teacher-coef by all)
    teacher = (old + 0.5 * torch.randn(mask.shape, generator=g)) * mask
    token_rewards = 0.1 * torch.randn(mask.shape, generator=g) * mask
    return batch._replace(old_logp=old, ref_logp=ref, teacher_logp=teacher, token_rewards=token_rewards)


def _pref_batch(tok):
    """6 preference pairs (the last held out) with the reference's summed log-probs."""
    from rlkit.algorithms.inputs import PrefBatch
    from rlkit.ops.logprobs import pack_sequences

    g = torch.Generator().manual_seed(5)
    vocab = len(tok)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (3, 5, 2, 6, 4, 3)]
    chosen = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 11, 3)]
    rejected = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (7, 1, 5, 8, 2, 3)]
    ids, attn, targets, mask, start = pack_sequences(prompts * 2, chosen + rejected, tok.pad_token_id)
    ref = -torch.rand(12, generator=g) * 10 - 5
    return PrefBatch(ids, attn, targets, mask, start, ref, torch.tensor([False] * 5 + [True]))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _update(policy, cfg: RLConfig, batch, train: TrainOptions, naive: bool = False):
    """One `update` step on `batch` (every row, one epoch: one optimizer step) -> (metrics, the policy's gradients,
    the critic's or {}). `naive`: every loss term weighs 1 whatever its share of the step (what plain gradient
    accumulation does): the check that the comparison can fail."""
    from rlkit.algorithms.trainer import Trainer

    model, tok, d = policy
    t = Trainer(copy.deepcopy(model), cfg, tokenizer=tok, train=train)
    if cfg.algo == "ppo":
        t.load(d)  # its critic, from the policy
    if naive:
        prepare = t.algo.prepare

        def prepare_naive(*args, **kwargs):
            plan = prepare(*args, **kwargs)
            plan.weights = {k: (lambda rows: 1.0) for k in plan.weights}
            return plan

        t.algo.prepare = prepare_naive
    m = t.train(batch, temperature=1.0, length_norm=16.0)
    assert m["optimizer_steps"] == 1
    critic = _grads(t.algo.critic.model) if cfg.algo == "ppo" else {}
    return m, _grads(t.model), critic


def _max_rel_diff(got: dict, want: dict) -> float:
    """max |got - want| over every gradient, relative to the largest |want| of that model."""
    assert sorted(got) == sorted(want)
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0
    return max(float((got[k] - want[k]).abs().max()) for k in want) / scale


TOL = 1e-5  # fp32 summation order, relative to the largest gradient


def _same_step(got, want, label: str) -> None:
    (mg, gg, cg), (mw, gw, cw) = got, want
    assert _max_rel_diff(gg, gw) < TOL, (label, _max_rel_diff(gg, gw))
    if cw:
        assert _max_rel_diff(cg, cw) < TOL, (label, "critic", _max_rel_diff(cg, cw))
    for k in ("loss", "value_loss", "grad_norm", "clip_fraction", "ratio_mean", "entropy"):
        if k in mw and mw[k] is not None:
            assert mg[k] == pytest.approx(mw[k], rel=TOL, abs=1e-7), (label, k)


@pytest.mark.parametrize("algo", [a for a in algorithms.names() if a != "dpo"])
def test_micro_batches_and_packing_leave_the_gradients_of_every_policy_gradient_algo(algo, policy):
    model, tok, _ = policy
    batch = _rl_batch(model, tok)
    settings = _settings(int(batch.attn.sum(1).max()))
    for agg in AGGREGATIONS:
        # the teacher's per-token term beside the group advantages (grpo) and in ppo's per-token rewards too
        coef = 0.5 if algo in ("grpo", "ppo") else None
        cfg = RLConfig(algo=algo, loss_agg=agg, beta=0.05, minibatch_size=8, epochs=1, lr=1e-3, grad_clip=1e9,
                       teacher_coef=coef)
        want = _update(policy, cfg, batch, TrainOptions())
        assert max(float(g.abs().max()) for g in want[1].values()) > 1e-4  # a real gradient
        if algo == "ppo":
            assert max(float(g.abs().max()) for g in want[2].values()) > 1e-4 and want[0]["value_loss"] > 0
        for name, train in settings.items():
            _same_step(_update(policy, cfg, batch, train), want, f"{algo} {agg} {name}")
    # the comparison can fail: micro-batches that each weigh as a whole step (plain accumulation) do not pass
    naive = _update(policy, cfg, batch, settings["micro-3"], naive=True)
    assert _max_rel_diff(naive[1], want[1]) > 100 * TOL


def test_micro_batches_and_packing_leave_dpos_gradients(policy):
    _, tok, _ = policy
    batch = _pref_batch(tok)
    cfg = RLConfig(algo="dpo", minibatch_size=5, epochs=1, lr=1e-3, grad_clip=1e9)
    want = _update(policy, cfg, batch, TrainOptions())
    for name, train in _settings(int((batch.attn.sum(1)[:6] + batch.attn.sum(1)[6:]).max())).items():
        got = _update(policy, cfg, batch, train)
        _same_step(got, want, f"dpo {name}")
        for k in ("train_reward_margin", "heldout_logp_chosen"):  # after the step: the same weights
            assert got[0][k] == pytest.approx(want[0][k], rel=1e-4), (name, k)
    naive = _update(policy, cfg, batch, TrainOptions(micro_batch_size=2), naive=True)
    assert _max_rel_diff(naive[1], want[1]) > 100 * TOL


def test_recomputed_pi_old_is_the_same_in_micro_batches(policy):
    """pi_old recomputed by the trainer (forward only, in the engine's micro-batches and layout)."""
    from rlkit.algorithms.inputs import recompute_logprobs
    from rlkit.algorithms.trainer import Trainer

    model, tok, _ = policy
    batch = _rl_batch(model, tok)
    want = recompute_logprobs(model, batch, 0.7, 8)
    for name, train in _settings(int(batch.attn.sum(1).max())).items():
        t = Trainer(copy.deepcopy(model), RLConfig(), tokenizer=tok, train=train)
        got = recompute_logprobs(t.model, batch, 0.7, 8, engine=t)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)


# ---------------------------------------------------------------- 3. sft and train-rm through an Engine step


def _engine_step(model, objective, plan, train: TrainOptions, kind: str = "causal-lm"):
    from rlkit.training.engine import Engine

    e = Engine(copy.deepcopy(model), objective, Optim(lr=1e-3, grad_clip=None), train=train, kind=kind)
    fig = e.step(plan, plan.rows, first=True)
    return fig, _grads(e.model)


def _supervised_same(model, objective, plan, kind: str, longest: int) -> None:
    want_fig, want = _engine_step(model, objective, plan, TrainOptions(), kind)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-4
    for name, train in _settings(longest).items():
        fig, got = _engine_step(model, objective, plan, train, kind)
        assert _max_rel_diff(got, want) < TOL, (name, _max_rel_diff(got, want))
        assert fig.terms["loss"] == pytest.approx(want_fig.terms["loss"], rel=TOL), name
        assert fig.grad_norm == pytest.approx(want_fig.grad_norm, rel=TOL), name
        assert fig.tokens == want_fig.tokens, name
        if not train.packing:
            assert fig.positions > fig.tokens, name  # padded: the padding ran forward too


def test_sft_cross_entropy_micro_batches_and_packing(policy):
    from rlkit.training.supervised import CrossEntropy

    model, tok, _ = policy
    g = torch.Generator().manual_seed(6)
    lengths, plens = [9, 23, 4, 15, 31, 6, 12], [3, 10, 1, 5, 8, 2, 11]  # 1 to 23 completion tokens
    tokens = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in lengths]
    objective = CrossEntropy()
    _supervised_same(model, objective, objective.plan(tokens, plens), "causal-lm", max(lengths))


def test_train_rm_bradley_terry_micro_batches_and_packing():
    from transformers import Qwen2ForSequenceClassification

    from rlkit.training.supervised import BradleyTerry

    torch.manual_seed(7)
    model = Qwen2ForSequenceClassification(_config("qwen2", "sdpa", num_labels=1))
    g = torch.Generator().manual_seed(7)
    chosen = [torch.randint(4, 101, (n,), generator=g).tolist() for n in (5, 17, 3, 26, 9, 12, 40)]
    rejected = [torch.randint(4, 101, (n,), generator=g).tolist() for n in (8, 2, 14, 6, 30, 12, 1)]
    objective = BradleyTerry(margin=0.1)
    plan = objective.plan(chosen, rejected, range(len(chosen)))
    _supervised_same(model, objective, plan, "seq-cls", int(plan.lengths.max()))


# ---------------------------------------------------------------- 4. the log-prob backward's memory


def _logprob_step(logprobs, B: int, T: int, V: int, H: int):
    """One log-prob step (output head, log-probs, backward) under MemTracker -> (peak bytes, head grad, h grad)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(0.05 * torch.randn(V, H, generator=torch.Generator().manual_seed(1)))
    h = torch.randn(B, T, H, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    mt = MemTracker()
    mt.track_external(head, h)
    with mt:
        logits = head(h)
        lp = logprobs(logits, targets)
        del logits
        (-lp.sum()).backward()
        peak = mt.get_tracker_snapshot("peak")
    (per_device,) = peak.values()
    return next(v for k, v in per_device.items() if str(getattr(k, "value", k)) == "Total"), head.weight.grad, h.grad


def _chunked_autograd(logits, targets, chunk: int = 32):
    """rlkit's previous fp32 path: log-probs by autograd over chunks (each chunk's softmax gradient is a new tensor)."""
    outs = []
    for s in range(0, logits.shape[1], chunk):
        lg = logits[:, s : s + chunk].float()
        lse = torch.logsumexp(lg, -1)
        outs.append(lg.gather(-1, targets[:, s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse)
    return torch.cat(outs, 1)


def test_the_logprob_backward_holds_one_logits_tensor_less():
    from rlkit.ops.logprobs import gather_logprobs

    B, T, V, H = 4, 64, 32768, 64
    before, head0, h0 = _logprob_step(_chunked_autograd, B, T, V, H)
    after, head1, h1 = _logprob_step(lambda lg, t: gather_logprobs(lg, t)[0], B, T, V, H)
    assert after <= before - B * T * V * 4, (before, after)  # measured: 142.7 MB -> 75.6 MB
    torch.testing.assert_close(head1, head0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h1, h0, rtol=1e-6, atol=1e-7)
    assert math.isfinite(float(head1.abs().max())) and float(head1.abs().max()) > 0
