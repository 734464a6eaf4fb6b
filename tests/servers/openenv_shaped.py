"""Real OpenEnv servers in the shapes OpenEnv's own servers ship, for the openenv adapter's tests: each an `openenv`
`Environment` subclass served by the package's own app (`openenv.core.env_server.create_app`), mounted side by side
under one uvicorn process on 127.0.0.1 (each app keeps its own sessions and cap):

    python tests/servers/openenv_shaped.py PORT

  /guess/ws      messages-shaped, as OpenEnv's textarena server answers with textarena's default wrappers: one
                 message whose content is the game's whole transcript so far (`[Player] [5]` echoes the guess, then
                 `[GAME] You guessed 5. The target number is higher.`); `prompt` is the rules on reset and the
                 game's id after a step
  /guess-raw/ws  the same game as textarena's `-raw` ids answer it: each step's messages alone (the guess echoed as
                 a PLAYER_ACTION message, then the game's), the rules a PROMPT message on reset
  /guess-one/ws  /guess with OpenEnv's default cap, one session at a time (`max_concurrent_envs=1`, and its
                 environment not marked SUPPORTS_CONCURRENT_SESSIONS, so the cap cannot be raised)
  /move/ws       a strict action: `direction` is one of UP, DOWN, LEFT, RIGHT (pydantic refuses anything else)
  /quiz/ws       reset takes options (`topic`, `size`, `hard`): the question says which it got, with their types

The guessing game: reset(seed) picks the number `seed % 20 + 1`; a step reads the first number in the message (the
tiny model writes digits, not textarena's `[N]`), pays 1.0 and ends the game when it is the number, and otherwise
says "higher" or "lower" (no number: "invalid move"); the game ends after `TURNS` guesses. The quiz: one question,
1.0 for a message that contains the answer.
"""

from __future__ import annotations

import re
import sys
import uuid
from typing import Any, Literal

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import BaseModel, Field

TURNS = 4
RULES = "Guess the number between 1 and 20 as [N]."


class TextArenaMessage(BaseModel):  # OpenEnv's envs/textarena_env/models.py
    sender_id: int
    content: str
    category: str


class TextArenaAction(Action):
    message: str


class TextArenaObservation(Observation):
    prompt: str
    messages: list[TextArenaMessage] = Field(default_factory=list)
    current_player_id: int = 0
    legal_players: list[int] = Field(default_factory=list)
    info: dict[str, Any] = Field(default_factory=dict)


class GuessNumber(Environment[TextArenaAction, TextArenaObservation, State]):
    """The game, its observations shaped as OpenEnv's textarena server shapes them (`raw`: textarena's -raw ids)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    RAW = False
    ENV_ID = "GuessTheNumber-v0"

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()))
        self.target, self.transcript = 1, ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextArenaObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self.target = (seed or 0) % 20 + 1
        if self.RAW:
            msgs = [TextArenaMessage(sender_id=-1, content=RULES, category="PROMPT")]
        else:
            self.transcript = "\n[GAME] " + RULES
            msgs = [TextArenaMessage(sender_id=-1, content=self.transcript, category="MESSAGE")]
        return TextArenaObservation(prompt=RULES, messages=msgs, legal_players=[0], reward=0.0, done=False)

    def step(self, action: TextArenaAction, timeout_s: float | None = None, **kwargs: Any) -> TextArenaObservation:
        self._state.step_count += 1
        m = re.search(r"(\d+)", action.message)
        if m is None:
            said = "Invalid move: guess as [N]."
        elif int(m.group(1)) == self.target:
            said = "Congratulations! You guessed the number."
        else:
            said = f"You guessed {int(m.group(1))}. The target number is " \
                   f"{'higher' if int(m.group(1)) < self.target else 'lower'}."
        won = m is not None and int(m.group(1)) == self.target
        done = won or self._state.step_count >= TURNS
        if self.RAW:
            msgs = [TextArenaMessage(sender_id=0, content=action.message, category="PLAYER_ACTION"),
                    TextArenaMessage(sender_id=-1, content=said, category="GAME_MESSAGE")]
        else:
            self.transcript += f"\n[Player] {action.message}\n[GAME] {said}"
            msgs = [TextArenaMessage(sender_id=-1, content=self.transcript, category="MESSAGE")]
        return TextArenaObservation(prompt=self.ENV_ID + ("-raw" if self.RAW else ""), messages=msgs,
                                    legal_players=[0], reward=1.0 if won else 0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


class GuessNumberRaw(GuessNumber):
    RAW = True


class GuessNumberOneSession(GuessNumber):
    SUPPORTS_CONCURRENT_SESSIONS = False  # as most of OpenEnv's shipped environments: the cap stays one


class MoveAction(Action):
    direction: Literal["UP", "DOWN", "LEFT", "RIGHT"]


class GridObservation(Observation):
    board: str = ""


class Move(Environment[MoveAction, GridObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GridObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GridObservation(board="Move the piece: UP, DOWN, LEFT or RIGHT.", done=False, reward=None)

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> GridObservation:
        self._state.step_count += 1
        return GridObservation(board=f"moved {action.direction}", done=True, reward=1.0)

    @property
    def state(self) -> State:
        return self._state


class QuizAction(Action):
    message: str


class QuizObservation(Observation):
    question: str = ""
    feedback: str = ""


class Quiz(Environment[QuizAction, QuizObservation, State]):
    """reset(topic=, size=, hard=): a question on that topic with `size`-digit numbers; the question names the
    options it received and their types (`size=3 (int)`), so a test sees what reached reset."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()))
        self.answer = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, topic: str = "add", size: int = 1,
              hard: bool = False) -> QuizObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        a, b = 10 ** (size - 1) + (seed or 0) % 7, 10 ** (size - 1) + 3
        self.answer = a * b if topic == "mul" else a + b
        op = "*" if topic == "mul" else "+"
        return QuizObservation(question=f"[topic={topic} ({type(topic).__name__}) size={size} ({type(size).__name__}) "
                                        f"hard={hard} ({type(hard).__name__})] {a} {op} {b} =", done=False)

    def step(self, action: QuizAction, timeout_s: float | None = None, **kwargs: Any) -> QuizObservation:
        right = str(self.answer) in action.message
        return QuizObservation(feedback="right" if right else "wrong", reward=float(right), done=True)

    @property
    def state(self) -> State:
        return self._state


def app():
    from starlette.applications import Starlette
    from starlette.routing import Mount

    def mount(path, env, action, obs, **kw):
        return Mount(path, app=create_app(env, action, obs, env_name=path.strip("/"), **kw))

    return Starlette(routes=[
        mount("/guess", GuessNumber, TextArenaAction, TextArenaObservation, max_concurrent_envs=16),
        mount("/guess-raw", GuessNumberRaw, TextArenaAction, TextArenaObservation, max_concurrent_envs=16),
        mount("/guess-one", GuessNumberOneSession, TextArenaAction, TextArenaObservation),  # OpenEnv's default: 1
        mount("/move", Move, MoveAction, GridObservation, max_concurrent_envs=16),
        mount("/quiz", Quiz, QuizAction, QuizObservation, max_concurrent_envs=16),
    ])


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
