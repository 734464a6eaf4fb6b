"""On-policy distillation's math (`rlkit.ops.advantages.teacher_advantage`, `teacher_kl`), its registry entry and
refusals, and the per-token columns a rollouts table may carry (`teacher_logprobs`, `token_rewards`) as
`build_batch` reads them."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from rlkit.algorithms import registry
from rlkit.algorithms.config import RLConfig, resolve
from rlkit.algorithms.inputs import build_batch
from rlkit.errors import RlkitError
from rlkit.io import schemas
from rlkit.ops.advantages import teacher_advantage, teacher_kl


def test_teacher_advantage_and_kl_by_hand():
    old = torch.tensor([[-2.0, -0.1, -1.0], [-0.5, -3.0, 0.0]])
    tea = torch.tensor([[-0.5, -0.3, -1.0], [-0.7, -1.0, -9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = teacher_advantage(old, tea, mask, 2.0)
    want = torch.tensor([[3.0, -0.4, 0.0], [-0.4, 4.0, 0.0]])  # -2 * (old - tea); 0 off the mask
    torch.testing.assert_close(adv, want)
    # mean of old - tea over the 5 sampled tokens: (-1.5 + 0.2 + 0 + 0.2 - 2) / 5
    assert teacher_kl(old, tea, mask) == pytest.approx(-3.1 / 5)
    assert teacher_kl(old, tea, torch.zeros_like(mask)) == 0.0


def test_distill_is_registered_with_its_defaults_and_refusals():
    cls = registry.get("distill")
    cfg = resolve(RLConfig(algo="distill"))
    assert (cfg.teacher_coef, cfg.beta) == (1.0, 0.0) and cls.input.kinds == ("rollouts", "scored")
    cfg.check()
    assert resolve(RLConfig(algo="grpo")).teacher_coef == 0.0
    resolve(RLConfig(algo="grpo", teacher_coef=0.5)).check()
    with pytest.raises(RlkitError, match="--teacher-coef must be > 0"):
        resolve(RLConfig(algo="distill", teacher_coef=0.0)).check()
    with pytest.raises(RlkitError, match="--teacher-coef -1: expected a number >= 0"):
        resolve(RLConfig(algo="grpo", teacher_coef=-1.0)).check()
    with pytest.raises(RlkitError, match="does not use the reward"):
        resolve(RLConfig(algo="distill", drop_degenerate=True)).check()


def _table(extra: dict) -> pa.Table:
    rows = {"prompt_id": ["a", "a"], "group_id": [0, 0], "sample_idx": [0, 1], "prompt": ["p", "p"],
            "completion": ["x", "yz"], "prompt_ids": [[1, 2], [1, 2]], "completion_ids": [[5], [6, 7]],
            "old_logprobs": [[-1.0], [-0.5, -0.25]], "finish_reason": ["eos", "eos"], "policy_fingerprint": ["f", "f"],
            "policy_step": [0, 0], "reward/verifier": [1.0, 0.0], **extra}
    return pa.table(rows)


def test_per_token_columns_reach_the_batch():
    t = _table({"teacher_logprobs": [[-0.5], [-1.0, -2.0]], "token_rewards": [[0.5], [0.25, -1.0]]})
    for name in ("teacher_logprobs", "token_rewards"):  # rollouts and scored tables accept them
        assert name in {f.name for f in schemas.kind("rollouts").accepted}
    batch, used = build_batch(t, pad_id=0)
    torch.testing.assert_close(batch.teacher_logp, torch.tensor([[-0.5, 0.0], [-1.0, -2.0]]))
    # token_rewards: a component (their row sums) and, weighed, per token
    assert used == {"verifier": 1.0, "token_rewards": 1.0}
    torch.testing.assert_close(batch.rewards, torch.tensor([1.5, -0.75]))
    torch.testing.assert_close(batch.token_rewards, torch.tensor([[0.5, 0.0], [0.25, -1.0]]))
    batch, _ = build_batch(t, pad_id=0, weights={"verifier": 1.0, "token_rewards": 2.0})
    torch.testing.assert_close(batch.rewards, torch.tensor([2.0, -1.5]))
    torch.testing.assert_close(batch.token_rewards, torch.tensor([[1.0, 0.0], [0.5, -2.0]]))
    batch, _ = build_batch(t, pad_id=0, weights={"verifier": 1.0})  # left out of --reward: not trained on
    assert batch.token_rewards is None and batch.rewards.tolist() == [1.0, 0.0]
    plain, _ = build_batch(_table({}), pad_id=0)
    assert plain.teacher_logp is None and plain.token_rewards is None


@pytest.mark.parametrize(("column", "value", "says"), [
    ("teacher_logprobs", [[-0.5], [-1.0]], "has 1 teacher_logprobs entries but 2 completion tokens"),
    ("token_rewards", [[0.5], None], "has none token_rewards entries"),
    ("teacher_logprobs", [[float("nan")], [-1.0, -2.0]], "non-finite value in teacher_logprobs"),
    ("teacher_logprobs", [[-0.5], [-1.0, 0.25]], r"row 1 \(prompt_id 'a', sample 1\) has 0.25 at completion token 1 in "
                                                 "teacher_logprobs, above 0, which no log-probability is"),
])
def test_a_bad_per_token_column_is_one_line_naming_the_row(column, value, says):
    with pytest.raises(RlkitError, match=says):
        build_batch(_table({column: value}), pad_id=0)


def test_ppo_places_token_rewards_at_their_tokens():
    from rlkit.ops.gae import kl_penalised_token_rewards

    mask = torch.tensor([[True, False, True, True], [True, True, False, False]])  # row 1: an environment token
    tok = torch.tensor([[0.5, 0.7, 0.0, 0.25], [1.0, 0.0, 0.0, 0.0]])
    score = torch.tensor([2.0 + 0.5 + 0.7 + 0.25, 1.0])  # the sequence reward holds the token rewards' sums
    kl = torch.full((2, 4), 0.1)
    out = kl_penalised_token_rewards(score, kl, mask, 1.0, tok)
    # on the mask: -0.1 each, the token reward at its token, the rest of the score (2 + 0.7) at the last token
    want = torch.tensor([[-0.1 + 0.5, 0.0, -0.1, -0.1 + 0.25 + 2.7], [-0.1 + 1.0, -0.1 + 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, want)
    assert float(out[0].sum()) == pytest.approx(float(score[0]) - 0.3)  # the score, less the KL penalties
