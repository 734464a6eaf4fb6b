"""`--env textarena:game=ID[,reward=win|shaped][,KEY=VALUE...]`: textarena's single-player text games as rlkit
environments (the optional extra `rlkit[textarena]`).

`game` is a textarena env id (`GuessTheNumber-v0`, `Mastermind-v0`, `TowerOfHanoi-v0`, `FrozenLake-v0`, ...);
its `-raw` variant is played (the default wrappers re-send the whole transcript every turn, which a trajectory
already holds). Other keys go to the game's constructor (`textarena.make(ID, KEY=VALUE)`), typed by its
annotations, e.g. `max_turns=6`.

How a game maps onto a trajectory (one game per trajectory):
  - the prompt is the game's opening message (its rules), or `prompt=TEXT` in its place (`\\n` escapes; a small
    model's context may not hold the rules: the line that says so names `prompt=TEXT`);
  - each model turn is the game's action, as text (`stop=TEXT` ends a turn at TEXT, e.g. `stop=\\n`; by default at
    eos); the game's answer is its new messages, one per line (textarena echoes the player's own action back:
    dropped), put after a newline when the turn did not end with one;
  - textarena's `step` returns no reward: the game's reward comes from `close()` when it is over, and is the
    trajectory's reward. `reward=win` (the default): 1.0 for a win (the game's reward is at least 1), else 0.0;
    `reward=shaped`: the game's own reward, which for many games pays a loss for closeness (GuessTheNumber pays the
    last guess's closeness to the secret: "always guess 10" collects 0.73 a game), so a policy can farm it
    without winning. textarena forgives one invalid move with a message; a second ends the game.
  - each game is seeded by its example (the reset seed is the example's answer): the `n` samples of a prompt play
    the same game; train and held-out examples draw their seeds from disjoint ranges (even and odd), so a
    held-out game's seed is never trained on. textarena's reset reseeds Python's global `random`; the adapter
    keeps the game's random state apart and leaves the caller's as it was.
Games that cannot run here are refused in one line, before any model loads: those for two or more players, those
that call a hosted model (they read OPENROUTER_API_KEY), those that download NLTK data or otherwise fail to start
offline.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import random
import threading
from collections.abc import Iterator

from rlkit.envs.base import EnvError, Step, option_attribute, unescape
from rlkit.errors import RlkitError
from rlkit.plugins import library_version, missing_extra
from rlkit.tasks.base import Example, check_split

INSTALL = "pip install 'rlkit[textarena]'"
REWARDS = ("win", "shaped")
OWN = ("game", "reward", "prompt", "stop", "seed", "max_new_tokens")


@functools.cache
def library():
    try:
        with _quiet():
            import textarena
            from textarena.envs.registration import ENV_REGISTRY  # noqa: F401
    except ImportError as e:
        raise missing_extra("environment textarena", "textarena", INSTALL, e) from None
    return textarena



def _quiet():
    """textarena's games print to stdout/stderr as they start (NLTK's failed downloads, banners): kept off the
    stage's streams (stdout may be the Arrow pipe), what they say folded into the one error line if they fail."""
    import contextlib
    import io

    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack



def _registry() -> dict:
    from textarena.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


