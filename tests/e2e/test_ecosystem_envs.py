"""The ecosystem's environments under `rlkit rollout --env`, on the real tiny model through the real CLI:
an OpenEnv server (a real `openenv` Environment served by the package's own app on 127.0.0.1, spoken to by rlkit's
WebSocket client), textarena's single-player games, and a class written for TRL's `environment_factory`."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlkit.io import streams
from rlkit.io.manifests import read_manifest

from conftest import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "tests" / "servers" / "openenv_echo.py"
SHAPED = REPO / "tests" / "servers" / "openenv_shaped.py"  # OpenEnv's server shapes, one app each under a path
P, N = 3, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """tests/servers/openenv_echo.py (or another server script of tests/servers/, taking PORT SESSIONS [EXTRA]) in a
    process of its own, ready once `health` answers."""

    def __init__(self, sessions: int, peak: Path | None = None, script: Path = SERVER, health: str = "/health",
                 extra: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.port), str(sessions),
                                      *([str(peak)] if peak else []), *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{health}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {self.proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the OpenEnv server did not answer /health within 120 s")
            time.sleep(0.3)
        self.url = f"ws://127.0.0.1:{self.port}/ws"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server():
    s = Server(sessions=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shaped():
    """tests/servers/openenv_shaped.py: `shaped.url + "/guess/ws"` and its other paths."""
    s = Server(sessions=0, script=SHAPED, health="/guess/health")
    s.url = f"ws://127.0.0.1:{s.port}"
    yield s
    s.stop()


def _error_line(r) -> str:
    err = r.stderr.decode()
    lines = err.strip().splitlines()
    assert r.returncode == 2, err[-2000:]
    assert "Traceback" not in err and [x for x in lines if x.startswith("rlkit: error:")] == lines[-1:], lines
    return lines[-1]


def _rows(path: Path) -> list[dict]:
    t, _ = streams.read_table(path, ["rollouts"])
    return t.to_pylist()


def test_openenv_server_trajectories(server, sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    env = f"openenv:url={server.url},stop=\\n,max_new_tokens=4"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", env, "--num-prompts", str(P), "--n", str(N),
                "--max-turns", "5", "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = _rows(out)
    assert len(rows) == P * N
    for row in rows:
        digit = int(row["answer"]) % 10  # the reset seed is the example's answer; the server asks for seed % 10
        assert row["prompt"] == f"Say {digit}:" and row["end_reason"] == "terminated" and row["turns"] == 3
        actions = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        said = [str(digit) in a for a in actions]
        # the server's per-step rewards, summed; its feedback after each turn but the last, masked out
        assert row["turn_rewards"] == [float(x) for x in said] and row["reward/env"] == sum(said)
        feedback = [m["content"] for m in row["messages"] if m["role"] == "user"][1:]
        assert [f.strip() for f in feedback] == ["yes" if x else "no" for x in said[:-1]]
        assert 0 in row["loss_mask"] and 1 in row["loss_mask"]
    # the n samples of a prompt play one episode (one seed); the prompts differ
    assert len({r["answer"] for r in rows}) == P and all(rows[2 * i]["answer"] == rows[2 * i + 1]["answer"]
                                                         for i in range(P))
    from importlib.metadata import version

    manifest = read_manifest(out)
    assert manifest["inputs"]["env"] == f"builtin:openenv+openenv-client websockets=={version('websockets')}"


def test_openenv_http_urls_connect_to_the_ws_endpoint(server):
    """The server's http:// URL, with or without its /ws path, reaches the /ws endpoint (one session each)."""
    from rlkit.envs import get_env
    from rlkit.tasks import Example

    for url in (f"http://127.0.0.1:{server.port}/ws", f"http://127.0.0.1:{server.port}"):
        env = get_env(f"openenv:url={url}").make()
        try:
            assert env.url == server.url and env.reset(Example("train-0-0", "", "3", "train")) == "Say 3:"
        finally:
            env.close()


