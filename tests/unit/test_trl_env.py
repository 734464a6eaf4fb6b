"""A class written for TRL's `GRPOTrainer(environment_factory=...)` under rlkit's environment protocol, unchanged:
`reset(**row)`, its public methods as tools, the reward read from the instance (`get_reward()` or `reward`)."""

from __future__ import annotations

import json

import pytest

from rlkit.envs import EnvError, get_env
from rlkit.errors import RlkitError
from rlkit.tasks import Example

ENVS = '''
import random


class IncrementEnv:
    """TRL's documentation's example (grpo_trainer.md, "Providing an external dataset"), verbatim but the trainer."""

    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class WordleLike:
    """TRL's OpenEnv Wordle example's shape: reset returns the first feedback, a `reward` attribute, a tool that
    raises to say the game is over."""

    def __init__(self, word: str = "crane"):
        self.word = word

    def reset(self, **kwargs) -> str | None:
        self.reward = 0.0
        self.done = False
        self.tries = 0
        return "\\nGuess the 5-letter word."

    def guess(self, guess: str) -> str:
        """
        Make a guess.

        Args:
            guess: The guessed word.
        """
        if self.done:
            raise ValueError("Game over.")
        self.tries += 1
        if guess == self.word:
            self.reward, self.done = 1.0, True
            return "correct"
        return "".join("G" if a == b else "Y" if a in self.word else "_" for a, b in zip(guess, self.word))

    def _private(self):
        return "not a tool"


class NoReward:
    def reset(self, **kwargs):
        return None

    def noop(self) -> str:
        """Nothing."""
        return "ok"


class AsyncTool:
    def reset(self, **kwargs):
        self.fetched = []
        return None

    def get_reward(self) -> float:
        return float(len(self.fetched))

    async def fetch(self, url: str) -> str:
        """Fetch."""
        import asyncio

        await asyncio.sleep(0.01)
        if url == "bad":
            raise ConnectionError("unreachable")
        self.fetched.append(url)
        return f"<page {url}>"
'''


@pytest.fixture
def envs(tmp_path):
    p = tmp_path / "trl_envs.py"
    p.write_text(ENVS)
    return p


def _call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_increment_env_from_trls_docs(envs):
    spec = get_env(f"{envs}:IncrementEnv")
    assert spec.name == "IncrementEnv" and "</tool_call>" in spec.attribute("stop")
    env = spec.make()
    assert set(env.functions) == {"increment"}  # public methods but reset and get_reward
    # the row's extra columns travel in the answer as a JSON object: target=3 reaches reset(target=...)
    ex = Example("p0", "Increment the counter to 3.", json.dumps({"target": 3}), "train")
    assert env.reset(ex) == ex.prompt  # reset returned None: the prompt unchanged
    s = env.step(_call("increment", step=2))
    assert s.observation == [{"role": "tool", "content": "2"}] and not s.terminated and s.reward == 0.0
    assert env.step("<call>increment(1)</call>").observation == [{"role": "tool", "content": "3"}]
    end = env.step("Done: the counter is 3.")  # no tool call: the episode ends, scored by get_reward()
    assert end.terminated and end.reward == 1.0 and env.tool_calls == 2
    env2 = spec.make()
    env2.reset(ex)
    env2.step(_call("increment", step=5))
    assert env2.step("done").reward == 0.0


def test_reward_attribute_errors_fed_back_and_private_methods_hidden(envs):
    env = get_env(f"{envs}:WordleLike:word=crane").make()
    assert set(env.functions) == {"guess"}
    ex = Example("p0", "Play.", "x", "train")
    assert env.reset(ex) == "Play.\nGuess the 5-letter word."  # reset's text appended, no separator added
    assert env.step(_call("guess", guess="caret")).observation[0]["content"] == "GYYY_"
    assert env.step(_call("guess", guess="crane")).observation[0]["content"] == "correct"
    over = env.step(_call("guess", guess="crane"))  # the tool raises: its error is the model's observation
    assert over.observation[0]["content"] == "error: guess raised ValueError: Game over." and env.tool_errors == 1
    bad = env.step(_call("guess", guess=5))  # arguments checked against the annotations
    assert "argument guess must be a str" in bad.observation[0]["content"]
    unknown = env.step(_call("_private"))
    assert "unknown tool '_private'" in unknown.observation[0]["content"]
    assert env.step("I won.").reward == 1.0  # the `reward` attribute, read at the end


def test_misfits_are_one_line(envs):
    env = get_env(f"{envs}:NoReward").make()
    env.reset(Example("p0", "x", "1", "train"))
    with pytest.raises(EnvError, match="NoReward has neither get_reward\\(\\) nor a reward attribute"):
        env.step("no call")
    with pytest.raises(RlkitError, match="unknown option 'colour'"):
        get_env(f"{envs}:WordleLike:colour=red")


def test_async_tools_are_awaited(envs):
    """TRL awaits async tools: so does rlkit (step gives a coroutine, which the driver awaits on its event loop)."""
    import asyncio

    spec = get_env(f"{envs}:AsyncTool")
    assert [t["function"]["name"] for t in spec.tool_schemas()] == ["fetch"]
    env = spec.make()
    env.reset(Example("p0", "x", "1", "train"))
    s = asyncio.run(env.step(_call("fetch", url="a.org")))
    assert s.observation == [{"role": "tool", "content": "<page a.org>"}] and env.tool_calls == 1
    bad = asyncio.run(env.step(_call("fetch", url="bad")))  # its failure is fed back, as a plain tool's
    assert bad.observation[0]["content"] == "error: fetch raised ConnectionError: unreachable" and env.tool_errors == 1
    end = env.step("done")  # no call: get_reward() (plain) ends it
    assert end.terminated and end.reward == 1.0


def test_tool_schemas_are_transformers_get_json_schema_as_trl_builds_them(envs):
    from transformers.utils import get_json_schema

    spec = get_env(f"{envs}:IncrementEnv")
    env = spec.make()
    env.reset(Example("p0", "x", json.dumps({"target": 1}), "train"))
    (schema,) = spec.tool_schemas()
    assert schema == get_json_schema(env.inner.increment)  # the bound method, as TRL passes it
    assert schema["function"]["name"] == "increment" and schema["function"]["parameters"]["properties"] == {
        "step": {"type": "integer", "description": "Value to add to the counter."}}
    assert list(env.tool_schemas()) == spec.tool_schemas()
    # a method transformers cannot describe (no docstring): its name, no parameters; a plain class: no schemas
    (plain,) = get_env(f"{envs}:NoReward").tool_schemas()
    assert plain["function"]["name"] == "noop" and plain["function"]["description"] == "Nothing."
    assert get_env("guess").tool_schemas() is None
