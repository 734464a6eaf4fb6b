"""How the OpenEnv adapter reads a server's observation and words what the server sends, without a server: `text=`
paths (`messages[-1].content`), the messages new since the last observation in the shapes OpenEnv's servers send them
(one message holding the whole transcript, a list that grows, each step's messages alone), the server's echo of the
model's own turn, `reset.KEY=VALUE` values, and the reasons of a VALIDATION_ERROR. The same against real servers:
tests/e2e/test_ecosystem_envs.py."""

from __future__ import annotations

import pytest

from rlkit.envs import get_env
from rlkit.envs.openenv import (
    at_path,
    drop_echo,
    joined,
    keeps_history,
    messages_of,
    new_messages,
    option_value,
    parse_path,
    validation_detail,
)
from rlkit.errors import RlkitError

from conftest import one_error_line, run_cli_inproc


@pytest.mark.parametrize("path, steps", [
    ("prompt", ("prompt",)),
    ("messages[-1].content", ("messages", -1, "content")),
    ("info.hint[0][2]", ("info", "hint", 0, 2)),
    ("board state", ("board state",)),
])
def test_text_paths_parse(path, steps):
    assert parse_path(path) == steps


@pytest.mark.parametrize("path", ["", "[0]", "messages[", "messages[x]", "a..b", "a.", ".a", "a.[0]", "a[1.5]"])
def test_bad_text_paths_are_refused(path):
    with pytest.raises(RlkitError, match=r"expected a path into the observation: field names joined by dots and "
                                         r"integer indices in brackets, e\.g\. text=feedback"):
        parse_path(path)


def test_a_path_reads_nested_fields_and_says_where_it_ends():
    obs = {"prompt": "GuessTheNumber-v0", "messages": [{"content": "rules"}, {"content": "higher"}], "turn": 2}
    assert at_path(obs, parse_path("messages[-1].content")) == "higher"
    assert at_path(obs, parse_path("messages[0]")) == {"content": "rules"}
    for path, says in [("messages[2].content", "messages has 2 items"),
                       ("messages[-1].text", "messages[-1] has no field 'text'; it has content"),
                       ("turn.count", "turn is a number, not an object"),
                       ("prompt[0]", "prompt is a text, not a list"),
                       ("feedback", "the observation has no field 'feedback'; it has prompt, messages, turn")]:
        with pytest.raises(LookupError, match=says.replace("[", r"\[").replace("]", r"\]")):
            at_path(obs, parse_path(path))


def test_messages_are_objects_with_text_content_or_strings():
    assert messages_of([{"sender_id": -1, "content": "a", "category": "MESSAGE"}, "b"]) == [("", "a"), ("", "b")]
    assert messages_of([{"role": "system", "content": "be brief"}]) == [("system", "be brief")]
    assert messages_of([{"content": 3}]) is None and messages_of("text") is None and messages_of([]) == []


def test_the_new_messages_of_each_shape():
    rules = ("", "\n[GAME] Guess 1-20.")
    # OpenEnv's textarena server, textarena's default wrappers: one message, the transcript grows by lines
    grown = ("", rules[1] + "\n[Player] [5]\n[GAME] The target number is higher.")
    assert keeps_history([rules], [grown])
    assert new_messages([rules], [grown], True) == [("", "\n[Player] [5]\n[GAME] The target number is higher.")]
    # a list that grows (OpenEnv's chat server): the appended messages
    chat = [("system", "be brief"), ("user", "2+2?")]
    more = [*chat, ("assistant", "4"), ("user", "right")]
    assert keeps_history(chat, more) and new_messages(chat, more, True) == more[2:]
    assert new_messages(more, more, True) == []  # nothing said
    # each step's messages alone (textarena's -raw ids): all of them, even when they repeat the last step's
    step = [("", "[5]"), ("", "The target number is higher.")]
    assert not keeps_history([rules], step)
    assert new_messages(step, step, False) == step
    # a message replaced by another that merely starts like it (not grown by lines) is new as a whole
    assert new_messages([("", "Score: 1")], [("", "Score: 10")], True) == [("", "Score: 10")]


def test_the_echo_of_the_model_turn_is_dropped():
    assert drop_echo("\n[Player] [5]\n[GAME] The target number is higher.", "[5]") == \
        "[GAME] The target number is higher."
    assert drop_echo("[5]", "[5]\n") == "" and drop_echo("I think [5]", "I think [5]") == ""
    assert drop_echo("\n[Player] \n[GAME] Invalid move.", "  ") == "[GAME] Invalid move."
    # anything else stays: the game's own words, a turn the server did not echo first
    assert drop_echo("[GAME] [5] is too low", "[5]") == "[GAME] [5] is too low"
    assert drop_echo("The target number is higher.", "[5]") == "The target number is higher."


def test_texts_are_joined_a_line_each_and_a_repeated_prompt_once():
    assert joined(["\n[GAME] Guess.", "", "  "]) == "[GAME] Guess."
    assert joined(["Guess.", "\n[GAME] Guess."], once=True) == "[GAME] Guess."  # the prompt its message repeats
    assert joined(["Q", "Q", "hint"], once=True) == "Q\nhint"
    assert joined(["higher", "The target number is higher."]) == "higher\nThe target number is higher."