def test_openenv_failures_are_one_line(server, sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    base = ["--policy", str(sft_dir), "--num-prompts", str(P), "--n", str(N), "--out", str(out)]
    # no server there
    r = run_cli("rollout", "--env", f"openenv:url=ws://127.0.0.1:{_free_port()}/ws", *base)
    line = _error_line(r)
    assert "cannot connect (ConnectionRefusedError" in line and not out.exists()
    assert "--env-errors" not in line  # every trajectory would meet it: ending them all is no remedy
    # the server refuses an action (an extra field its Action forbids): its error, named
    r = run_cli("rollout", "--env", f"openenv:url={server.url},action.colour=red", *base)
    line = _error_line(r)
    assert f"environment openenv {server.url}: the server answered step with an error" in line
    assert "VALIDATION_ERROR" in line and "on prompt " in line and not out.exists()
    # ... or, with --env-errors end, those trajectories end with reward 0 and say why
    r = run_cli("rollout", "--env", f"openenv:url={server.url},action.colour=red", "--env-errors", "end", *base)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rows = _rows(out)
    assert all(x["reward/env"] == 0.0 and x["end_reason"].startswith("error: step") for x in rows)
    out.unlink()
    # bad options: one line before any model loads
    r = run_cli("rollout", "--env", "openenv:url=localhost:8000", *base)
    assert "url='localhost:8000': expected ws://HOST:PORT/ws" in _error_line(r) and not out.exists()
    r = run_cli("rollout", "--env", f"openenv:url={server.url},colour=red", *base)
    assert "unknown option 'colour' for environment openenv" in _error_line(r) and not out.exists()


def test_openenv_sessions_are_capped_at_env_workers(sft_dir, tmp_path):
    """A session per trajectory, at most --env-workers (or max_sessions=N) open at once: the others queue for one. The
    server counts the sessions it serves at once."""
    peak = tmp_path / "peak"
    s = Server(sessions=8, peak=peak)
    try:
        out = tmp_path / "r.arrow"
        base = ["rollout", "--policy", str(sft_dir), "--num-prompts", "3", "--n", "4", "--max-turns", "2", "--seed", "1"]
        r = run_cli(*base, "--env", f"openenv:url={s.url},max_new_tokens=3", "--env-workers", "3", "--out", str(out))
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        assert len(_rows(out)) == 12 and 2 <= int(peak.read_text()) <= 3
    finally:
        s.stop()


def test_openenv_server_at_capacity_is_waited_for_and_gone_mid_trajectory(sft_dir, tmp_path):
    from rlkit.envs import EnvError, get_env

    peak = tmp_path / "peak"
    s = Server(sessions=1, peak=peak)  # OpenEnv's default: one session
    try:
        out = tmp_path / "r.arrow"
        base = ["rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--max-turns", "2",
                "--out", str(out)]
        # 4 trajectories, --env-workers 4: the server refuses all but one session; the others wait for it, in turn
        r = run_cli(*base, "--env", f"openenv:url={s.url},max_new_tokens=3", "--env-workers", "4")
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        assert len(_rows(out)) == 4 and peak.read_text() == "1"
        out.unlink()
        # a session held by another client for longer than timeout=: one line
        env = get_env(f"openenv:url={s.url},timeout=5").make()
        ex = next(env.iter_examples("train", 0))
        for _ in range(40):  # the rollout's sessions end as its sockets close: the one session frees up
            try:
                prompt = env.reset(ex)
                break
            except EnvError as e:
                assert "at capacity" in str(e)
                time.sleep(0.25)
        assert prompt.startswith("Say ")
        r = run_cli(*base, "--env", f"openenv:url={s.url},timeout=2")
        line = _error_line(r)
        assert "the server stayed at capacity" in line and "for 2 s" in line and "max_concurrent_envs" in line, line
        assert "on prompt " in line and not out.exists()
    finally:
        s.stop()
    with pytest.raises(EnvError, match="the server closed the connection during step|step failed"):
        env.step("1")
    env.close()


def _guess_feedback(guess: str, target: int) -> str:
    """What tests/servers/openenv_shaped.py's game says to a guess."""
    m = re.search(r"\d+", guess)
    if m is None:
        return "Invalid move: guess as [N]."
    n = int(m.group())
    if n == target:
        return "Congratulations! You guessed the number."
    return f"You guessed {n}. The target number is {'higher' if n < target else 'lower'}."


@pytest.mark.parametrize("path, tag", [("guess", "[GAME] "), ("guess-raw", "")])
def test_openenv_messages_feedback_reaches_the_model(shaped, path, tag, sft_dir, tmp_path):
    """A server whose feedback is in its messages (OpenEnv's textarena server: the whole transcript in one message, or
    each step's messages alone): the prompt is the rules once, and after each turn the model sees what the game said
    to it, without the echo of its own guess, the transcript again or the `prompt` field (the game's id)."""
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", f"openenv:url={shaped.url}/{path}/ws,stop=\\n,"
                "max_new_tokens=4", "--num-prompts", "2", "--n", "2", "--max-turns", "4", "--seed", "5",
                "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert "warning: environment openenv" not in r.stderr.decode()  # the feedback differs from turn to turn
    rows = _rows(out)
    assert len(rows) == 4
    for row in rows:
        target = int(row["answer"]) % 20 + 1
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        guesses = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert users[0] == tag + "Guess the number between 1 and 20 as [N]."
        assert [u.strip() for u in users[1:]] == [tag + _guess_feedback(g, target) for g in guesses[:-1]]
        won = [_guess_feedback(g, target).startswith("Congratulations") for g in guesses]
        assert row["reward/env"] == float(won[-1]) and not any(won[:-1])


def test_openenv_a_text_that_never_changes_is_warned_about(shaped, sft_dir, tmp_path):
    """text= picks a field that repeats every step (textarena's `prompt`, the game's id): one warning naming the field
    and text=PATH; a path into the messages reaches the newest message's content."""
    out = tmp_path / "r.arrow"
    base = ["rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--max-turns", "4", "--seed", "5"]
    r = run_cli(*base, "--env", f"openenv:url={shaped.url}/guess-raw/ws,stop=\\n,max_new_tokens=4,text=prompt",
                "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    warnings = [x for x in r.stderr.decode().splitlines() if x.startswith("warning: environment openenv")]
    assert len(warnings) == 1, warnings
    assert "appended the same text 'GuessTheNumber-v0-raw' (read from text=prompt)" in warnings[0]
    assert "pick its text with text=PATH" in warnings[0] and "prompt, messages, current_player_id" in warnings[0]
    assert all(u.strip() == "GuessTheNumber-v0-raw" for row in _rows(out)
               for u in [m["content"] for m in row["messages"] if m["role"] == "user"][1:])
    r = run_cli(*base, "--env", f"openenv:url={shaped.url}/guess-raw/ws,stop=\\n,max_new_tokens=4,"
                "text=messages[-1].content", "--out", str(out), "--force")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    for row in _rows(out):
        target = int(row["answer"]) % 20 + 1
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        guesses = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert [u.strip() for u in users[1:]] == [_guess_feedback(g, target) for g in guesses[:-1]]


def test_openenv_one_session_server_runs_a_whole_batch(shaped, sft_dir, tmp_path):
    """A server that serves one session (OpenEnv's default cap; its environment not marked concurrency-safe, so the
    cap cannot be raised) under the default --env-workers: a whole GRPO batch, the trajectories taking the session in
    turn, each one its own game from the start."""
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", f"openenv:url={shaped.url}/guess-one/ws,stop=\\n,"
                "max_new_tokens=4", "--num-prompts", "3", "--n", "4", "--max-turns", "3", "--seed", "2",
                "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = _rows(out)
    assert len(rows) == 12 and len({x["answer"] for x in rows}) == 3
    assert all(len({x["answer"] for x in rows[4 * i:4 * i + 4]}) == 1 for i in range(3))  # a group: one game
    for row in rows:
        target = int(row["answer"]) % 20 + 1
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        guesses = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert row["end_reason"] in ("terminated", "max_turns") and 1 <= len(guesses) <= 3
        assert [u.strip() for u in users[1:]] == ["[GAME] " + _guess_feedback(g, target) for g in guesses[:-1]]


def test_openenv_validation_error_names_the_field_and_the_reason(shaped, sft_dir, tmp_path):
    """A strict action (an enum field) that the model's turn does not fit: the server's own reason, per field."""
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", f"openenv:url={shaped.url}/move/ws,action=direction,"
                "action.speed=fast,max_new_tokens=3", "--num-prompts", "1", "--n", "1", "--out", str(out))
    line = _error_line(r)
    assert f"environment openenv {shaped.url}/move/ws: the server answered step with an error: Invalid message " \
           "(VALIDATION_ERROR): direction: Input should be 'UP', 'DOWN', 'LEFT' or 'RIGHT' (got \"" in line, line
    assert "; speed: Extra inputs are not permitted (got \"fast\")" in line and "on prompt " in line
    assert not out.exists()


def test_openenv_reset_options_and_per_row_reset_arguments(shaped, sft_dir, tmp_path):
    """reset.KEY=VALUE options reach the environment's reset typed (numbers and booleans as JSON); with --prompts, a
    row's columns (a JSON object answer, as TRL's classes get them) reach it too, over the options, and the row's
    prompt comes first, then the server's reset text."""
    out = tmp_path / "r.arrow"
    env = f"openenv:url={shaped.url}/quiz/ws,max_new_tokens=4,reset.size=2,reset.hard=true,reset.topic=mul"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", env, "--num-prompts", "2", "--n", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    prompts = [x["prompt"] for x in _rows(out)]
    assert all(p.startswith("[topic=mul (str) size=2 (int) hard=True (bool)] 1") for p in prompts), prompts
    table = tmp_path / "prompts.jsonl"
    table.write_text("".join(json.dumps({"prompt": p, "answer": json.dumps(a)}) + "\n" for p, a in [
        ("Answer with the number.", {"topic": "add", "size": 3}),
        ("", {"hard": False}),
    ]))
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", env, "--prompts", str(table), "--n", "2",
                "--out", str(out), "--force")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = _rows(out)
    assert len(rows) == 4 and rows[0]["prompt"] == rows[1]["prompt"] and rows[2]["prompt"] == rows[3]["prompt"]
    assert rows[0]["prompt"].startswith("Answer with the number.\n[topic=add (str) size=3 (int) hard=True (bool)] 10")
    assert rows[2]["prompt"].startswith("[topic=mul (str) size=2 (int) hard=False (bool)] 1")


