"""A real OpenEnv environment server for the openenv adapter's tests: an `openenv` `Environment` subclass served by
the package's own app (`openenv.core.env_server.create_app`) under uvicorn on 127.0.0.1.

    python tests/servers/openenv_echo.py PORT [MAX_CONCURRENT_ENVS [PEAK_FILE]]

The game: reset(seed) asks for the digit `seed % 10` ("Say 7:"); each step pays 1.0 when the message contains that
digit and ends the episode after `STEPS` steps, or at once when the message contains "stop". A message containing
"boom" makes step raise (the server answers with an error). With PEAK_FILE, the most sessions (environment instances)
alive at once is written there as it grows.
"""

from __future__ import annotations

import sys
import threading
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

STEPS = 3
PEAK_FILE = ""
_LOCK, _LIVE = threading.Lock(), [0, 0]  # instances alive now, the most at once


class SayAction(Action):
    message: str = Field(..., description="the model's turn")


class SayObservation(Observation):
    prompt: str = ""
    feedback: str = ""


class SayState(State):
    digit: int = 0


class SayDigit(Environment[SayAction, SayObservation, SayState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = SayState(episode_id=str(uuid.uuid4()))
        with _LOCK:
            _LIVE[0] += 1
            if _LIVE[0] > _LIVE[1]:
                _LIVE[1] = _LIVE[0]
                if PEAK_FILE:
                    with open(PEAK_FILE, "w") as f:
                        f.write(str(_LIVE[1]))

    def close(self) -> None:
        with _LOCK:
            _LIVE[0] -= 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        digit = (seed or 0) % 10
        self._state = SayState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, digit=digit)
        return SayObservation(prompt=f"Say {digit}:", done=False, reward=None)

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        if "boom" in action.message:
            raise RuntimeError("the environment broke")
        self._state.step_count += 1
        hit = str(self._state.digit) in action.message
        done = self._state.step_count >= STEPS or "stop" in action.message
        return SayObservation(feedback="yes" if hit else "no", reward=1.0 if hit else 0.0, done=done)

    @property
    def state(self) -> SayState:
        return self._state


if __name__ == "__main__":
    import uvicorn

    port, envs = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1
    PEAK_FILE = sys.argv[3] if len(sys.argv) > 3 else ""
    app = create_app(SayDigit, SayAction, SayObservation, env_name="say_digit", max_concurrent_envs=envs)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