@pytest.mark.parametrize("text, value", [("3", 3), ("-1.5", -1.5), ("true", True), ("false", False), ("null", None),
                                         ("[1, 2]", [1, 2]), ('"5"', "5"), ("gsm8k", "gsm8k"), ("hard mode", "hard mode"),
                                         ("", "")])
def test_reset_option_values_are_json_where_they_parse(text, value):
    v = option_value(text)
    assert v == value and type(v) is type(value)


def test_reset_options_are_typed_and_other_options_refused():
    env = get_env("openenv:url=ws://127.0.0.1:1/ws,reset.size=3,reset.hard=true,reset.dataset=gsm8k").make()
    assert env.reset_options == {"size": 3, "hard": True, "dataset": "gsm8k"}
    with pytest.raises(RlkitError, match="unknown option 'size' for environment openenv; it takes .*action.KEY=VALUE "
                                         "and reset.KEY=VALUE"):
        get_env("openenv:url=ws://127.0.0.1:1/ws,size=3")


def test_a_bad_text_path_is_one_line_before_the_model_loads(tmp_path):
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(tmp_path / "none"), "--env",
                       "openenv:url=ws://127.0.0.1:1/ws,text=messages[last].content", "--out", str(out))
    line = one_error_line(r)
    assert r.returncode == 2 and "text='messages[last].content': expected a path into the observation" in line
    assert not out.exists()


def test_a_validation_error_names_each_field_and_its_reason():
    # what openenv-core's server sends (pydantic's ValidationError.errors()) for a strict action
    errors = [{"type": "literal_error", "loc": ["direction"], "msg": "Input should be 'UP', 'DOWN', 'LEFT' or 'RIGHT'",
               "input": "up\n", "ctx": {"expected": "'UP', 'DOWN', 'LEFT' or 'RIGHT'"}},
              {"type": "extra_forbidden", "loc": ["colour"], "msg": "Extra inputs are not permitted", "input": "red"},
              {"type": "missing", "loc": ["message"], "msg": "Field required", "input": {"direction": "up\n"}},
              {"type": "int_parsing", "loc": ["moves", 0, "row"], "msg": "Input should be a valid integer",
               "input": "x"}]
    assert validation_detail(errors) == ("direction: Input should be 'UP', 'DOWN', 'LEFT' or 'RIGHT' (got \"up\\n\"); "
                                         "colour: Extra inputs are not permitted (got \"red\"); "
                                         "message: Field required; and 1 more")
    assert validation_detail(errors[3:]) == 'moves[0].row: Input should be a valid integer (got "x")'
    assert validation_detail(None) == "" and validation_detail("bad") == ""


def test_the_default_text_of_each_observation_shape():
    """What the adapter shows of observations as OpenEnv's servers send them (the `data` of an observation message)."""
    env = get_env("openenv:url=ws://127.0.0.1:1/ws").make()

    def show(obs, action=None):
        return env._text({"observation": obs, "reward": None, "done": False}, action)

    # the chat server's shape: a list that grows, the model's own message among it
    sys_msg = {"role": "system", "content": "Answer briefly."}
    assert show({"messages": [sys_msg, {"role": "user", "content": "2+2?"}], "tokens": [1, 2]}) == \
        "Answer briefly.\n2+2?"
    assert show({"messages": [sys_msg, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                              {"role": "user", "content": "Right. 3+3?"}], "tokens": []}, "4") == "Right. 3+3?"
    # textarena's server: the rules in `prompt` and in the first message, once; then the transcript's new lines
    rules = "\n[GAME] Guess 1-20."
    env._episode()
    assert show({"prompt": "Guess 1-20.", "messages": [{"sender_id": -1, "content": rules, "category": "MESSAGE"}]}) \
        == "[GAME] Guess 1-20."
    assert env.chosen == "the new messages of the observation's messages"
    step = {"prompt": "GuessTheNumber-v0", "messages": [{"sender_id": -1, "content": rules + "\n[Player] [5]\n[GAME] "
                                                          "The target number is higher.", "category": "MESSAGE"}]}
    assert show(step, "[5]") == "[GAME] The target number is higher."
    # no messages: the first non-empty of prompt, message, text, content, then any text field, then JSON
    env._episode()
    assert show({"prompt": "", "feedback": "yes"}) == "yes" and env.chosen == "the observation's feedback"
    assert show({"board": [[0, 1]]}, "x") == '{"board":[[0,1]]}'
    # text=: a nested field as it is; a path to a list of messages is read as messages
    env = get_env("openenv:url=ws://127.0.0.1:1/ws,text=info.hint").make()
    assert show({"info": {"hint": "warmer"}}) == "warmer" and env.chosen == "text=info.hint"
    env = get_env("openenv:url=ws://127.0.0.1:1/ws,text=history").make()
    assert show({"history": []}) == ""
    assert show({"history": ["You are in a maze."]}, "go north") == "You are in a maze."