# ---------------------------------------------------------------------------------------------------------------------
# textarena

GUESS = "textarena:game=GuessTheNumber-v0,max_turns=4,stop=\\n,max_new_tokens=6,prompt=Guess 1-20 as [N]:\\n"


def test_textarena_game_trajectories(sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", GUESS, "--num-prompts", str(P), "--n", str(N),
                "--max-turns", "6", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = _rows(out)
    assert len(rows) == P * N
    for row in rows:
        assert row["prompt"] == "Guess 1-20 as [N]:\n" and row["reward/env"] in (0.0, 1.0)
        assert row["end_reason"] == "terminated" and 1 <= row["turns"] <= 5
        users = [m["content"] for m in row["messages"] if m["role"] == "user"][1:]
        # the game's answers (an invalid move's warning, or higher/lower), never the echo of the model's own turn
        assert all("You attempted an invalid move" in u or "The target number is" in u for u in users), users
    from importlib.metadata import version

    assert read_manifest(out)["inputs"]["env"] == f"builtin:textarena+textarena=={version('textarena')}"


def test_textarena_rules_too_long_for_the_context_name_prompt_text(sft_dir, tmp_path):
    """The game's opening message (its rules) does not fit the tiny model's context: the line says to give a
    shorter prompt with prompt=TEXT."""
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", "textarena:game=GuessTheNumber-v0", "--num-prompts",
                str(P), "--out", str(out))
    line = _error_line(r)
    assert "reset()'s prompt for prompt " in line and "the model's context is" in line, line
    assert "prompt=TEXT" in line and "textarena:game=GuessTheNumber-v0,prompt=TEXT" in line and not out.exists()


