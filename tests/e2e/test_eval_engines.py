"""`rlkit eval` and `rlkit build-prefs` sample through the sampling driver on `--engine` (the hf engine here; vLLM in
tests/vllm/test_multiturn_vllm.py), and `eval --env SPEC` evaluates greedy multi-turn trajectories against an
environment: the mean trajectory reward, turns, tool calls, how they ended, and the conversations."""

from __future__ import annotations

import json

import pytest

from rlkit.io import streams

from conftest import one_error_line, run_cli, run_cli_inproc

pytestmark = pytest.mark.slow

ENVS = '''
from rlkit.envs.base import Step


class Steps:
    """As many model turns as the prompt's length modulo 3, plus one; reward 0.25 a step and 1.0 for the last; a
    tool call counted each step; after each turn but the last, ' [i]=' (the turn's number)."""

    def reset(self, example):
        assert example.split == "heldout", example.split
        self.turn, self.turns, self.tool_calls = 0, 1 + len(example.prompt) % 3, 0
        return example.prompt

    def step(self, action):
        self.turn += 1
        self.tool_calls += 1
        if self.turn >= self.turns:
            return Step(None, 1.0, terminated=True)
        return Step(f" [{self.turn}]=", 0.25)


class Own(Steps):
    """`Steps` on prompts of its own (split and seed in each)."""

    def iter_examples(self, split, seed):
        i = 0
        while True:
            yield {"prompt": f"<{i}+{seed}>=" + "." * (i % 3), "answer": str(i + seed)}
            i += 1
'''


def expected(prompts: list[str], max_turns: int) -> dict:
    """What `Steps` gives, whatever the model says: turns, rewards, tool calls and end reasons of each prompt."""
    turns = [min(1 + len(p) % 3, max_turns) for p in prompts]
    done = [1 + len(p) % 3 <= max_turns for p in prompts]
    rewards = [0.25 * (t - 1) + (1.0 if d else 0.25) for t, d in zip(turns, done, strict=True)]
    ends: dict[str, int] = {}
    for d in done:
        ends["terminated" if d else "max_turns"] = ends.get("terminated" if d else "max_turns", 0) + 1
    return {"mean_reward": sum(rewards) / len(prompts), "mean_turns": sum(turns) / len(prompts),
            "mean_tool_calls": sum(turns) / len(prompts), "end_reasons": ends}


def check(result: dict, prompts: list[str], max_turns: int) -> None:
    want = expected(prompts, max_turns)
    assert result["n"] == len(prompts) and result["engine"] == "hf" and result["max_turns"] == max_turns
    # rewards of 0.25 a step: a mean reward, not an accuracy, and named so
    assert result["mean_reward"] == pytest.approx(want["mean_reward"]) and "accuracy" not in result
    assert result["mean_turns"] == pytest.approx(want["mean_turns"])
    assert result["mean_tool_calls"] == pytest.approx(want["mean_tool_calls"])
    assert result["end_reasons"] == want["end_reasons"]
    assert result["mean_response_tokens"] > 0
    for s, p in zip(result["samples"], prompts, strict=False):
        turns = min(1 + len(p) % 3, max_turns)
        assert s["prompt"] == p and s["turns"] == turns
        roles = [m["role"] for m in s["messages"]]
        assert roles == ["user"] + ["assistant", "user"] * (turns - 1) + ["assistant"]
        assert s["messages"][0]["content"] == p
        assert [m["content"] for m in s["messages"][2::2]] == [f" [{i}]=" for i in range(1, turns)]


def test_eval_env_reports_the_trajectories(sft_dir, tmp_path):
    from rlkit.tasks import get_task

    (tmp_path / "envs.py").write_text(ENVS)
    # the task's held-out prompts, against an environment without prompts of its own
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--env", "envs.py:Steps", "--num-prompts", "9",
                       "--max-turns", "2", "--max-new-tokens", "4", "--json", "--seed", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    res = json.loads(r.stdout)
    prompts = [e.prompt for e in get_task("arithmetic").examples("heldout", 9, 3)]
    check(res, prompts, 2)
    assert res["end_reasons"]["max_turns"] > 0 and res["env"] == "envs.py:Steps"
    assert res["prompts"] == f"{res['task']} heldout (seed 3)" and res["task"].startswith("arithmetic")
    # the environment's own held-out prompts; the table on stderr shows the conversations
    r = run_cli("eval", "--policy", str(sft_dir), "--env", "envs.py:Own", "--num-prompts", "6", "--max-new-tokens",
                "4", "--json", "--seed", "2", "--metrics", "m.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    res = json.loads(r.stdout)
    check(res, [f"<{i}+2>=" + "." * (i % 3) for i in range(6)], 8)
    assert res["end_reasons"] == {"terminated": 6} and res["task"] == "env:envs.py:Own"
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["stage"] == "eval" and row["mean_reward"] == res["mean_reward"] and row["mean_turns"] == res["mean_turns"]
    assert "accuracy" not in row
    r = run_cli_inproc("eval", "--policy", str(sft_dir), "--env", "envs.py:Own", "--num-prompts", "2", cwd=tmp_path)
    assert r.returncode == 0
    err = r.stderr.decode()
    assert "eval: engine hf" in err and "mean trajectory reward" in err and "assistant:" in err


def test_eval_and_build_prefs_refuse_what_their_engine_cannot_do(sft_dir, tmp_path):
    for args in (["eval", "--policy", str(sft_dir), "--engine", "hf", "--tp", "2"],
                 ["build-prefs", "--policy", str(sft_dir), "--engine", "hf", "--max-model-len", "64",
                  "--out", "p.arrow"],
                 ["build-prefs", "--policy", str(sft_dir), "--engine", "hf", "--dtype", "bf16", "--out", "p.arrow"],
                 ["eval", "--policy", str(sft_dir), "--dtype", "fp16"]):
        line = one_error_line(run_cli_inproc(*args, cwd=tmp_path))
        assert "--engine vllm" in line, line
    assert not (tmp_path / "p.arrow").exists()
    line = one_error_line(run_cli_inproc("eval", "--policy", str(sft_dir), "--env", "nope", cwd=tmp_path))
    assert "unknown environment 'nope'" in line
    line = one_error_line(run_cli_inproc("eval", "--policy", str(sft_dir), "--env", "calc", "--rm", str(sft_dir),
                                         cwd=tmp_path))
    assert "--rm" in line and "--env" in line


def test_build_prefs_samples_through_the_engine_it_names(sft_dir, tmp_path):
    base = ["build-prefs", "--policy", str(sft_dir), "--num-prompts", "24", "--n", "4", "--seed", "5"]
    for name, extra in (("auto", []), ("hf", ["--engine", "hf"]), ("top_p", ["--engine", "hf", "--top-p", "0.3"])):
        r = run_cli_inproc(*base, *extra, "--out", f"{name}.arrow", cwd=tmp_path)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        assert "build-prefs: engine hf" in r.stderr.decode()
    tables = {n: streams.read_table(tmp_path / f"{n}.arrow", ["prefs"]) for n in ("auto", "hf", "top_p")}
    assert tables["auto"][0].equals(tables["hf"][0])  # auto is hf on a CPU: the same samples, the same pairs
    assert tables["hf"][1].manifest["engine"] == "hf" and tables["hf"][1].manifest["config"]["engine"] == "hf"
    assert tables["auto"][1].manifest["config"]["engine"] == "auto"
    assert tables["top_p"][1].manifest["config"]["top_p"] == 0.3
