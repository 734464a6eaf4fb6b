"""OpenEnv's MCP tool servers (`MCPEnvironment`: OpenEnv's echo_env, finqa_env, ...) driven as tools: the model's
tool calls become the server's `call_tool` actions, their results the tool messages.

Selected by `--env openenv:url=...` when the server's `/schema` says its action is a tool call (a `type` of
`call_tool` or `list_tools`, or a `tool_name` field; `dispatch`, through `rlkit.envs.registry.DISPATCH`), or always by
`--env openenv-mcp:url=...` (no probe). Why both: the probe makes OpenEnv's MCP servers run under the one spec users
already write, and costs one HTTP GET before any model loads; the name runs one without that request (a server behind
a proxy that serves only /ws) and records in the manifest which client ran. Same
connection, sessions, options and errors as `rlkit.envs.openenv` (`OpenEnvMCP` is its subclass), over the same /ws
endpoint, as OpenEnv's own `MCPToolClient` does:

  - `reset`: `{"type": "reset", "data": {"seed": S}}` as for any OpenEnv server, then the session's tools are listed,
    `{"type": "step", "data": {"type": "list_tools"}}` (a server whose action class takes only calls is asked with
    the MCP JSON-RPC message `{"type": "mcp", "data": {"method": "tools/list", ...}}` instead); their JSON schemas go
    to the chat template as `tools=` (`tool_schemas()`). The prompt: the reset observation's text as a user message
    (through the chat template, with the tools); an example from `--prompts` keeps its own prompt (then the server's
    reset text, when it has one). A server whose reset observation carries no text (OpenEnv's echo_env: `{}`) needs
    `--prompts`: one line says so.
  - a model turn with a call (`rlkit.envs.tools.CALL_FORMATS`: `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` or `<call>NAME(ARGS)</call>`; positional arguments take the schema's parameters in order) is sent as
    `{"type": "step", "data": {"type": "call_tool", "tool_name": NAME, "arguments": {...}}}`; the result's text
    (its `content` texts, joined) comes back as `[{"role": "tool", "content": ...}]`, or `error: ...` (an unknown
    tool, bad arguments, a tool that failed, a call that cannot be parsed: the model may retry). A result longer than
    `max_output_chars` (1000) is cut and marked.
  - rewards: each step's `reward` (null: 0.0), the trajectory's the sum; a `done` step ends the trajectory
    (terminated). A turn without a call is the final answer: the episode ends there (terminated) with reward 0 from
    the server (it is not told); `--task`'s verifier and `--reward-fn` score that turn, as for `rlkit.envs.Tools`. An
    MCP server that pays no reward (echo_env) needs one of those for a learning signal.
"""

from __future__ import annotations

import json
import urllib.request

from rlkit.envs.base import EnvError, Step
from rlkit.envs.openenv import OpenEnv
from rlkit.envs.tools import CALL_FORMATS, parse_call
from rlkit.errors import RlkitError

MAX_OUTPUT_CHARS = 1000


def _http_url(ws_url: str) -> str:
    """The server's base http(s):// URL from its /ws endpoint."""
    base = "http" + ws_url[2:] if ws_url.startswith("ws") else ws_url
    return base.removesuffix("/").removesuffix("/ws")


def is_mcp_server(ws_url: str, timeout: float) -> bool:
    """Whether the OpenEnv server at `ws_url` takes tool calls as its actions (its `/schema`'s action is OpenEnv's
    `CallToolAction`/`ListToolsAction` or a subclass). A server that does not answer is not (the text client then
    reports why it cannot connect)."""
    try:
        with urllib.request.urlopen(_http_url(ws_url) + "/schema", timeout=min(timeout, 10.0)) as r:
            schema = json.loads(r.read(4 << 20))
    except (OSError, ValueError):
        return False
    action = schema.get("action") if isinstance(schema, dict) else None
    if not isinstance(action, dict):
        return False
    defs = action.get("$defs") if isinstance(action.get("$defs"), dict) else {}
    # the action itself, or the members of a union of actions (agent_world_model_env's ListToolsAction | CallToolAction)
    members = [action, *(m for k in ("oneOf", "anyOf") for m in action.get(k) or () if isinstance(m, dict))]
    for m in members:
        ref = m.get("$ref")
        if isinstance(ref, str):
            m = defs.get(ref.rsplit("/", 1)[-1], {})
        props = m.get("properties") if isinstance(m, dict) else None
        kind = props.get("type") if isinstance(props, dict) else None
        if isinstance(props, dict) and ("tool_name" in props or (isinstance(kind, dict) and kind.get("const") in
                                                                  ("call_tool", "list_tools"))):
            return True
    return False


