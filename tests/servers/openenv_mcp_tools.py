"""A real OpenEnv MCP tool server for the openenv adapter's tests: an `MCPEnvironment` subclass with two fastmcp tools
(as OpenEnv's echo_env), served by the package's own app (`create_app` with `CallToolAction`, as echo_env is) under
uvicorn on 127.0.0.1.

    python tests/servers/openenv_mcp_tools.py PORT [MAX_CONCURRENT_ENVS [quiet|calls-only|union]]

The game: reset(seed) asks for the sum of two numbers drawn from the seed ("Add 3 and 4, then submit the sum.").
`add(a, b)` returns a + b (no reward); `submit(answer)` ends the episode with reward 1.0 when `answer` is the sum,
else 0.0 (as finqa_env's submit_answer). With QUIET (a third argument `quiet`), reset's observation carries no text (as
echo_env's: `{}`), so the prompts must come from elsewhere. With `calls-only`, the app's action class is a subclass of
`CallToolAction` (as finqa_env's), which takes no `list_tools` step: the tools are listed by MCP's JSON-RPC message.
With `union`, the action class is the union `ListToolsAction | CallToolAction` (as agent_world_model_env's), whose
/schema lists both.
"""

from __future__ import annotations

import random
import sys
import uuid
from typing import Annotated, Any

from fastmcp import FastMCP
from openenv.core.env_server import Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

QUIET = False


class PromptObservation(Observation):
    prompt: str = ""


class SumState(State):
    a: int = 0
    b: int = 0


class AddAndSubmit(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("add_and_submit")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """
            Add two integers.

            Args:
                a: The first integer
                b: The second integer
            """
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """
            Submit the final answer (ends the episode).

            Args:
                answer: The sum
            """
            return "submitted"

        super().__init__(mcp)
        self._state = SumState(episode_id=str(uuid.uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        self._state = SumState(episode_id=episode_id or str(uuid.uuid4()), a=rng.randint(1, 9), b=rng.randint(1, 9))
        if QUIET:
            return Observation(done=False, reward=0.0)
        return PromptObservation(prompt=f"Add {self._state.a} and {self._state.b}, then submit the sum.", done=False,
                                 reward=0.0)

    def _step_impl(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "only tool calls"})

    def _scored(self, action, obs: Observation) -> Observation:
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            right = action.arguments.get("answer") == self._state.a + self._state.b
            return Observation(done=True, reward=1.0 if right else 0.0)
        return obs

    def step(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    @property
    def state(self) -> SumState:
        return self._state


if __name__ == "__main__":
    import uvicorn

    port, envs = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1
    QUIET = sys.argv[3:4] == ["quiet"]

    class CallsOnly(CallToolAction):
        pass

    from openenv.core.env_server.mcp_types import ListToolsAction
    from openenv.core.env_server.types import Action
    from pydantic import Field, TypeAdapter

    either = TypeAdapter(Annotated[ListToolsAction | CallToolAction, Field(discriminator="type")])

    class Union(Action):  # agent_world_model_env's AWMAction
        @classmethod
        def model_validate(cls, obj: Any, **kwargs: Any) -> Action:
            return either.validate_python(obj)

        @classmethod
        def model_json_schema(cls, **kwargs: Any) -> dict[str, Any]:
            return either.json_schema(**kwargs)

    action = {"calls-only": CallsOnly, "union": Union}.get(sys.argv[3] if len(sys.argv) > 3 else "", CallToolAction)
    app = create_app(AddAndSubmit, action, CallToolObservation, env_name="add_and_submit", max_concurrent_envs=envs)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
