"""`--env openenv:url=ws://HOST:PORT[,...]`: an OpenEnv environment server as an rlkit environment, through rlkit's
own small client of OpenEnv's WebSocket protocol (the `websockets` package, extra `rlkit[openenv]`; the `openenv`
package itself is not needed).

The protocol (OpenEnv's `/ws` endpoint; JSON text frames `{"type": ..., "data": ...}`): one connection is one
session with its own environment instance on the server. The client sends `{"type": "reset", "data": {"seed": S,
...}}`, then `{"type": "step", "data": {FIELD: ACTION}}` per model turn, and `{"type": "close"}`; the server answers
each reset and step with `{"type": "observation", "data": {"observation": {...}, "reward": R, "done": D}}`, or
`{"type": "error", "data": {"message": ..., "code": ..., "errors": [...]}}` (`errors`: pydantic's reasons, for a
VALIDATION_ERROR), and passes reset's data to the environment's `reset` as the keywords it declares (all of them when
it takes `**kwargs`).

How a trajectory maps onto it (one connection per trajectory, opened by `reset`, closed by `close`):
  - the prompts are the server's: the environment brings its own examples (`iter_examples`), one reset seed each,
    drawn from disjoint ranges for the train and held-out splits (a server whose episodes do not depend on the
    seed gives the same episode for every prompt); the `n` samples of a prompt share its seed, so a group starts
    from one state. With `--prompts`, the rows are the prompts instead: a row whose answer is a JSON object sends its
    keys in reset's data (the row's columns, as TRL's classes get them in `reset(**row)`), and its prompt comes
    first, the server's reset text after it;
  - reset's data is the seed, the `reset.KEY=VALUE` options (a value that parses as JSON, a number, `true`, `null`,
    a list, is sent as that value, anything else as text), then the row's keys;
  - the text the model sees: reset's is the prompt, every step's is appended to the trajectory (a newline is put
    first when the model's turn did not end with one). `text=PATH` names it: field names joined by dots, integer
    indices in brackets (`feedback`, `messages[-1].content`); a list of messages there is read as below, anything
    else not text as JSON. By default, an observation whose `messages` hold the text (a list of objects with a text
    `content`, or of strings: OpenEnv's textarena and chat servers) is read as a conversation: reset's text is its
    `prompt` and messages (one that another repeats, once), a step's the messages new since the last observation
    (of a server that keeps the whole conversation, those added and the lines added to the last one; of a server
    that sends each step's messages alone, all of them), without the server's echo of the model's own turn (a
    message with the role `assistant`, or the turn itself at the start of a message, alone or after a `[SPEAKER]`
    tag). Otherwise the first non-empty of its `prompt`, `message`, `text` and `content` fields, else its first
    non-empty text field; none: the observation as JSON. When every step of the run's first trajectories appended
    the same text, or nothing, a warning (once) names the field read and `text=PATH`;
  - the model's turn, decoded, less the `stop` string that ended it, is the action's `action=FIELD` (default
    `message`); other fields of the action
    can be fixed with `action.KEY=VALUE` options (sent as text; the server's pydantic model converts them);
  - a step's reward is the server's `reward` (null: 0.0), the trajectory's the sum; `done` ends it (terminated).
Options: `url` (ws:// or wss://; an http(s):// URL is turned into its /ws endpoint, `http://HOST:PORT` and
`http://HOST:PORT/ws` alike), `action`, `text`, `timeout` (seconds per call, 30), `seed` (a base added to every
reset seed, 0), `max_new_tokens` (the turn's length), `stop` (a string that ends a turn, e.g. `stop=\\n`, in the
text's escapes), `max_sessions` (sessions open at once; default `--env-workers`), `action.KEY=VALUE`,
`reset.KEY=VALUE`.
Sessions are resources (`max_sessions = True`, rlkit.envs.base): at most `--env-workers` (or `max_sessions=N`) are
open at once, a trajectory's from its reset to its end, and the other trajectories queue for one. A server at
capacity (OpenEnv serves one session unless started with `max_concurrent_envs`) is waited for: its refusal is `Busy`,
the trajectory tries again (rlkit then opens no more sessions than it holds), for up to `timeout` seconds. A
connection ends after the server's own close (its session is free when the next trajectory asks for one).
A server that refuses the connection, answers with an error (a validation error with its reasons, per field),
closes mid-trajectory, overruns `timeout` or stays at capacity that long is one line naming the URL and the
trajectory (`--env-errors end`: that trajectory ends with reward 0 instead; a refused connection, which every
trajectory would meet, does not suggest it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
from collections.abc import Iterator

from rlkit.envs.base import Busy, EnvError, Step, option_attribute, unescape
from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, check_split, library_version

INSTALL = "pip install 'rlkit[openenv]'"
MAX_MESSAGE_BYTES = 64 << 20
_TEXT_FIELDS_FIRST = ("prompt", "message", "text", "content")
_PATH = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")  # a text= path's steps: a field name, or [INDEX]
_WARNED: list[bool] = []  # the same-text warning is said once a process
_SEEN: dict = {"trajectories": 0, "steps": 0, "texts": set()}  # the step texts of the process's trajectories
_SAME_AFTER = (2, 4)  # the warning needs this many trajectories and steps, every one appending the same text
_WARN_LOCK = threading.Lock()


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


def parse_path(path: str) -> tuple[str | int, ...]:
    """`text=`'s path into the observation: field names joined by dots, integer indices in brackets (negative from
    the end), e.g. `messages[-1].content` -> ("messages", -1, "content")."""
    steps: list[str | int] = []
    pos = 0
    while pos < len(path):
        if steps and path[pos] == "." and pos + 1 < len(path) and path[pos + 1] not in ".[]":
            pos += 1  # a dot before a field name (not before the first, nor before an index)
        elif steps and path[pos] != "[":
            break
        m = _PATH.match(path, pos)
        if m is None:
            break
        steps.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if not steps or pos != len(path) or not isinstance(steps[0], str):
        raise RlkitError(f"environment openenv: text={path!r}: expected a path into the observation: field names "
                         "joined by dots and integer indices in brackets, e.g. text=feedback or "
                         "text=messages[-1].content")
    return tuple(steps)


def show_path(steps) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else (f".{s}" if i else s) for i, s in enumerate(steps))


def at_path(obs, steps: tuple[str | int, ...]):
    """The value at `steps` in `obs`; a step that is not there raises LookupError naming where the path ended."""
    value = obs
    for i, step in enumerate(steps):
        where = show_path(steps[:i]) or "the observation"
        if isinstance(step, int):
            if not isinstance(value, list):
                raise LookupError(f"{where} is a {_kind(value)}, not a list")
            if not -len(value) <= step < len(value):
                raise LookupError(f"{where} has {len(value)} item{'' if len(value) == 1 else 's'}")
            value = value[step]
        else:
            if not isinstance(value, dict):
                raise LookupError(f"{where} is a {_kind(value)}, not an object")
            if step not in value:
                raise LookupError(f"{where} has no field {step!r}; it has {', '.join(map(str, value)) or 'none'}")
            value = value[step]
    return value


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "text", type(None): "null", bool: "boolean", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


def messages_of(value) -> list[tuple[str, str]] | None:
    """A list of messages as (role, content): objects with a text `content` (OpenEnv's textarena and chat servers:
    `{"sender_id": ..., "content": ..., "category": ...}`, `{"role": ..., "content": ...}`) or plain strings; None
    when `value` is not such a list."""
    if not isinstance(value, list):
        return None
    out = []
    for m in value:
        if isinstance(m, str):
            out.append(("", m))
        elif isinstance(m, dict) and isinstance(m.get("content"), str):
            out.append((str(m.get("role") or ""), m["content"]))
        else:
            return None
    return out


def _grew(old: str, new: str) -> bool:
    """`new` is `old` with lines added (a transcript kept in one message: OpenEnv's textarena server)."""
    return len(new) > len(old) and new.startswith(old) and new[len(old)] == "\n"


def new_messages(prev: list[tuple[str, str]], cur: list[tuple[str, str]], history: bool) -> list[tuple[str, str]]:
    """The messages of `cur` that are new since `prev`: with `history` (the server keeps the whole conversation),
    those after the part `cur` shares with `prev`, and of a last shared message that grew by lines, the added lines;
    otherwise (the server sends each step's messages alone) all of `cur`."""
    if not history:
        return list(cur)
    k = 0
    while k < min(len(prev), len(cur)) and prev[k] == cur[k]:
        k += 1
    out = []
    if k < len(prev) and k < len(cur) and _grew(prev[k][1], cur[k][1]):
        out.append((cur[k][0], cur[k][1][len(prev[k][1]):]))
        k += 1
    return out + list(cur[k:])


def keeps_history(prev: list[tuple[str, str]], cur: list[tuple[str, str]]) -> bool:
    """Whether `cur` continues `prev` (the same messages, more of them, or the last one grown) rather than
    replacing it: decided on a trajectory's first step."""
    k = 0
    while k < min(len(prev), len(cur)) and prev[k] == cur[k]:
        k += 1
    return k == len(prev) or (k == len(prev) - 1 and k < len(cur) and _grew(prev[k][1], cur[k][1]))


def drop_echo(text: str, action: str) -> str:
    """`text` without the server's echo of the model's turn at its start: the turn itself, alone or after a
    `[SPEAKER]` tag (textarena's `[Player] [5]`)."""
    said = action.strip()
    if not said:  # an empty turn: its echo is the speaker's tag alone on its line
        m = re.match(r"\s*\[[^\]\n]*\][ \t]*\n", text)
        return text[m.end():] if m else text
    m = re.match(r"\s*(?:\[[^\]\n]*\][ \t]*)?" + re.escape(said) + r"[ \t]*(?:\n|$)", text)
    return text[m.end():] if m else text


def joined(parts, once: bool = False) -> str:
    """Texts one per line, each without its surrounding blank space, the empty ones left out; `once`: also those
    another part holds (a reset's `prompt` that its first message repeats)."""
    parts = [p.strip() for p in parts if p and p.strip()]
    if not once:
        return "\n".join(parts)
    kept = [p for i, p in enumerate(parts)
            if not any(p in q and (p != q or j < i) for j, q in enumerate(parts) if j != i)]
    return "\n".join(kept)


def option_value(text: str):
    """A `reset.KEY=VALUE` option's value as sent: a JSON number, `true`/`false`, `null`, list or object as that
    JSON value; anything else (and a JSON string, `"5"`, to send digits as text) as text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value


def validation_detail(errors, limit: int = 3) -> str:
    """The server's pydantic `errors` (OpenEnv's VALIDATION_ERROR) as `FIELD: REASON (got VALUE)` parts."""
    if not isinstance(errors, list):
        return ""
    parts = []
    for e in errors[:limit]:
        if not isinstance(e, dict):
            continue
        loc = [x for x in e.get("loc") or () if x not in ("body", "data")]
        field = show_path([x for x in loc if isinstance(x, (str, int))]) or "the data"
        got = f" (got {json.dumps(e['input'])[:60]})" if "input" in e and e.get("type") != "missing" else ""
        parts.append(f"{field}: {str(e.get('msg', 'invalid'))[:160]}{got}")
    more = len(errors) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")




def _await_close(ws, wait: float = 1.0) -> None:
    """Close a connection the server is closing (after our `close` message, or its refusal): its close is waited
    for (up to `wait` seconds) before ours, which frees its session before the next connection asks for one and
    spares it a failed close of its own (an ASGI traceback in its log)."""
    import time

    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            ws.recv(timeout=max(0.01, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 (closed, as expected, or silent: closed from here below)
        pass
    try:
        ws.close()
    except Exception:  # noqa: BLE001
        pass


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
                 **fields: str) -> None:
        if not url:
            raise RlkitError("environment openenv: which server? expected url=ws://HOST:PORT/ws")
        self.url = _ws_url(url)
        bad = [k for k in fields if not k.startswith(("action.", "reset."))]
        if bad:
            raise RlkitError(f"unknown option {bad[0]!r} for environment openenv; it takes url, action, text, timeout, "
                             "seed, max_new_tokens, stop, max_sessions, action.KEY=VALUE and reset.KEY=VALUE")
        if timeout <= 0:
            raise RlkitError(f"environment openenv: timeout={timeout:g}: expected seconds > 0")
        if max_sessions < 0:
            raise RlkitError(f"environment openenv: max_sessions={max_sessions}: expected a number of sessions > 0")
        if max_sessions:
            self.max_sessions = int(max_sessions)
        self.action_field, self.text_field, self.timeout, self.base_seed = action, text, float(timeout), int(seed)
        self.text_path = parse_path(text) if text else None
        self.fixed = {k.removeprefix("action."): v for k, v in fields.items() if k.startswith("action.")}
        self.reset_options = {k.removeprefix("reset."): option_value(v) for k, v in fields.items()
                              if k.startswith("reset.")}
        if max_new_tokens:
            self.max_new_tokens = int(max_new_tokens)
        if stop:
            self.stop = (unescape(stop),)
        _websockets()
        self.ws = None
        self.where = f"environment openenv {self.url}"
        self._episode()

    def _episode(self) -> None:
        """A trajectory's reading of the observations: the messages seen so far, and the step texts appended."""
        self.seen: list[tuple[str, str]] | None = None  # messages mode: the last observation's messages
        self.history: bool | None = None  # messages mode: the server keeps the conversation (decided on step 1)
        self.chosen = ""  # what the text is read from, in words (the same-text warning names it)
        self.fields: list[str] = []
        self.appended: list[str] = []

    # -- the examples: reset seeds -----------------------------------------------------------------------------------
    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """One example per reset seed: the train split's seeds are even, the held-out split's odd, each a
        deterministic function of (split, seed, i); endless (unique: distinct seeds)."""
        check_split(split)
        for i in itertools.count():
            h = int.from_bytes(hashlib.blake2b(f"{split}|{seed}|{i}".encode(), digest_size=4).digest(), "big") >> 2
            s = self.base_seed + 2 * h + (split == "heldout")
            yield Example(f"{split}-{seed}-{i}", f"{self._own_prompt}{s}", str(s), split)

    @property
    def _own_prompt(self) -> str:
        return f"openenv {self.url} seed "

    # -- the protocol ------------------------------------------------------------------------------------------------
    def reset(self, example) -> str:
        websockets, connect = _websockets()
        self._episode()
        try:
            seed = int(example.answer)
        except (TypeError, ValueError):
            seed = self.base_seed + (int.from_bytes(hashlib.blake2b(str(example.prompt_id).encode(),
                                                                    digest_size=4).digest(), "big") >> 1)
        own = str(example.prompt).startswith(self._own_prompt)
        row = {}
        if not own:  # a --prompts row: its columns, as TRL's reset(**row) gets them (a JSON object answer's keys)
            try:
                extra = json.loads(example.answer) if isinstance(example.answer, str) else None
            except ValueError:
                extra = None
            if isinstance(extra, dict):
                row = {k: v for k, v in extra.items() if isinstance(k, str)}
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
            data = self._call({"type": "reset", "data": {"seed": seed, **self.reset_options, **row}})
        except Busy:
            self._closed_by_server()  # the server closes it; the retry connects again
            raise
        text = self._text(data, None)
        if own:
            return text
        prompt = str(example.prompt)  # the row's prompt, then the server's reset text
        return prompt + ("\n" if prompt and text and not prompt.endswith("\n") else "") + text

    def step(self, action: str) -> Step:
        if self.ws is None:
            raise EnvError("environment openenv: step() before reset()")
        sent = action
        for s in getattr(self, "stop", ()):  # the stop string ends the turn; it is not part of the action
            if s and sent.endswith(s):
                sent = sent[:-len(s)]
                break
        data = self._call({"type": "step", "data": {**self.fixed, self.action_field: sent}})
        reward = data.get("reward")
        if reward is None or isinstance(reward, bool):  # OpenEnv's rewards may be null or a bool
            reward = float(bool(reward))
        if data.get("done"):
            return Step(None, reward, terminated=True)
        text = self._text(data, action)
        self.appended.append(text)
        return Step(text if action.endswith("\n") or not text else "\n" + text, reward)

    def close(self) -> None:
        self._check_appended()
        ws, self.ws = self.ws, None
        if ws is None:
            return
        try:
            ws.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 (already gone)
            pass
        _await_close(ws)

    def _closed_by_server(self) -> None:
        """A session the server refused (at capacity): it closes the connection itself after saying so."""
        ws, self.ws = self.ws, None
        if ws is not None:
            _await_close(ws)

    def _check_appended(self) -> None:
        """Warn (once a process) when every step of the run's trajectories so far (at least `_SAME_AFTER`) appended
        the same text, or nothing: the model may never see the server's feedback (a field that repeats the game's
        name, an empty one). One trajectory's repeats are no sign: a game may well say "higher" twice."""
        texts, self.appended = self.appended, []
        if not texts:
            return
        with _WARN_LOCK:
            if _WARNED:
                return
            _SEEN["trajectories"] += 1
            _SEEN["steps"] += len(texts)
            _SEEN["texts"] = set(list(_SEEN["texts"] | set(texts))[:2])
            if _SEEN["trajectories"] < _SAME_AFTER[0] or _SEEN["steps"] < _SAME_AFTER[1] or len(_SEEN["texts"]) > 1:
                return
            _WARNED.append(True)
            n, steps = _SEEN["trajectories"], _SEEN["steps"]
        from rlkit import console

        said = "nothing" if not texts[0] else f"the same text {texts[0][:60]!r}"
        console.warn(f"{self.where}: each of the {steps} steps of the first {n} trajectories appended {said} (read "
                     f"from {self.chosen}), so the model may not see the server's feedback; the observation's fields "
                     f"are {', '.join(self.fields) or 'none'}: pick its text with text=PATH (e.g. text=feedback, "
                     "text=messages[-1].content)")

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
            detail = validation_detail(data.get("errors"))
            if detail:  # pydantic's reasons, per field (OpenEnv's VALIDATION_ERROR): what the server refused and why
                raise EnvError(f"{self.where}: the server answered {what} with an error: {msg} ({code}): {detail}")
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

    def _text(self, data: dict, action: str | None) -> str:
        """The observation's text: reset's (`action` None) is the prompt, a step's is appended (see the module
        docstring)."""
        obs = data.get("observation")
        if isinstance(obs, str):
            self.chosen = "the observation"
            return obs
        if not isinstance(obs, dict):
            self.chosen = "the observation as JSON"
            return json.dumps(obs)
        self.fields = list(obs)
        if self.text_path is not None:
            self.chosen = f"text={self.text_field}"
            try:
                value = at_path(obs, self.text_path)
            except LookupError as e:
                raise EnvError(f"{self.where}: text={self.text_field}: {e}") from None
            msgs = messages_of(value)
            if msgs is not None:
                return self._messages_text(msgs, action, None)
            return value if isinstance(value, str) else json.dumps(value)
        msgs = messages_of(obs.get("messages"))
        if action is None and msgs:  # a messages-shaped server: its messages carry the text
            self.seen = []
        if self.seen is not None and msgs is not None:
            self.chosen = "the new messages of the observation's messages"
            prompt = obs.get("prompt") if action is None and isinstance(obs.get("prompt"), str) else None
            return self._messages_text(msgs, action, prompt)
        texts = [k for k, v in obs.items() if isinstance(v, str) and v]
        for k in (*(f for f in _TEXT_FIELDS_FIRST if f in texts), *texts):
            self.chosen = f"the observation's {k}"
            return obs[k]
        self.chosen = "the observation as JSON"
        return json.dumps(obs, separators=(",", ":"))

    def _messages_text(self, msgs: list[tuple[str, str]], action: str | None, prompt: str | None) -> str:
        """Reset: the prompt and the messages (what one repeats of another once); a step: the messages new since
        the last observation, without the server's echo of the model's own turn."""
        prev, self.seen = self.seen, msgs
        if action is None or prev is None:
            return joined([prompt or "", *(c for _, c in msgs)], once=True)
        if self.history is None:
            self.history = keeps_history(prev, msgs)
        new = [(r, drop_echo(c, action)) for r, c in new_messages(prev, msgs, self.history) if r != "assistant"]
        return joined(c for _, c in new)