def dispatch(cls, options: dict):
    """The class `--env openenv:...` runs: `OpenEnvMCP` when the server is an MCP tool server, else None (`cls`)."""
    env = cls(**options)
    if issubclass(cls, OpenEnvMCP) or not is_mcp_server(env.url, env.timeout):
        return None
    OpenEnvMCP._refuse_action_options(env)
    return OpenEnvMCP


class OpenEnvMCP(OpenEnv):
    """An OpenEnv MCP tool server's environment, one WebSocket session per trajectory (see the module docstring)."""

    stop = tuple(f.close for f in CALL_FORMATS.values())  # a turn ends at a call's closing tag, as a Tools turn
    max_output_chars = MAX_OUTPUT_CHARS
    tool_calls = 0
    tool_errors = 0

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Before any model loads: the options (no connection is made: `openenv-mcp` names the kind of server)."""
        cls._refuse_action_options(cls(**options))

    @staticmethod
    def _refuse_action_options(env: OpenEnv) -> None:
        if env.fixed or env.action_field != "message":
            raise RlkitError(f"environment openenv {env.url} is an MCP tool server: its actions are the model's tool "
                             "calls, so action= and action.KEY=VALUE do not apply")

    # -- the protocol ------------------------------------------------------------------------------------------------
    def reset(self, example):
        self.tool_calls = self.tool_errors = 0
        self.tools: list[dict] = []
        self._reset_data: dict = {}
        own = str(example.prompt).startswith(f"openenv {self.url} seed ")  # iter_examples' own: the server's prompt
        self.where = f"environment openenv (MCP) {self.url}"
        super().reset(example)  # connects, resets (OpenEnv.reset passes the reply through _text, below)
        text = self._reset_text
        self.tools = self._list_tools()
        said = _has_text(self._reset_data.get("observation"))
        if not own:  # a --prompts row: its prompt, then the server's reset text when it has one
            prompt = str(example.prompt)
            return prompt + ("\n" if prompt and said and not prompt.endswith("\n") else "") + (text if said else "")
        if not said:
            raise EnvError(f"{self.where}: the server's reset observation has no text to prompt with (it is "
                           f"{json.dumps(self._reset_data.get('observation'))[:80]}); give the prompts with --prompts "
                           "FILE", every_trajectory=True)
        return [{"role": "user", "content": text}]

    def _text(self, data: dict, *args, **kwargs) -> str:
        """OpenEnv's text of an observation, kept with the reply for `reset` above (which builds its own prompt)."""
        self._reset_data = data
        self._reset_text = super()._text(data, *args, **kwargs)
        return self._reset_text

    def tool_schemas(self) -> tuple[dict, ...]:
        """The session's tools as the chat template's `tools=` (OpenAI's function form)."""
        return tuple({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                       "parameters": t.get("input_schema") or {"type": "object"}}}
                     for t in self.tools)

    def step(self, action: str) -> Step:
        if self.ws is None:
            raise EnvError("environment openenv: step() before reset()")
        call = parse_call(action)
        if call is None:  # the final answer: the episode ends (the task's verifier and --reward-fn score it)
            return Step(None, 0.0, terminated=True)
        self.tool_calls += 1
        if call.error is not None:
            return self._tool_message(f"error: {call.error}", ok=False)
        tool = next((t for t in self.tools if t.get("name") == call.name), None)
        if tool is None:
            return self._tool_message(f"error: unknown tool {call.name!r}; tools: "
                                      f"{', '.join(str(t.get('name')) for t in self.tools)}", ok=False)
        arguments = dict(call.kwargs)
        if call.args:
            names = list((tool.get("input_schema") or {}).get("properties") or {})
            if len(call.args) > len(names):
                return self._tool_message(f"error: {call.name}: {len(call.args)} positional arguments; its parameters "
                                          f"are {', '.join(names) or 'none'} (pass them by name)", ok=False)
            arguments.update(zip(names, call.args, strict=False))  # the first len(args) parameters
        data = self._call({"type": "step", "data": {"type": "call_tool", "tool_name": call.name,
                                                     "arguments": arguments}})
        reward = data.get("reward")
        if reward is None or isinstance(reward, bool):
            reward = float(bool(reward))
        if data.get("done"):
            return Step(None, reward, terminated=True)
        ok, text = _result_text(data.get("observation"))
        return self._tool_message(text, ok, reward)

    def _tool_message(self, text: str, ok: bool, reward: float = 0.0) -> Step:
        if not ok:
            self.tool_errors += 1
        n = self.max_output_chars
        if len(text) > n:
            text = f"{text[:n]}...[{len(text) - n} characters cut]"
        return Step([{"role": "tool", "content": text}], reward)

    def _list_tools(self) -> list[dict]:
        try:
            tools = self._call({"type": "step", "data": {"type": "list_tools"}}).get("observation", {}).get("tools")
        except EnvError as e:
            if "VALIDATION_ERROR" not in str(e):
                raise
            tools = self._rpc_tools()  # an action class that takes only calls (finqa_env's): MCP's own tools/list
        if not isinstance(tools, list) or not tools:
            obs = self._reset_data.get("observation")
            said = f"; its reset answered {json.dumps(obs)[:160]}" if obs else ""
            raise EnvError(f"{self.where}: the server lists no tools{said}", every_trajectory=True)
        return [{"name": t.get("name"), "description": t.get("description"),
                 "input_schema": t.get("input_schema", t.get("inputSchema"))} for t in tools if isinstance(t, dict)]

    def _rpc_tools(self):
        try:
            self.ws.send(json.dumps({"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "id": 1}}))
            reply = json.loads(self.ws.recv(timeout=self.timeout))
        except Exception as e:  # noqa: BLE001 (a closed socket, a timeout, not JSON: one line)
            raise EnvError(f"{self.where}: tools/list failed ({type(e).__name__}: {str(e)[:120]})") from None
        result = (reply.get("data") or {}).get("result") if isinstance(reply, dict) else None
        if not isinstance(result, dict):
            raise EnvError(f"{self.where}: the answer to tools/list has no result: {json.dumps(reply)[:160]}")
        return result.get("tools")


def _has_text(obs) -> bool:
    if isinstance(obs, str):
        return bool(obs.strip())
    if isinstance(obs, dict):
        return any(_has_text(v) for v in obs.values())
    if isinstance(obs, list):
        return any(_has_text(v) for v in obs)
    return False


def _result_text(obs) -> tuple[bool, str]:
    """(ok, text) of a call_tool observation: the result's text contents joined, or `error: ...`."""
    if not isinstance(obs, dict):
        return False, f"error: the server's answer has no tool result: {json.dumps(obs)[:200]}"
    err = obs.get("error")
    if err:
        msg = err.get("message") if isinstance(err, dict) else err
        return False, f"error: {msg}"
    result = obs.get("result")
    if isinstance(result, dict):
        texts = [c.get("text", "") for c in result.get("content") or () if isinstance(c, dict) and c.get("type") ==
                 "text"]
        if texts:
            text = "\n".join(texts)
        elif "data" in result:
            text = result["data"] if isinstance(result["data"], str) else json.dumps(result["data"])
        else:
            text = json.dumps(result)
        if result.get("is_error") or result.get("isError"):
            return False, f"error: {text}"
        return True, text
    return True, result if isinstance(result, str) else json.dumps(result)
