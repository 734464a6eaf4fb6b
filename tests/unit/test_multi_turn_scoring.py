"""What each reward source reads of a multi-turn row (`rlkit.tasks.multi_turn`), the rows an environment error
ended, per-turn `token_rewards` as a share of `reward/env` (never counted twice by `build_batch`), and SFT targets
that are trajectories (`rlkit.tasks.Transcript`: the environment's text masked)."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest
import torch

from rlkit.algorithms.inputs import build_batch
from rlkit.errors import RlkitError
from rlkit.io import data, schemas
from rlkit.tasks import Transcript, multi_turn
from rlkit.tiny import build_tokenizer


def _msgs(*turns: str, prompt: str = "<1+2>=") -> list[dict]:
    """A conversation: the prompt, then alternating model turns and environment answers."""
    roles = ("assistant", "user")
    return [{"role": "user", "content": prompt}, *({"role": roles[i % 2], "content": t} for i, t in enumerate(turns))]


# rows 0-1 are one trajectory the chat template cut (row 0 `continued`), row 2 a trajectory of its own, row 3 one an
# environment error ended
COLS = {
    "completion": ["a1 obs1 a2", "a3", "b1 obs b2", "c1"],
    "messages": [_msgs("a1", " obs1 ", "a2", " cut "), _msgs("a1", " obs1 ", "a2", " cut ", "a3"),
                 _msgs("b1", " obs ", "b2"), _msgs("c1")],
    "turns": [2, 1, 2, 1],
    "end_reason": ["continued", "terminated", "max_turns", "error: step raised ValueError: no"],
    "group_id": [0, 0, 0, 1],
    "sample_idx": [0, 0, 1, 0],
}


def test_each_reading_of_a_multi_turn_row():
    # final: the trajectory's last model turn, for each of its rows
    assert multi_turn.texts("final", COLS) == ["a3", "a3", "b2", "c1"]
    # model: the row's own model turns, joined as sampled, without the environment's text
    assert multi_turn.texts("model", COLS) == ["a1a2", "a3", "b1b2", "c1"]
    # conversation: the row's whole completion as the model saw it
    assert multi_turn.texts("conversation", COLS) == COLS["completion"]
    single = {"completion": ["x", "y"]}  # a single-turn table: every reading is the completion
    assert all(multi_turn.texts(r, single) == ["x", "y"] for r in multi_turn.READINGS)


def test_the_rows_an_error_ended_and_scoring_around_them():
    assert multi_turn.ended_by_error(COLS) == [False, False, False, True]
    cut = {**COLS, "end_reason": ["continued", "error: reset raised X", "terminated", "terminated"]}
    assert multi_turn.ended_by_error(cut) == [True, True, False, False]  # every row of that trajectory
    seen = []

    def score(rows):
        seen.append(rows)
        return [10.0 + i for i in rows]

    assert multi_turn.score_kept([False, True, False], score, 0.0) == [10.0, 0.0, 12.0] and seen == [[0, 2]]
    assert multi_turn.score_kept([True, True], score, 0.0) == [0.0, 0.0] and len(seen) == 1  # nothing to score


def test_reads_options_and_defaults():
    defaults = {"verifier": multi_turn.default_reads(object()), "fmt": multi_turn.default_reads()}
    assert defaults == {"verifier": "final", "fmt": "conversation"}
    assert multi_turn.parse_reads(("fmt=model",), defaults, "rollout") == {"verifier": "final", "fmt": "model"}

    class Replays:  # a task whose verifier reads whole games declares it
        name, reads = "replays", "conversation"

    assert multi_turn.default_reads(Replays()) == "conversation"
    Replays.reads = "everything"
    with pytest.raises(RlkitError, match="task replays: reads = 'everything'; expected one of final, model"):
        multi_turn.default_reads(Replays())
    for spec, says in (("fmt", "expected NAME=READING"), ("fmt=all", "'all' is not a reading"),
                       ("rm:x=final", "rollout scores no reward component 'rm:x' here (it scores: verifier, fmt)")):
        with pytest.raises(RlkitError, match=re.escape(says)):
            multi_turn.parse_reads((spec,), defaults, "rollout")


def test_turn_token_rewards():
    # turn ends 1, 4, 6 of 7 tokens; a turn without a token (-1) places nothing
    assert multi_turn.turn_token_rewards(7, [1, 4, 6], [0.25, 0.5, 1.0]) == [0, 0.25, 0, 0, 0.5, 0, 1.0]
    assert multi_turn.turn_token_rewards(3, [-1, 2], [5.0, 1.0]) == [0.0, 0.0, 1.0]


def _table(token_rewards_field) -> pa.Table:
    schema = pa.schema([pa.field("group_id", pa.int64()), pa.field("prompt_ids", pa.list_(pa.int32())),
                        pa.field("completion_ids", pa.list_(pa.int32())), pa.field("old_logprobs", pa.list_(pa.float32())),
                        pa.field("finish_reason", pa.string()), pa.field("reward/env", pa.float64()),
                        pa.field("loss_mask", pa.list_(pa.int8())), token_rewards_field])
    return pa.table({"group_id": [0, 0], "prompt_ids": [[1, 2], [1, 2]], "completion_ids": [[5, 6, 7, 8], [5, 6]],
                     "old_logprobs": [[-1.0] * 4, [-1.0] * 2], "finish_reason": ["stop", "stop"],
                     "reward/env": [1.5, 0.0], "loss_mask": [[1, 0, 0, 1], [1, 1]],
                     "token_rewards": [[0.5, 0.0, 0.0, 1.0], [0.0, 0.0]]}, schema=schema)


def test_token_rewards_of_env_are_counted_once():
    """rollout --env's token_rewards are reward/env split over its turns: the sequence reward is reward/env (not
    reward/env + their sum), and they reach PPO weighed as env is. Without the mark they are a component of their
    own, as a process reward's are."""
    share = _table(schemas.token_rewards_field("env"))
    assert schemas.token_rewards_part_of(share.schema) == "env"
    batch, used = build_batch(share, pad_id=0)
    assert used == {"env": 1.0} and batch.rewards.tolist() == [1.5, 0.0]
    torch.testing.assert_close(batch.token_rewards, torch.tensor([[0.5, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    batch, _ = build_batch(share, pad_id=0, weights={"env": 2.0})
    assert batch.rewards.tolist() == [3.0, 0.0] and batch.token_rewards[0].tolist() == [1.0, 0.0, 0.0, 2.0]
    own = _table(schemas.token_rewards_field())
    assert schemas.token_rewards_part_of(own.schema) is None
    batch, used = build_batch(own, pad_id=0)
    assert used == {"env": 1.0, "token_rewards": 1.0} and batch.rewards.tolist() == [3.0, 0.0]


def test_a_transcript_is_its_text_and_its_parts():
    t = Transcript.turns("<call>mul(37,48)</call>", "<tool>1776</tool>", "1776")
    assert t == "<call>mul(37,48)</call><tool>1776</tool>1776" and isinstance(t, str)
    assert t.parts == (("<call>mul(37,48)</call>", True), ("<tool>1776</tool>", False), ("1776", True))
    assert pa.array([t]).to_pylist() == [str(t)]  # written as text wherever a target is text (prompts --sft)


def test_sft_targets_of_environments_mask_the_environments_text():
    """calc's tool result and guess's feedback lines are context (0), the model's turns and eos targets (1); the
    tokens are those of the whole text (each part tokenised on its own, as a rollout appends it)."""
    from rlkit.tasks import get_task

    tok = build_tokenizer()
    for spec, env_text in (("calc", ["<tool>"]), ("guess", ["higher\n", "lower\n"])):
        task = get_task(spec)
        exs = task.examples("train", 40, 0)
        comps = [task.completion(e) for e in exs]
        pids = data.encode_prompts(tok, [e.prompt for e in exs], chat=False)
        ids, plens, _, masks = data.encode_sft_masked(tok, pids, comps, max_len=256)
        plain, _, _ = data.encode_sft(tok, pids, [str(c) for c in comps], max_len=256)
        assert ids == plain  # the same tokens as the text's
        masked = 0
        for seq, p, m, c in zip(ids, plens, masks, comps, strict=True):
            comp = seq[p:]
            assert len(m) == len(comp) and m[-1] == 1  # eos is a target
            assert tok.decode([x for x, k in zip(comp, m, strict=True) if not k]) == \
                "".join(t for t, model in c.parts if not model)
            assert tok.decode([x for x, k in zip(comp[:-1], m[:-1], strict=True) if k]) == \
                "".join(t for t, model in c.parts if model)
            masked += m.count(0)
        assert masked and any(any(x in t for x in env_text) for c in comps for t, model in c.parts if not model)
    # plain targets: no masks at all (the SFT of every other task is unchanged)
    assert data.encode_sft_masked(tok, data.encode_prompts(tok, ["<1+2>="], chat=False), ["3"], 64)[3] is None


def test_a_transcript_cut_to_its_environment_text_is_dropped():
    tok = build_tokenizer()
    pids = data.encode_prompts(tok, ["<1+2>="], chat=False)
    t = Transcript.turns("3", "x" * 40, "3")
    ids, _, truncated, masks = data.encode_sft_masked(tok, pids, [t], max_len=len(pids[0]) + 5)
    assert truncated == 1 and ids and masks[0] == [1, 0, 0, 0, 0]  # the model's "3", then the cut observation
    env_only = Transcript([("x" * 40, False)])  # cut before its eos: no target token left, nothing to learn from
    ids, _, truncated, masks = data.encode_sft_masked(tok, pids, [env_only], max_len=len(pids[0]) + 5)
    assert truncated == 1 and ids == [] and masks == []


def test_a_task_class_declares_what_its_verifier_reads(tmp_path):
    from rlkit.tasks import get_task

    (tmp_path / "games.py").write_text(
        "from rlkit.tasks import Example\n\n"
        "class Games:\n"
        "    reads = 'conversation'  # its verifier replays the whole game, feedback included\n\n"
        "    def iter_examples(self, split, seed):\n"
        "        yield Example(f'{split}-0', 'go:', '1', split)\n\n"
        "    def reward(self, response, answer):\n"
        "        return 0.0\n")
    assert multi_turn.default_reads(get_task(f"{tmp_path / 'games.py'}:Games")) == "conversation"
    assert multi_turn.default_reads(get_task("arithmetic")) == "final"