def raw_id(game: str) -> str:
    """The id played: the game's `-raw` variant when there is one (the id itself when it is one)."""
    reg = _registry()
    if game not in reg:
        import difflib

        base = sorted({k.removesuffix("-raw") for k in reg})
        close = difflib.get_close_matches(game, base, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise RlkitError(f"environment textarena: unknown game {game!r}{hint}; textarena's games are its env ids, "
                         "e.g. GuessTheNumber-v0, Mastermind-v0, TowerOfHanoi-v0")
    return game if game.endswith("-raw") or f"{game}-raw" not in reg else f"{game}-raw"


def _why_not(game: str, e: BaseException) -> str:
    """Why `game` cannot be played here, in words, from what starting it raised."""
    from rlkit.plugins.user_code import one_line

    text = f"{type(e).__name__}: {e}"
    low = text.lower()
    if "number of players" in low or "players" in low and ("support" in low or "requires" in low):
        return f"it is a game for more than one player ({one_line(e)}); rlkit plays single-player games"
    if "api_key" in low or "openrouter" in low or "api key" in low:
        return "it calls a hosted model and needs an API key (OPENROUTER_API_KEY); rlkit runs offline"
    if "nltk" in low or "resource" in low and "not found" in low:
        return "it needs NLTK data downloaded at start, which is not available offline"
    return f"it does not start here ({one_line(e)})"


_ONE_AT_A_TIME = threading.RLock()  # textarena's calls touch process-wide state (the global random, stdout)


class _Randomness:
    """The game's own `random` state, swapped in around each call into textarena and out again after it; the calls
    of all games run one at a time (the global random and the streams `_quiet` swaps are the process's)."""

    def __init__(self) -> None:
        self.state = None

    def __enter__(self):
        _ONE_AT_A_TIME.acquire()
        self.caller = random.getstate()
        if self.state is not None:
            random.setstate(self.state)
        return self

    def __exit__(self, *exc):
        try:
            self.state = random.getstate()
            random.setstate(self.caller)
        finally:
            _ONE_AT_A_TIME.release()
        return False


class TextArena:
    """One textarena single-player game per trajectory (see the module docstring)."""

    def __init__(self, game: str = "", reward: str = "win", prompt: str = "", stop: str = "", seed: int = 0,
                 max_new_tokens: int = 0, **game_options: str) -> None:
        if not game:
            raise RlkitError("environment textarena: which game? expected game=ID, e.g. game=GuessTheNumber-v0")
        if reward not in REWARDS:
            raise RlkitError(f"environment textarena: reward={reward!r}: expected win or shaped")
        library()
        self.game, self.id = game, raw_id(game)
        self.reward_mode, self.prompt = reward, unescape(prompt) if prompt else ""
        self.base_seed = int(seed)
        self.options = _typed_game_options(self.id, game_options)
        if stop:
            self.stop = (unescape(stop),)
        if max_new_tokens:
            self.max_new_tokens = int(max_new_tokens)
        self.env = None
        self.random = _Randomness()

    @staticmethod
    def option_attribute(name: str, options: dict):
        """`stop` and `max_new_tokens` as the options set them; `prompt_hint` (what the driver's line says when the
        game's opening message does not fit the model's context) naming the game and `prompt=TEXT`."""
        if name == "prompt_hint":
            spec = f"--env textarena:game={options.get('game') or 'ID'},prompt=TEXT"
            if options.get("prompt"):
                return f"the prompt=TEXT given is too long for it: give a shorter one ({spec}; \\n escapes)"
            return f"give a shorter prompt in place of the game's rules with the option prompt=TEXT ({spec}; \\n escapes)"
        return option_attribute(name, options)

    @classmethod
    def library(cls) -> str:
        """The library version the manifests record (EnvSpec.fingerprint)."""
        return f"textarena=={library_version('textarena')}"

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Before any model loads: the game exists, takes the options, and starts single-player offline."""
        env = cls(**options)
        state = random.getstate()
        try:
            env._start(0)
        finally:
            random.setstate(state)
            env.env = None

    # -- the examples: game seeds ------------------------------------------------------------------------------------
    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """One example per game seed: the train split's seeds even, the held-out split's odd, each a deterministic
        function of (split, seed, i); endless."""
        check_split(split)
        for i in itertools.count():
            h = int.from_bytes(hashlib.blake2b(f"{self.id}|{split}|{seed}|{i}".encode(), digest_size=4).digest(),
                               "big") >> 2
            s = self.base_seed + 2 * h + (split == "heldout")
            yield Example(f"{split}-{seed}-{i}", f"{self.id} seed {s}", str(s), split)

    # -- the protocol ------------------------------------------------------------------------------------------------
    def _start(self, seed: int) -> str:
        ta = library()
        try:
            with self.random, _quiet():
                self.env = ta.make(self.id, **self.options)
                self.env.reset(num_players=1, seed=seed)
                _, obs = self.env.get_observation()
        except RlkitError:
            raise
        except BaseException as e:  # noqa: BLE001 (textarena's own failures are one line, never a traceback)
            if isinstance(e, KeyboardInterrupt):
                raise
            raise RlkitError(f"environment textarena: game {self.game} cannot be played here: {_why_not(self.game, e)}"
                             ) from None
        return self._messages(obs, first=True)

    def reset(self, example) -> str:
        try:
            seed = int(example.answer)
        except (TypeError, ValueError):
            seed = self.base_seed + (int.from_bytes(hashlib.blake2b(str(example.prompt_id).encode(),
                                                                    digest_size=4).digest(), "big") >> 1)
        text = self._start(seed)
        return text if not self.prompt else self.prompt

    def step(self, action: str) -> Step:
        if self.env is None:
            raise EnvError(f"environment textarena {self.game}: step() before reset()")
        with self.random, _quiet():  # some games print as they play: never onto stdout (the Arrow pipe)
            done, _ = self.env.step(action)
            if done:
                rewards, _ = self.env.close()
                self.env = None
            else:
                _, obs = self.env.get_observation()
        if done:
            r = _number(rewards.get(0) if isinstance(rewards, dict) else None)
            return Step(None, r if self.reward_mode == "shaped" else float(r >= 1.0), terminated=True)
        text = self._messages(obs)
        return Step(text if action.endswith("\n") or not text else "\n" + text, 0.0)

    def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            try:
                with self.random, _quiet():
                    env.close()
            except Exception:  # noqa: BLE001 (a game abandoned mid-way)
                pass

    def _messages(self, obs, first: bool = False) -> str:
        """The game's new messages, one per line: the player's own action echoed back is dropped."""
        from textarena.core import ObservationType

        if isinstance(obs, str):
            return obs if obs.endswith("\n") else obs + "\n"
        lines = []
        for item in obs or ():
            if not isinstance(item, tuple | list):
                lines.append(str(item))
                continue
            if ObservationType.PLAYER_ACTION in item:  # the player's own action echoed back (some games garble the
                continue                               # tuple's order: the type is looked for anywhere in it)
            texts = [x for x in item if isinstance(x, str) and not isinstance(x, ObservationType)]
            lines.append(texts[0] if texts else str(item[1] if len(item) > 1 else item[0]))
        text = "\n".join(lines)
        return text + "\n" if text else ("" if not first else "\n")


def _number(value) -> float:
    """A game's reward as a float (a few games put their reason text there when a move is invalid: 0.0)."""
    import math

    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) else 0.0


