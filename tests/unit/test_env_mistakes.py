"""What a user of `--env` sees when something is wrong: the spec check's refusals before any model loads (a class
with `reset(example)` and no `step`, methods that cannot take what rlkit passes them), how the driver calls an
environment's methods (`rlkit.envs.base.call_env`: `sys.exit()` inside one, a call that does not fit its signature)
and words a failure (`failure_line`: no `--env-errors end` suggestion for an error every trajectory meets, such as a
refused connection), a prompt too long for the model's context (`prompt_too_long`: textarena names `prompt=TEXT`),
OpenEnv's URL forms, and `--max-new-tokens` under `--env` in the help."""

from __future__ import annotations

import socket
import sys

import pytest

from rlkit.envs import EnvError, get_env
from rlkit.envs.base import ENV_ERRORS_END, call_env, every_trajectory, failure_line, prompt_too_long
from rlkit.errors import RlkitError
from rlkit.tasks import Example

from conftest import one_error_line, run_cli_inproc

EX = Example("p0", "2+2=", "4", "train")

ENVS = '''
class Half:
    """rlkit's reset(example), but no step: neither an rlkit environment nor a TRL class."""

    def reset(self, example):
        return example.prompt


class NoExample:
    def reset(self):
        return "2+2="

    def step(self, action):
        return None, 0.0, True


class NoAction:
    def reset(self, example):
        return example.prompt

    def step(self):
        return None, 0.0, True


class Fine:
    def reset(self, example, seed=None):
        return example.prompt

    @staticmethod
    def step(action, *more):
        return None, 0.0, True
'''


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    f = tmp_path_factory.mktemp("envs") / "envs.py"
    f.write_text(ENVS)
    return f


# -- the spec check ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("cls", "says"), [
    ("Half", "environment Half has reset(example) but no step(); a TRL class takes reset(**row)"),
    ("NoExample", "environment NoExample: reset() cannot take the example rlkit passes it; an environment's methods "
                  "are reset(self, example) and step(self, action)"),
    ("NoAction", "environment NoAction: step() cannot take the action rlkit passes it"),
])
def test_classes_that_cannot_run_are_refused_at_the_spec_check(envs, cls, says):
    with pytest.raises(RlkitError) as e:
        get_env(f"{envs}:{cls}")
    assert says in str(e.value) and "\n" not in str(e.value)
    # signatures that take the arguments (a default, *args, a static step) pass, as do the built-in environments
    assert get_env(f"{envs}:Fine").name == "Fine" and get_env("calc") and get_env("guess")


def test_a_half_class_is_refused_before_the_model_loads(envs, sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{envs}:Half", "--num-prompts", "2",
                       "--out", str(out))
    line = one_error_line(r)
    assert r.returncode == 2 and "has reset(example) but no step(); a TRL class takes reset(**row)" in line, line
    assert not out.exists() and "device" not in r.stderr.decode()  # refused before the model loaded


# -- how a method is called ----------------------------------------------------------------------------------------

class Exits:
    def reset(self, example):
        return example.prompt

    def step(self, action):
        sys.exit(3)


def test_sys_exit_in_a_method_is_an_environment_error_naming_the_class_and_method():
    with pytest.raises(EnvError) as e:
        call_env("Exits", "step", Exits().step, "4")
    assert str(e.value) == "environment Exits: step() called sys.exit(3)"
    # one trajectory's failure: the line (the driver adds the row) suggests ending such trajectories instead
    assert not every_trajectory(e.value)
    line = failure_line(f"{e.value} on prompt 'p0' sample 0", e.value)
    assert line == f"environment Exits: step() called sys.exit(3) on prompt 'p0' sample 0{ENV_ERRORS_END}"
    assert call_env("Exits", "reset", Exits().reset, EX) == "2+2="


def test_a_call_that_does_not_fit_the_signature_meets_every_trajectory():
    class OldStyle:
        def reset(self):
            return "x"

    with pytest.raises(EnvError) as e:
        call_env("OldStyle", "reset", OldStyle().reset, EX)
    assert "environment OldStyle: reset() cannot be called with 1 argument" in str(e.value)
    assert "its signature is reset()" in str(e.value)
    assert every_trajectory(e.value) and failure_line(str(e.value), e.value) == str(e.value)

    class Inside:  # a TypeError raised inside the method is the method's own: as raised
        def step(self, action):
            return action + 1

    with pytest.raises(TypeError, match="can only concatenate str"):
        call_env("Inside", "step", Inside().step, "x")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_does_not_suggest_env_errors_end():
    pytest.importorskip("websockets")
    port = _closed_port()
    env = get_env(f"openenv:url=ws://127.0.0.1:{port}/ws").make()
    with pytest.raises(EnvError) as e:
        env.reset(EX)
    line = f"{e.value} on prompt 'p0' sample 0"
    assert "cannot connect (ConnectionRefusedError" in line and failure_line(line, e.value) == line

    class Client:  # a user's environment whose client library wraps the refusal in an error of its own
        def reset(self, example):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError as err:
                raise RuntimeError("the service is down") from err

    with pytest.raises(RuntimeError) as e2:
        call_env("Client", "reset", Client().reset, EX)
    assert every_trajectory(e2.value) and failure_line("x", e2.value) == "x"
    # a trajectory's own failure keeps the suggestion; a line that already names --env-errors gets none
    assert failure_line("x", ValueError("a bad move")) == "x" + ENV_ERRORS_END
    assert failure_line("raise --env-timeout or --env-errors end", None) == "raise --env-timeout or --env-errors end"


# -- a prompt too long, OpenEnv's URL ------------------------------------------------------------------------------

def test_a_prompt_too_long_for_the_context_names_textarenas_prompt_option():
    pytest.importorskip("textarena")
    spec = get_env("textarena:game=GuessTheNumber-v0")
    line = str(prompt_too_long(spec, "prompt 'train-0-0' sample 0", 412, 256))
    assert line.startswith("environment TextArena: reset()'s prompt for prompt 'train-0-0' sample 0 is 412 tokens; "
                           "the model's context is 256, with no room left to generate; give a shorter prompt")
    assert "--env textarena:game=GuessTheNumber-v0,prompt=TEXT" in line
    given = get_env("textarena:game=GuessTheNumber-v0,prompt=Guess 1-20 as [N]:")
    assert "the prompt=TEXT given is too long" in str(prompt_too_long(given, "x", 300, 256))
    plain = str(prompt_too_long(get_env("guess"), "x", 300, 256))  # no hint of its own: the line alone
    assert plain.endswith("with no room left to generate")


def test_openenv_http_urls_name_the_ws_endpoint_once():
    pytest.importorskip("websockets")
    for url, endpoint in (("http://127.0.0.1:8000/ws", "ws://127.0.0.1:8000/ws"),
                          ("http://127.0.0.1:8000/ws/", "ws://127.0.0.1:8000/ws"),
                          ("https://envs.example/echo/ws", "wss://envs.example/echo/ws"),
                          ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),  # the server's URL: its /ws
                          ("https://envs.example/echo", "wss://envs.example/echo/ws"),
                          ("ws://127.0.0.1:8000/ws", "ws://127.0.0.1:8000/ws")):
        assert get_env(f"openenv:url={url}").make().url == endpoint, url


# -- the help ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["rollout", "eval"])
def test_max_new_tokens_help_says_per_turn_under_env(stage):
    r = run_cli_inproc(stage, "--help", env={"COLUMNS": "400"})
    text = " ".join(r.stdout.decode().split())
    assert r.returncode == 0 and "under --env, the longest model turn (per turn; a whole trajectory is " \
                                 "--max-total-tokens)" in text
