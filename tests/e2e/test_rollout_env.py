"""`rollout --env`: multi-turn trajectories on the real tiny model, through the real CLI (and, for what only the
engine object shows, the sampling driver on a real HF engine).

Token-exact trajectories (the engine's tokens with loss_mask 1 and their log-probs, the observation's encoding or the
chat template's new suffix with loss_mask 0 and log-prob 0.0), a chat template that rewrites history, environments
that misbehave (one line and exit 2, or `--env-errors end`), one engine call per turn for a whole batch, and a
one-step environment's rows next to a single-turn table's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from rlkit.io import checkpoints, streams

from conftest import run_cli, run_cli_inproc

pytestmark = pytest.mark.slow

ENVS = '''
import os
import sys
import time
from pathlib import Path

from rlkit.envs import Tools
from rlkit.envs.base import Step, TaskEnv
from rlkit.tasks import get_task


class Echo:
    """Text observations: after model turn i (of `turns`), ' [i:L]=' where L is the length of the turn's text;
    reward 0.25 a turn, 1.0 for the last."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, example):
        self.turn = 0
        return example.prompt

    def step(self, action):
        self.turn += 1
        if self.turn >= self.turns:
            return Step(None, 1.0, terminated=True)
        return Step(f" [{self.turn}:{len(action)}]=", 0.25)


class Chat:
    """Chat messages: a system and a user message, then a tool message after each turn (the length of the turn's
    text); three model turns."""

    def reset(self, example):
        self.turn = 0
        return [{"role": "system", "content": "Add."}, {"role": "user", "content": example.prompt}]

    def step(self, action):
        self.turn += 1
        if self.turn >= 3:
            return Step(None, 1.0, terminated=True)
        return Step([{"role": "tool", "content": str(len(action))}], 0.5)


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: a factor
        b: the other
    """
    return a * b


class Chatty(Tools):
    """rlkit's own Tools environment whose prompt is a chat message; its first step answers with a tool message
    (as a call would), the next ends the episode."""

    tools = [mul]

    def prompt(self, example):
        self.turn = 0
        return [{"role": "user", "content": example.prompt}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return Step([{"role": "tool", "content": "42"}], 0.0)
        return Step(None, 1.0, terminated=True)


class Varied:
    """1, 2 or 3 model turns, by the example's answer (so the trajectories of a batch end at different turns)."""

    def reset(self, example):
        self.turn, self.turns = 0, 1 + int(example.answer) % 3
        return example.prompt

    def step(self, action):
        self.turn += 1
        return Step(None, 1.0, terminated=True) if self.turn >= self.turns else Step(" more=", 0.0)


class Arith(TaskEnv):
    """The arithmetic task as a one-step environment (`rlkit.envs.TaskEnv`)."""

    def __init__(self):
        super().__init__(get_task("arithmetic"))


class Bad:
    """Two turns (reward 0.5 each), except that instance `fail_at` (the trajectory made `fail_at`-th: sample
    fail_at % n of prompt fail_at // n) misbehaves in `method` (reset, or step at its second turn): `mode` raise,
    nan (reward), huge (a 10 MB observation), hang; `mode` never: every instance goes on without end. Each instance
    marks its making and its close() in the directory `marks`."""

    def __init__(self, mode: str = "raise", method: str = "step", fail_at: int = 0, marks: str = ""):
        self.mode, self.method, self.fail_at, self.marks = mode, method, fail_at, Path(marks)
        self.k = sum(1 for n in os.listdir(self.marks) if n.startswith("made-"))
        (self.marks / f"made-{self.k}").write_text("")

    def _misbehave(self):
        if self.mode == "raise":
            raise ValueError("the dice fell off the table")
        if self.mode == "nan":
            return Step(" more=", float("nan"))
        if self.mode == "huge":
            return Step("x" * 10_000_000, 0.0)
        if self.mode == "hang":
            time.sleep(120)
        if self.mode == "exit":
            sys.exit(3)
        raise AssertionError(self.mode)

    def reset(self, example):
        self.turn = 0
        if self.method == "reset" and self.k == self.fail_at:
            obs = self._misbehave()
            return obs.observation
        return example.prompt

    def step(self, action):
        self.turn += 1
        if self.method == "step" and self.k == self.fail_at and self.turn == 2 and self.mode != "never":
            return self._misbehave()
        if self.turn >= 2 and self.mode != "never":
            return Step(None, 0.5, terminated=True)
        return Step(" more=", 0.5)

    def close(self):
        (self.marks / f"closed-{self.k}").write_text("")