@pytest.mark.parametrize(("spec", "says"), [
    ("textarena:game=Battleship-v0", "is a game for more than one player"),
    ("textarena:game=Wordle-v0", "needs NLTK data downloaded at start"),
    ("textarena:game=GuessTheNumbr-v0", "unknown game 'GuessTheNumbr-v0' (did you mean GuessTheNumber-v0"),
    ("textarena:game=GuessTheNumber-v0,colour=red", "the game takes min_number, max_number, max_turns"),
    ("textarena:game=GuessTheNumber-v0,max_turns=many", "option max_turns='many' is not a valid int"),
    ("textarena:game=GuessTheNumber-v0,reward=points", "reward='points': expected win or shaped"),
])
def test_textarena_games_that_cannot_run_are_refused_in_one_line(spec, says, sft_dir, tmp_path):
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", spec, "--num-prompts", "2", "--out", str(out))
    line = _error_line(r)
    assert says in line, line
    assert not out.exists() and "device" not in r.stderr.decode()  # refused before the model loaded


# ---------------------------------------------------------------------------------------------------------------------
# TRL's environment classes

TRL_ENV = '''
import random


class IncrementEnv:
    """Written as TRL's documentation shows for GRPOTrainer(environment_factory=IncrementEnv)."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = int(kwargs["answer"]) % 7
        return f" (reach {self.target})\\n"

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
'''


