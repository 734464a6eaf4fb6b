"""OpenEnv's MCP tool servers under `rlkit rollout --env openenv:url=...`: a real `MCPEnvironment` with two fastmcp
tools (tests/servers/openenv_mcp_tools.py) and the text server (tests/servers/openenv_echo.py), each served by
openenv-core's own app on 127.0.0.1, through rollout | score-ref | update on the real tiny model."""

from __future__ import annotations

import json
import random

import pytest
from test_ecosystem_envs import REPO, Server, _error_line, _rows

from conftest import run_cli, run_cli_inproc

pytestmark = pytest.mark.slow
MCP = REPO / "tests" / "servers" / "openenv_mcp_tools.py"


@pytest.fixture(scope="module")
def mcp_server():
    s = Server(sessions=8, script=MCP)
    yield s
    s.stop()


def test_an_mcp_server_is_driven_as_tools(mcp_server):
    """`openenv:url=` finds the server's tools from its /schema; the model's calls (both formats) go to the server as
    call_tool, its results come back as tool messages, its reward on the step that ends the episode."""
    from rlkit.envs import get_env
    from rlkit.tasks import Example

    spec = get_env(f"openenv:url=http://127.0.0.1:{mcp_server.port}")
    assert spec.name == "OpenEnvMCP" and spec.attribute("stop") == ("</call>", "</tool_call>")
    assert get_env(f"openenv-mcp:url={mcp_server.url}").name == "OpenEnvMCP"  # forced: no probe
    env = spec.make()
    try:
        ex = next(env.iter_examples("train", 0))
        (msg,) = env.reset(ex)  # the server's prompt, as a user message (the chat template gets the tools)
        a, b = (int(w.strip(",")) for w in msg["content"].split()[1:4:2])  # "Add A and B, then submit the sum."
        assert msg == {"role": "user", "content": f"Add {a} and {b}, then submit the sum."}
        assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "submit"]
        assert env.tool_schemas()[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
        step = env.step(f"<call>add({a}, b={b})</call>")
        assert step.observation == [{"role": "tool", "content": str(a + b)}] and not step.terminated
        step = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": "x"}}</tool_call>')
        assert step.observation[0]["content"].startswith("error: ") and "valid integer" in step.observation[0]["content"]
        step = env.step("<call>add(1, 2, 3)</call>")
        assert step.observation == [{"role": "tool", "content": "error: add: 3 positional arguments; its parameters "
                                                                 "are a, b (pass them by name)"}]
        assert env.step("<call>mul(a=2)</call>").observation == [{"role": "tool", "content": "error: unknown tool "
                                                                   "'mul'; tools: add, submit"}]
        step = env.step(f'<tool_call>{{"name": "submit", "arguments": {{"answer": {a + b}}}}}</tool_call>')
        assert step == type(step)(None, 1.0, terminated=True)
        assert env.tool_calls == 5 and env.tool_errors == 3
    finally:
        env.close()
    env = spec.make()
    try:
        rng = random.Random(5)  # the row's answer is the reset seed; the server draws the numbers from it
        assert env.reset(Example("p0", "a prompt of the table's", "5", "train")) == \
            f"a prompt of the table's\nAdd {rng.randint(1, 9)} and {rng.randint(1, 9)}, then submit the sum."
        step = env.step("12")  # no call: the final answer ends the episode; the server pays nothing for it
        assert step.terminated and step.reward == 0.0 and step.observation is None
    finally:
        env.close()


def test_mcp_and_text_servers_run_rollout_score_ref_update(mcp_server, sft_dir, ref_dir, tmp_path):
    """The MCP server (its prompts, its tools) and the text server, each through rollout | score-ref | update."""
    text_server = Server(sessions=8)
    try:
        for name, env, tools in (("mcp", f"openenv:url={mcp_server.url},max_new_tokens=6", True),
                                 ("text", f"openenv:url={text_server.url},stop=\\n,max_new_tokens=3", False)):
            out = tmp_path / f"{name}.arrow"
            r = run_cli("rollout", "--policy", str(sft_dir), "--env", env, "--num-prompts", "2", "--n", "2",
                        "--max-turns", "3", "--seed", "1", "--out", str(out))
            assert r.returncode == 0, r.stderr.decode()[-3000:]
            rows = _rows(out)
            assert len(rows) == 4
            if tools:
                for row in rows:  # the tiny model calls no tool: its first turn is the final answer
                    assert row["prompt"].startswith("<user>Add ") and row["turns"] == 1
                    assert row["end_reason"] == "terminated" and row["reward/env"] == 0.0
            else:
                assert all(row["prompt"].startswith("Say ") for row in rows)
            scored = tmp_path / f"{name}.scored.arrow"
            r = run_cli_inproc("score-ref", "--in", str(out), "--ref", str(ref_dir), "--out", str(scored))
            assert r.returncode == 0, r.stderr.decode()[-2000:]
            r = run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(scored), "--beta", "0", "--out",
                               str(tmp_path / f"{name}.policy"), "--metrics", str(tmp_path / f"{name}.jsonl"))
            assert r.returncode == 0, r.stderr.decode()[-2000:]
            assert json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[-1])["reward_mean"] == \
                pytest.approx(sum(row["reward/env"] for row in rows) / 4)
    finally:
        text_server.stop()


