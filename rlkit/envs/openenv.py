"""`--env openenv:url=ws://HOST:PORT[,...]`: an OpenEnv environment server as an rlkit environment, through rlkit's
own small client of OpenEnv's WebSocket protocol (the `websockets` package, extra `rlkit[openenv]`; the `openenv`
package itself is not needed).

The protocol (OpenEnv's `/ws` endpoint; JSON text frames `{"type": ..., "data": ...}`): one connection is one
session with its own environment instance on the server. The client sends `{"type": "reset", "data": {"seed":
S}}`, then `{"type": "step", "data": {FIELD: ACTION}}` per model turn, and `{"type": "close"}`; the server answers
each reset and step with `{"type": "observation", "data": {"observation": {...}, "reward": R, "done": D}}`, or
`{"type": "error", "data": {"message": ..., "code": ...}}`.

How a trajectory maps onto it (one connection per trajectory, opened by `reset`, closed by `close`):
  - the prompts are the server's: the environment brings its own examples (`iter_examples`), one reset seed each,
    drawn from disjoint ranges for the train and held-out splits (a server whose episodes do not depend on the
    seed gives the same episode for every prompt); the `n` samples of a prompt share its seed, so a group starts
    from one state;
  - the text the model sees is the observation's `text=FIELD` (default: the first non-empty of its `prompt`,
    `message`, `text` and `content` fields, else its first non-empty text field; none: the observation as JSON); reset's is the prompt, every step's is appended to the
    trajectory (a newline is put first when the model's turn did not end with one);
  - the model's turn, decoded, is the action's `action=FIELD` (default `message`); other fields of the action
    can be fixed with `action.KEY=VALUE` options (sent as text);
  - a step's reward is the server's `reward` (null: 0.0), the trajectory's the sum; `done` ends it (terminated).
Options: `url` (ws:// or wss://; an http(s):// URL is turned into its /ws endpoint, `http://HOST:PORT` and
`http://HOST:PORT/ws` alike), `action`, `text`, `timeout` (seconds per call, 30), `seed` (a base added to every
reset seed, 0), `max_new_tokens` (the turn's length), `stop` (a string that ends a turn, e.g. `stop=\\n`, in the
text's escapes), `max_sessions` (sessions open at once; default `--env-workers`).
Sessions are resources (`max_sessions = True`, rlkit.envs.base): at most `--env-workers` (or `max_sessions=N`) are
open at once, a trajectory's from its reset to its end, and the other trajectories queue for one. A server at
capacity (OpenEnv serves one session unless started with `max_concurrent_envs`) is waited for: its refusal is `Busy`,
the trajectory tries again (rlkit then opens no more sessions than it holds), for up to `timeout` seconds.
A server that refuses the connection, answers with an error, closes mid-trajectory, overruns `timeout` or stays at
capacity that long is one line naming the URL and the trajectory (`--env-errors end`: that trajectory ends with
reward 0 instead; a refused connection, which every trajectory would meet, does not suggest it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator

from rlkit.envs.base import Busy, EnvError, Step, option_attribute, unescape
from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, check_split, library_version

INSTALL = "pip install 'rlkit[openenv]'"
MAX_MESSAGE_BYTES = 64 << 20
_TEXT_FIELDS_FIRST = ("prompt", "message", "text", "content")


def _websockets():
    try:
        import websockets
        from websockets.sync.client import connect
    except ImportError as e:
        raise RlkitError(f"environment openenv needs the websockets package, which is not installed ({e.name} is "
                         f"missing): {INSTALL}") from None
    return websockets, connect


def _ws_url(url: str) -> str:
    if url.startswith(("ws://", "wss://")):
        return url
    if url.startswith(("http://", "https://")):  # the server's URL: its /ws endpoint, unless the URL names it
        base = "ws" + url[4:].rstrip("/")
        return base if base.rsplit("/", 1)[-1] == "ws" and base.count("/") > 2 else base + "/ws"
    raise RlkitError(f"environment openenv: url={url!r}: expected ws://HOST:PORT/ws (or the server's http:// URL)")




def version() -> str:
    return library_version("websockets")


class OpenEnv:
    """An OpenEnv server's environment, one WebSocket session per trajectory (see the module docstring)."""

    option_attribute = staticmethod(option_attribute)
    max_sessions = True  # a session per trajectory: at most --env-workers open at once (or the max_sessions option)

    @classmethod
    def library(cls) -> str:
        """The client library's version the manifests record (EnvSpec.fingerprint)."""
        return f"openenv-client websockets=={version()}"

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Before any model loads: the options and the websockets package (no connection is made)."""
        cls(**options)

    def __init__(self, url: str = "", action: str = "message", text: str = "", timeout: float = 30.0,
                 seed: int = 0, max_new_tokens: int = 0, stop: str = "", max_sessions: int = 0,
                 **action_fields: str) -> None:
        if not url:
            raise RlkitError("environment openenv: which server? expected url=ws://HOST:PORT/ws")
        self.url = _ws_url(url)
        bad = [k for k in action_fields if not k.startswith("action.")]
        if bad:
            raise RlkitError(f"unknown option {bad[0]!r} for environment openenv; it takes url, action, text, timeout, "
                             "seed, max_new_tokens, stop, max_sessions and action.KEY=VALUE")
        if timeout <= 0:
            raise RlkitError(f"environment openenv: timeout={timeout:g}: expected seconds > 0")
        if max_sessions < 0:
            raise RlkitError(f"environment openenv: max_sessions={max_sessions}: expected a number of sessions > 0")
        if max_sessions:
            self.max_sessions = int(max_sessions)
        self.action_field, self.text_field, self.timeout, self.base_seed = action, text, float(timeout), int(seed)
        self.fixed = {k.removeprefix("action."): v for k, v in action_fields.items()}
        if max_new_tokens:
            self.max_new_tokens = int(max_new_tokens)
        if stop:
            self.stop = (unescape(stop),)
        _websockets()
        self.ws = None
        self.where = f"environment openenv {self.url}"

    # -- the examples: reset seeds -----------------------------------------------------------------------------------
    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """One example per reset seed: the train split's seeds are even, the held-out split's odd, each a
        deterministic function of (split, seed, i); endless (unique: distinct seeds)."""
        check_split(split)
        for i in itertools.count():
            h = int.from_bytes(hashlib.blake2b(f"{split}|{seed}|{i}".encode(), digest_size=4).digest(), "big") >> 2
            s = self.base_seed + 2 * h + (split == "heldout")
            yield Example(f"{split}-{seed}-{i}", f"openenv {self.url} seed {s}", str(s), split)

    # -- the protocol ------------------------------------------------------------------------------------------------
    def reset(self, example) -> str:
        websockets, connect = _websockets()
        try:
            seed = int(example.answer)
        except (TypeError, ValueError):
            seed = self.base_seed + (int.from_bytes(hashlib.blake2b(str(example.prompt_id).encode(),
                                                                    digest_size=4).digest(), "big") >> 1)
        try:
            # entered as its context manager (websockets' supported form; the close is ours, in close())
            self.ws = connect(self.url, open_timeout=self.timeout, close_timeout=2,
                              max_size=MAX_MESSAGE_BYTES).__enter__()
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as e:
            # refused, no such host: every trajectory would meet it (a timeout or a rejected handshake may be load)
            down = isinstance(e, OSError) and not isinstance(e, TimeoutError)
            raise EnvError(f"{self.where}: cannot connect ({type(e).__name__}: {str(e)[:120] or 'no reason'}); is "
                           "the server running there?", every_trajectory=down) from None
        try:
            data = self._call({"type": "reset", "data": {"seed": seed}})
        except Busy:
            self.close()  # the server has closed it; the retry connects again
            raise
        return self._text(data)

    def step(self, action: str) -> Step:
        if self.ws is None:
            raise EnvError("environment openenv: step() before reset()")
        data = self._call({"type": "step", "data": {**self.fixed, self.action_field: action}})
        reward = data.get("reward")
        if reward is None or isinstance(reward, bool):  # OpenEnv's rewards may be null or a bool
            reward = float(bool(reward))
        if data.get("done"):
            return Step(None, reward, terminated=True)
        text = self._text(data)
        return Step(text if action.endswith("\n") or not text else "\n" + text, reward)

    def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is None:
            return
        try:
            ws.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 (already gone)
            pass
        try:
            ws.close()
        except Exception:  # noqa: BLE001
            pass

    def _call(self, message: dict) -> dict:
        websockets, _ = _websockets()
        what = message["type"]
        try:
            self.ws.send(json.dumps(message))
            raw = self.ws.recv(timeout=self.timeout)
        except TimeoutError:
            raise EnvError(f"{self.where}: no answer to {what} within {self.timeout:g} s (timeout=SECONDS)") from None
        except websockets.exceptions.ConnectionClosed as e:
            said = self._last_words()  # a server at capacity says why, then closes (possibly before our send)
            if said is not None:
                raw = said
            else:
                code = e.rcvd.code if e.rcvd else None
                raise EnvError(f"{self.where}: the server closed the connection during {what} (code {code})") from None
        except (OSError, websockets.exceptions.WebSocketException) as e:
            raise EnvError(f"{self.where}: {what} failed ({type(e).__name__}: {str(e)[:120]})") from None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise EnvError(f"{self.where}: the answer to {what} is not JSON: {str(raw)[:80]!r}") from None
        if not isinstance(reply, dict):
            raise EnvError(f"{self.where}: the answer to {what} is a {type(reply).__name__}; expected an object")
        data = reply.get("data") if isinstance(reply.get("data"), dict) else {}
        if reply.get("type") == "error":
            msg, code = str(data.get("message", ""))[:200], data.get("code", "")
            if code == "CAPACITY_REACHED":
                raise Busy(f"{self.where}: the server stayed at capacity ({msg.split('.')[0]}) for {self.timeout:g} s "
                           "(timeout=SECONDS); rlkit opens at most --env-workers sessions (or max_sessions=N): start "
                           "the server with max_concurrent_envs at least that, or lower them", wait=self.timeout)
            raise EnvError(f"{self.where}: the server answered {what} with an error: {msg} ({code})")
        if reply.get("type") != "observation":
            raise EnvError(f"{self.where}: the answer to {what} is a {reply.get('type')!r} message; expected an "
                           "observation")
        return data

    def _last_words(self) -> str | None:
        """A message the server sent before it closed the connection (OpenEnv's capacity error), if one is queued."""
        try:
            return self.ws.recv(timeout=0.5)
        except Exception:  # noqa: BLE001 (nothing was said)
            return None

    def _text(self, data: dict) -> str:
        obs = data.get("observation")
        if isinstance(obs, str):
            return obs
        if not isinstance(obs, dict):
            return json.dumps(obs)
        if self.text_field:
            if self.text_field not in obs:
                raise EnvError(f"{self.where}: the observation has no field {self.text_field!r} (text=); it has "
                               f"{', '.join(obs) or 'none'}")
            v = obs[self.text_field]
            return v if isinstance(v, str) else json.dumps(v)
        texts = [k for k, v in obs.items() if isinstance(v, str) and v]
        for k in (*(f for f in _TEXT_FIELDS_FIRST if f in texts), *texts):
            return obs[k]
        return json.dumps(obs, separators=(",", ":"))