_MULTI = ("TwoPlayerState(", "FFAMultiPlayerState(", "TeamMultiPlayerState(", "MinimalMultiPlayerState(")
_API = ("OpenRouterAgent(", "OpenRouterJury", "OpenAI(", "api_key")
_NLTK = ("nltk.download(", "EnglishDictionary(", "nltk.corpus")


def static_refusal(game_id: str) -> str | None:
    """Why a game cannot be played here, read from its source without importing it (a game's import may start
    downloads): it is for several players, calls a hosted model, needs NLTK data, or does not compile under this
    Python. None: nothing against it (starting it is the final check)."""
    from pathlib import Path

    spec = _registry()[game_id]
    if not isinstance(spec.entry_point, str):
        return None
    mod = spec.entry_point.partition(":")[0]
    root = Path(library().__file__).parent  # the module's file, found without importing its package
    head, _, rest = mod.partition(".")
    path = root.joinpath(*rest.split(".")).with_suffix(".py") if head == "textarena" else None
    if path is None or not path.is_file():
        return None if path is None else f"its module {mod} is missing from textarena's installation"
    src = path.read_text(errors="replace")
    try:
        compile(src, str(path), "exec")
    except SyntaxError as e:
        import sys

        return (f"its code does not compile under Python {sys.version_info.major}.{sys.version_info.minor} "
                f"(SyntaxError: {e.msg}, line {e.lineno})")
    if any(m in src for m in _API):
        return "it calls a hosted model and needs an API key (OPENROUTER_API_KEY); rlkit runs offline"
    if any(m in src for m in _NLTK):
        return "it needs NLTK data downloaded at start, which is not available offline"
    if any(m in src for m in _MULTI) and "SinglePlayerState(" not in src:
        return "it is a game for more than one player; rlkit plays single-player games"
    return None


def _typed_game_options(game_id: str, options: dict[str, str]) -> dict:
    """The game's constructor options, typed by its annotations (int, float, bool, str); unknown keys one line."""
    from rlkit.plugins import typed_options

    why = static_refusal(game_id)
    if why is not None:
        raise RlkitError(f"environment textarena: game {game_id.removesuffix('-raw')} cannot be played here: {why}")
    spec = _registry()[game_id]
    mod, _, cls = spec.entry_point.partition(":") if isinstance(spec.entry_point, str) else ("", "", "")
    if not cls:
        return dict(options)
    import importlib

    try:
        with _quiet():
            game_cls = getattr(importlib.import_module(mod), cls)
    except BaseException as e:  # noqa: BLE001 (a game whose module fails to import: refused in one line)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RlkitError(f"environment textarena: game {game_id.removesuffix('-raw')} cannot be played here: "
                         f"{_why_not(game_id, e)}") from None
    try:
        params = inspect.signature(game_cls).parameters
    except (TypeError, ValueError):
        return dict(options)
    for k in options:
        if k not in params:
            known = ", ".join(n for n in params if n not in ("self",))
            raise RlkitError(f"unknown option {k!r} for environment textarena game {game_id.removesuffix('-raw')}; "
                             f"the game takes {known or 'no options'}, and rlkit's {', '.join(OWN[1:])}")
    return typed_options(game_cls, options, f"textarena game {game_id.removesuffix('-raw')}")