def test_a_trl_environment_class_runs_unchanged(sft_dir, tmp_path):
    envs = tmp_path / "trl_envs.py"
    envs.write_text(TRL_ENV)
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--env", f"{envs}:IncrementEnv", "--num-prompts", str(P),
                "--n", str(N), "--max-turns", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = _rows(out)
    assert len(rows) == P * N
    for row in rows:
        target = int(row["answer"]) % 7
        assert row["prompt"].endswith(f" (reach {target})\n")  # reset's text appended to the task's prompt
        # the tiny model calls no tool: its first turn ends the episode, scored by get_reward() (counter 0)
        assert row["turns"] == 1 and row["reward/env"] == float(target == 0)
    assert read_manifest(out)["inputs"]["env"].startswith("sha256:")
    assert rows[0]["messages"][0]["role"] == "user"


# a chat template that renders the tools' schemas (as Qwen's and Llama's do, in a preamble) and tool messages
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}({% for p in t.function.parameters."
                  "properties %}{{ p }}{% endfor %}) {% endfor %}</tools>\n{% endif %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_trl_class_tools_reach_the_chat_template(sft_dir, tmp_path):
    """With chat-formatted prompts, the class's tool schemas (transformers' get_json_schema, as TRL builds them) go to
    the chat template, for the prompt and for every tool message after it, so the trajectory is never cut."""
    import shutil

    from rlkit.envs import get_env
    from rlkit.io import checkpoints
    from rlkit.sampling import driver
    from rlkit.tasks import Example

    policy = tmp_path / "chat"
    shutil.copytree(sft_dir, policy)
    tok = checkpoints.load_tokenizer(policy)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(policy)
    envs = tmp_path / "trl_envs.py"
    envs.write_text(TRL_ENV)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"<{a}+{b}>="}], "answer": str(a + b)})
                            + "\n" for a, b in ((3, 4), (10, 2))))
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(policy), "--env", f"{envs}:IncrementEnv", "--prompts", str(data),
                "--num-prompts", "2", "--n", "2", "--max-turns", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rows = _rows(out)
    assert rows[0]["prompt"].startswith("<tools>increment(step) </tools>\n<user><3+4>=\n<assistant>")
    assert rows[0]["prompt"].endswith(f" (reach {7 % 7})\n")
    # the tool message after a call renders with the same tools: the suffix, not a new sample
    spec = get_env(f"{envs}:IncrementEnv")
    t = driver._Traj("p0", 0)
    t.env = spec.make()
    obs = t.env.reset(Example("p0", "<3+4>=", "10", "train"))
    driver._start(t, tok, [{"role": "user", "content": obs}], None, spec)
    assert t.prompt_text.startswith("<tools>increment(step) </tools>\n")
    s = driver.Sampling(max_turns=3)
    call = '<tool_call>{"name": "increment", "arguments": {"step": 3}}</tool_call>'
    driver._take_turn(t, tok, tok(call, add_special_tokens=False)["input_ids"], None, "stop", s, None)
    step = t.env.step(call)
    driver._observe(t, tok, step.observation, s, None)
    assert not t.done and tok.decode(t.ids[len(tok(call, add_special_tokens=False)["input_ids"]):]) == \
        "\n<tool>3\n<assistant>"


def test_openenv_the_stop_string_is_not_part_of_the_action(shaped):
    """A turn ended by `stop=\\n` keeps its newline in the trajectory, but the action sent is the turn without it: a
    strict action (an enum) takes `UP\\n` as `UP`. Without `stop`, the newline is the model's and is sent."""
    from rlkit.envs.base import EnvError
    from rlkit.envs.openenv import OpenEnv
    from rlkit.tasks.base import Example

    url = f"{shaped.url}/move/ws"
    env = OpenEnv(url=url, action="direction", stop="\\n")
    try:
        env.reset(Example("p0", "", "7", "train"))
        step = env.step("UP\n")
        assert step.reward == 1.0 and step.terminated
    finally:
        env.close()
    env = OpenEnv(url=url, action="direction")
    try:
        env.reset(Example("p0", "", "7", "train"))
        with pytest.raises(EnvError, match=r"direction: Input should be 'UP', 'DOWN', 'LEFT' or 'RIGHT' \(got \"UP\\n\"\)"):
            env.step("UP\n")
    finally:
        env.close()