def test_an_mcp_server_without_a_prompt_needs_prompts(sft_dir, tmp_path):
    """A server whose reset says nothing (OpenEnv's echo_env) takes its prompts from --prompts; without them, one line."""
    s = Server(sessions=4, script=MCP, extra=("quiet",))
    try:
        out = tmp_path / "r.arrow"
        base = ["rollout", "--policy", str(sft_dir), "--env", f"openenv:url={s.url},max_new_tokens=4", "--n", "2",
                "--max-turns", "2", "--out", str(out)]
        line = _error_line(run_cli(*base, "--num-prompts", "2"))
        assert "the server's reset observation has no text to prompt with (it is {})" in line, line
        assert "--prompts FILE" in line and "--env-errors" not in line and not out.exists()
        data = tmp_path / "p.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"Add {a} and {b} with the add tool:", "answer": str(a + b)}) + "\n"
                                for a, b in ((3, 4), (5, 1))))
        r = run_cli(*base, "--prompts", str(data), "--num-prompts", "2")
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        assert sorted({row["prompt"] for row in _rows(out)}) == ["Add 3 and 4 with the add tool:",
                                                                  "Add 5 and 1 with the add tool:"]
    finally:
        s.stop()


def test_mcp_bad_options_are_one_line(mcp_server, sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", f"openenv:url={mcp_server.url},action.colour=red",
                "--num-prompts", "2", "--out", str(out))
    line = _error_line(r)
    assert "is an MCP tool server: its actions are the model's tool calls, so action= and action.KEY=VALUE do not " \
           "apply" in line and not out.exists()


@pytest.mark.parametrize("action", ["calls-only", "union"])
def test_mcp_servers_of_other_action_classes(action):
    """An action class that is a CallToolAction subclass (finqa_env's) refuses a list_tools step: the tools come from
    MCP's tools/list over the same session. A union of ListToolsAction and CallToolAction (agent_world_model_env's)
    is found from its /schema too. Calls go through as before."""
    from rlkit.envs import get_env

    s = Server(sessions=2, script=MCP, extra=(action,))
    try:
        spec = get_env(f"openenv:url={s.url}")
        assert spec.name == "OpenEnvMCP"
        env = spec.make()
        try:
            env.reset(next(env.iter_examples("train", 0)))
            assert [t["name"] for t in env.tools] == ["add", "submit"]
            assert env.step("<call>add(2, 3)</call>").observation == [{"role": "tool", "content": "5"}]
        finally:
            env.close()
    finally:
        s.stop()