'''

# prefix-stable: an assistant turn is rendered as sampled, closed by the eos token
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% if m.role == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
# drops every assistant turn's content but the last (as some templates drop earlier reasoning)
REWRITING = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>"
             "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}"
             "{% if m.role == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}")
P, N = 3, 2


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("envs") / "envs.py"
    f.write_text(ENVS)
    return f


# TEMPLATE, with the tools' names and parameters first when the template is given tools
TOOLS_TEMPLATE = ("{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}("
                  "{{ t.function.parameters.properties | join(',') }}){% endfor %}</tools>\n{% endif %}"
                  + TEMPLATE.removeprefix("{{ bos_token }}"))


def _with_template(sft_dir: Path, d: Path, template: str) -> Path:
    """A copy of the tiny checkpoint whose tokenizer has `template` as its chat template."""
    shutil.copytree(sft_dir, d)
    tok = checkpoints.load_tokenizer(d)
    tok.chat_template = template
    tok.save_pretrained(d)
    return d


def _rollout(policy: Path, env: str, out: Path, *args: str):
    r = run_cli_inproc("rollout", "--policy", str(policy), "--env", env, "--num-prompts", str(P), "--n", str(N),
                       "--out", str(out), *args)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    t, _ = streams.read_table(out, ["rollouts"])
    return t.to_pylist()


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each run of equal loss_mask values."""
    runs, s = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[s]:
            runs.append((mask[s], s, i))
            s = i
    return runs


def _check_logprobs(model, rows) -> None:
    """old_logprobs are the model's log-probs of the stored tokens in the stored context where loss_mask is 1
    (so those are the tokens the engine sampled there, never re-tokenised), and exactly 0.0 where it is 0."""
    for row in rows:
        ids, mask, lps = row["completion_ids"], row["loss_mask"], row["old_logprobs"]
        assert len(ids) == len(mask) == len(lps) and set(mask) <= {0, 1}
        assert [lp for lp, m in zip(lps, mask, strict=True) if m == 0] == [0.0] * mask.count(0)
        seq = torch.tensor([row["prompt_ids"] + ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0].double(), -1)
        p0 = len(row["prompt_ids"])
        want = [float(logp[p0 + i - 1, t]) for i, t in enumerate(ids) if mask[i]]
        got = [lp for lp, m in zip(lps, mask, strict=True) if m]
        assert got == pytest.approx(want, abs=2e-3)


def test_text_observations_are_appended_token_exact(sft_dir, envs, tmp_path):
    """No chat template (the tiny tokenizer): each row is the engine's turns (mask 1, its log-probs) and the
    environment's observations' encodings (mask 0, log-prob 0.0), in the order of the messages column."""
    rows = _rollout(sft_dir, f"{envs}:Echo", tmp_path / "r.arrow", "--seed", "5")
    model, tok = checkpoints.load_policy(sft_dir, "fp32")
    assert len(rows) == P * N
    for row in rows:
        assert row["turns"] == 3 and row["end_reason"] == "terminated" and row["terminated"] and not row["truncated"]
        assert row["turn_rewards"] == [0.25, 0.25, 1.0] and row["reward/env"] == 1.5
        msgs = row["messages"]
        assert msgs[0] == {"role": "user", "content": row["prompt"]}
        assert row["prompt_ids"] == tok(row["prompt"], add_special_tokens=True)["input_ids"]
        ids, runs = row["completion_ids"], _runs(row["loss_mask"])
        assert [m for m, _, _ in runs] == [1, 0, 1, 0, 1] and [m["role"] for m in msgs[1:]] == [
            "assistant", "user", "assistant", "user", "assistant"]
        for i, ((m, s, e), msg) in enumerate(zip(runs, msgs[1:], strict=True)):
            if m:  # the model's turn: its text is what the environment was given
                assert tok.decode(ids[s:e], skip_special_tokens=True) == msg["content"]
            else:  # the environment's answer to the turn before, exactly its encoding
                assert msg["content"] == f" [{i // 2 + 1}:{len(msgs[i]['content'])}]="
                assert ids[s:e] == tok(msg["content"], add_special_tokens=False)["input_ids"]
        assert row["completion"] == tok.decode(ids, skip_special_tokens=True)
    _check_logprobs(model, rows)

    # chat-message observations without a chat template: each message as <ROLE>content</ROLE>
    rows = _rollout(sft_dir, f"{envs}:Chat", tmp_path / "c.arrow")
    for row in rows:
        msgs = row["messages"]
        assert row["prompt"] == "<system>Add.</system>" + f"<user>{msgs[1]['content']}</user>"
        assert row["prompt_ids"] == tok(row["prompt"], add_special_tokens=True)["input_ids"]
        runs = _runs(row["loss_mask"])
        tools = [m["content"] for m in msgs if m["role"] == "tool"]
        assert [m for m, _, _ in runs] == [1, 0, 1, 0, 1] and len(tools) == 2
        for (_, s, e), content in zip([r for r in runs if r[0] == 0], tools, strict=True):
            assert row["completion_ids"][s:e] == tok(f"<tool>{content}</tool>", add_special_tokens=False)["input_ids"]
    _check_logprobs(model, rows)


def test_a_tools_environment_gives_the_chat_template_its_tools(sft_dir, envs, tmp_path):
    """rlkit's own Tools environments hand the chat template their tools' JSON schemas (`tools=`) as a TRL class
    does: the prompt the model sees lists them, and an observation is the suffix of the conversation rendered with
    them (or, where the template renders a turn otherwise than it was sampled, a new row's prompt rendered with
    them)."""
    policy = _with_template(sft_dir, tmp_path / "tools", TOOLS_TEMPLATE)
    tok = checkpoints.load_tokenizer(policy)
    rows = _rollout(policy, f"{envs}:Chatty", tmp_path / "r.arrow")
    firsts = [r for k, r in enumerate(rows) if k == 0 or rows[k - 1]["end_reason"] != "continued"]
    assert len(firsts) == P * N
    for row in firsts:
        assert row["prompt"] == f"<bos><tools>mul(a,b)</tools>\n<user>{row['messages'][0]['content']}<assistant>"
    for k, row in enumerate(rows):
        env_tokens = [t for t, m in zip(row["completion_ids"], row["loss_mask"], strict=True) if m == 0]
        if env_tokens:
            # the template closes the model's turn with eos where the turn did not end on one
            assert tok.decode(env_tokens, skip_special_tokens=False).removeprefix("<eos>") == "<tool>42<assistant>"
        if k and rows[k - 1]["end_reason"] == "continued":  # a new row: the whole conversation, with the tools
            assert row["prompt"].startswith("<bos><tools>mul(a,b)</tools>\n<user>")
            assert row["prompt"].endswith("<tool>42<assistant>")
    assert sum(r["end_reason"] == "terminated" for r in rows) == P * N


def test_chat_template_suffix_and_a_template_that_rewrites_history(sft_dir, envs, tmp_path):
    """With a chat template, an observation appends exactly the template's new suffix (the rendering of the whole
    conversation after the trajectory's own text); where the template renders earlier turns otherwise than they
    were sampled, the trajectory goes on in a new row (prompt: the template's rendering), never altered."""
    policy = _with_template(sft_dir, tmp_path / "chat", TEMPLATE)
    model, tok = checkpoints.load_policy(policy, "fp32")
    rows = _rollout(policy, f"{envs}:Chat", tmp_path / "r.arrow", "--seed", "1")

    def render(msgs, gen=True):
        return tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

    suffixes = 0
    specials = set(tok.all_special_ids) - {tok.eos_token_id}
    for k, row in enumerate(rows):
        ids, mask, msgs = row["completion_ids"], row["loss_mask"], row["messages"]
        assert row["prompt_ids"] == tok(row["prompt"], add_special_tokens=False)["input_ids"]
        if k == 0 or rows[k - 1]["end_reason"] != "continued":  # a trajectory's first row: reset's messages
            assert row["prompt"] == render(msgs[:2])
        else:  # a row cut off because the template would have rendered a sampled turn otherwise
            before = rows[k - 1]
            assert (before["group_id"], before["sample_idx"]) == (row["group_id"], row["sample_idx"])
            assert row["prompt"] == render(before["messages"])
            text = tok.decode(before["prompt_ids"] + before["completion_ids"], skip_special_tokens=False)
            assert not render(before["messages"]).startswith(text)
        # walk the row's messages: each mask-0 run is the template's new suffix at that point
        n_before = next(i for i, m in enumerate(msgs) if m["role"] == "assistant" and row["prompt"] == render(msgs[:i]))
        j = n_before
        for m, s, e in _runs(mask):
            if m:
                assert msgs[j]["role"] == "assistant"
                assert tok.decode(ids[s:e], skip_special_tokens=True) == msgs[j]["content"]
                j += 1
            else:
                assert msgs[j]["role"] == "tool"
                so_far = tok.decode(row["prompt_ids"] + ids[:s], skip_special_tokens=False)
                full = render(msgs[:j + 1])
                assert full.startswith(so_far)
                assert ids[s:e] == tok(full[len(so_far):], add_special_tokens=False)["input_ids"]
                suffixes += 1
                j += 1
        if row["end_reason"] == "terminated" and not specials & {t for t, m in zip(ids, mask, strict=True) if m}:
            # the whole row is the template's rendering of its conversation (where the model sampled no special
            # token other than eos: a turn's text, which the template renders, leaves them out)
            text = tok.decode(row["prompt_ids"] + ids, skip_special_tokens=False)
            assert render(msgs, gen=False) in (text, text + tok.eos_token)
    assert suffixes >= P * N  # most trajectories ran their three turns in one row
    assert sum(r["turns"] for r in rows) == 3 * P * N
    _check_logprobs(model, rows)

    # a template that drops earlier assistant turns: every turn after the first starts a new row
    policy = _with_template(sft_dir, tmp_path / "rewriting", REWRITING)
    tok = checkpoints.load_tokenizer(policy)  # render() renders with this one's template now
    rows = _rollout(policy, f"{envs}:Chat", tmp_path / "w.arrow", "--seed", "1")
    trajs: dict[tuple[int, int], list[dict]] = {}
    for row in rows:  # a trajectory's rows are in order, one after the other
        trajs.setdefault((row["group_id"], row["sample_idx"]), []).append(row)
    assert len(trajs) == P * N and len(rows) > 2 * P * N
    for parts in trajs.values():
        assert len(parts) >= 2  # the first turn (at least) was re-rendered without its content: cut there
        assert [r["end_reason"] for r in parts] == ["continued"] * (len(parts) - 1) + ["terminated"]
        assert [r["terminated"] for r in parts] == [False] * (len(parts) - 1) + [True]
        assert sum(r["turns"] for r in parts) == 3 and all(r["turns"] >= 1 for r in parts)
        assert [x for r in parts for x in r["turn_rewards"]] == [0.5, 0.5, 1.0]
        assert all(r["reward/env"] == 2.0 for r in parts)  # each row carries the trajectory's reward
        for a, b in zip(parts, parts[1:], strict=False):
            assert b["prompt"] == render(a["messages"]) and "<assistant><eos>" in b["prompt"]  # content dropped
            assert b["prompt_ids"] == tok(b["prompt"], add_special_tokens=False)["input_ids"]
            assert a["messages"] == b["messages"][:len(a["messages"])]


def _bad(envs: Path, marks: Path, mode: str, method: str = "step", fail_at: int = 3) -> str:
    marks.mkdir()
    return f"{envs}:Bad:mode={mode},method={method},fail_at={fail_at},marks={marks}"


def _error_line(r) -> str:
    """An error met while sampling: exit 2, its one `rlkit: error:` line last on stderr (after the engine's start-up
    lines), no traceback."""
    err = r.stderr.decode() if isinstance(r.stderr, bytes) else r.stderr
    lines = err.strip().splitlines()
    assert r.returncode == 2, err[-2000:]
    assert "Traceback" not in err and [x for x in lines if x.startswith("rlkit: error:")] == lines[-1:], lines
    return lines[-1]


def _closed_all(marks: Path) -> int:
    made = sorted(n.split("-")[1] for n in os.listdir(marks) if n.startswith("made-"))
    closed = sorted(n.split("-")[1] for n in os.listdir(marks) if n.startswith("closed-"))
    assert made and made == closed  # close() on every instance made, also after an error
    return len(made)


@pytest.mark.parametrize(("mode", "method", "says"), [
    ("raise", "step", "raised ValueError: the dice fell off the table"),
    ("raise", "reset", "raised ValueError: the dice fell off the table"),
    ("nan", "step", "returned the reward nan; expected a finite number"),
    ("huge", "step", "returned an observation of 10,000,000 characters"),
    ("hang", "step", "did not return within 1 s"),
    ("exit", "step", "called sys.exit(3)"),
    ("exit", "reset", "called sys.exit(3)"),
])
def test_a_misbehaving_environment_is_one_line_or_an_ended_trajectory(sft_dir, envs, tmp_path, mode, method, says):
    from rlkit.tasks import get_task

    row = get_task("arithmetic").examples("train", P, 0)[3 // N].prompt_id  # trajectory 3: prompt 1, sample 1
    out = tmp_path / "out"
    out.mkdir()
    spec = _bad(envs, tmp_path / "marks", mode, method)
    args = ("rollout", "--policy", str(sft_dir), "--env", spec, "--num-prompts", str(P), "--n", str(N),
            "--env-timeout", "1", "--out", str(out / "r.arrow"))
    line = _error_line(run_cli_inproc(*args))
    assert f"environment Bad: {method}()" in line and says in line and f"prompt {row!r} sample 1" in line, line
    assert "--env-errors end" in line
    assert os.listdir(out) == []  # nothing written at --out
    _closed_all(tmp_path / "marks")

    # --env-errors end: that trajectory ends there with reward 0 and the reason; the others run to their end
    shutil.rmtree(tmp_path / "marks")
    spec = _bad(envs, tmp_path / "marks", mode, method)
    r = run_cli_inproc(*args, "--env-errors", "end")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    t, _ = streams.read_table(out / "r.arrow", ["rollouts"])
    rows = t.to_pylist()
    assert len(rows) == P * N and _closed_all(tmp_path / "marks") == P * N
    bad = rows[3]
    assert (bad["prompt_id"], bad["sample_idx"]) == (row, 1)
    assert bad["reward/env"] == 0.0 and bad["end_reason"].startswith(f"error: {method} ") and not bad["terminated"]
    assert bad["turns"] == (0 if method == "reset" else 2)
    for other in rows[:3] + rows[4:]:
        assert other["end_reason"] == "terminated" and other["reward/env"] == 1.0 and other["turns"] == 2


def test_environment_error_exit_code_in_a_process(sft_dir, envs, tmp_path):
    """The real process: exit 2, one line, no traceback, nothing at --out."""
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", _bad(envs, tmp_path / "marks", "raise"), "--num-prompts",
                str(P), "--n", str(N), "--out", str(out))
    assert "environment Bad: step() raised ValueError" in _error_line(r)
    assert not out.exists()
    _closed_all(tmp_path / "marks")


def test_an_environment_that_never_ends_is_cut_at_max_turns(sft_dir, envs, tmp_path):
    rows = _rollout(sft_dir, _bad(envs, tmp_path / "marks", "never"), tmp_path / "r.arrow", "--max-turns", "3")
    assert len(rows) == P * N and _closed_all(tmp_path / "marks") == P * N
    for row in rows:
        assert row["end_reason"] == "max_turns" and row["truncated"] and not row["terminated"]
        assert row["turns"] == 3 and row["turn_rewards"] == [0.5] * 3 and row["reward/env"] == 1.5
        assert [m for m, _, _ in _runs(row["loss_mask"])] == [1, 0, 1, 0, 1]  # no observation after the last turn


def test_a_one_step_environment_gives_single_turn_rows(sft_dir, envs, tmp_path):
    """A task as a one-step environment (TaskEnv): one turn a row, loss_mask all ones, the single-turn table's
    columns (same types, same prompts, groups and gold answers) with the trajectory's beside them, and the
    environment's reward equal to the task verifier's on the same completion."""
    args = ("--num-prompts", "4", "--n", "3", "--seed", "7")
    single = tmp_path / "single.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), *args, "--out", str(single))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    multi = tmp_path / "multi.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{envs}:Arith", "--task", "arithmetic", *args,
                       "--out", str(multi))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    s, _ = streams.read_table(single, ["rollouts"])
    m, _ = streams.read_table(multi, ["rollouts"])
    for f in s.schema:
        assert m.schema.field(f.name).type == f.type, f.name
    for col in ("prompt_id", "group_id", "sample_idx", "prompt", "prompt_ids", "answer", "policy_fingerprint",
                "policy_step"):
        assert m.column(col).to_pylist() == s.column(col).to_pylist(), col
    assert {"loss_mask", "turns", "end_reason", "messages", "reward/env"} <= set(m.schema.names)
    for row in m.to_pylist():
        assert row["turns"] == 1 and row["loss_mask"] == [1] * len(row["completion_ids"]) and row["completion_ids"]
        assert row["end_reason"] == "terminated" and row["terminated"] and row["tool_calls"] == 0
        assert row["reward/env"] == row["reward/verifier"] and row["turn_rewards"] == [row["reward/env"]]
        assert row["messages"] == [{"role": "user", "content": row["prompt"]},
                                   {"role": "assistant", "content": row["completion"]}]
        assert all(lp <= 0 for lp in row["old_logprobs"]) and len(row["old_logprobs"]) == len(row["completion_ids"])


class _Counting:
    """The real HF engine, its sample() calls counted and their results kept."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def sample(self, prompt_ids, **kw):
        gen = self.engine.sample(prompt_ids, **kw)
        self.calls.append((len(prompt_ids), kw["n"], gen.completion_ids))
        return gen


def test_a_batch_of_trajectories_runs_one_engine_call_per_turn(sft_dir, envs):
    """P prompts x n trajectories that end at different turns: one engine call per turn with the trajectories
    still running, and each row's model turns are exactly the tokens those calls returned."""
    from rlkit import engines
    from rlkit.envs import get_env
    from rlkit.io import data
    from rlkit.sampling import Prompts, Sampling, run_episodes
    from rlkit.tasks import get_task

    engine = _Counting(engines.create("hf", sft_dir, engines.EngineOptions(seed=0, device="cpu")))
    ex = get_task("arithmetic").examples("train", 6, 2)
    texts = [e.prompt for e in ex]
    prompts = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], texts,
                      data.encode_prompts(engine.tokenizer, texts, False))
    want_turns = [1 + int(e.answer) % 3 for e in ex]
    assert len(set(want_turns)) == 3  # the batch holds trajectories of 1, 2 and 3 turns
    n = 3
    ep = run_episodes(engine, engine.tokenizer, get_env(f"{envs}:Varied"), prompts,
                      Sampling(n=n, max_new_tokens=8, max_turns=5), seed=4)
    engine.engine.close()
    turns = ep.columns["turns"]
    assert turns == [want_turns[k // n] for k in range(len(ex) * n)]
    assert len(engine.calls) == max(turns) == 3  # one call per turn, never one per trajectory
    assert all(calls_n == 1 for _, calls_n, _ in engine.calls)
    assert [size for size, _, _ in engine.calls] == [sum(t > i for t in turns) for i in range(3)]
    for k, (ids, mask) in enumerate(zip(ep.columns["completion_ids"], ep.columns["loss_mask"], strict=True)):
        sampled = [ids[s:e] for m, s, e in _runs(mask) if m]
        assert len(sampled) == turns[k]
        for i, got in enumerate(sampled):  # trajectory k's place among those still running at turn i
            place = sum(t > i for t in turns[:k])
            assert got == engine.calls[i][2][place]

