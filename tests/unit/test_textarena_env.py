"""textarena's single-player games through `--env textarena:...` on the real library (the `textarena` extra,
installed by `make test`), played by scripted players: observations, rewards, seeds, the caller's random state,
and the games that cannot run here refused in one line."""

from __future__ import annotations

import random

import pytest

from rlkit.envs import get_env
from rlkit.errors import RlkitError

GUESS = "textarena:game=GuessTheNumber-v0,max_turns=6,stop=\\n"


def _secret(env) -> int:
    return env.env.game_number  # the game's own state (a test's peek)


def _bisect(spec: str, example) -> tuple[list, float]:
    env = get_env(spec).make()
    env.reset(example)
    lo, hi, seen = 1, 20, []
    while True:
        g = (lo + hi) // 2
        s = env.step(f"[{g}]\n")
        seen.append(s)
        if s.terminated:
            env.close()
            return seen, s.reward
        assert s.observation in ("The target number is higher.\n", "The target number is lower.\n")
        lo, hi = (g + 1, hi) if "higher" in s.observation else (lo, g - 1)


def test_guess_the_number_played_by_bisection_wins():
    spec = get_env(GUESS)
    assert spec.attribute("stop") == ("\n",) and spec.fingerprint.startswith("builtin:textarena+textarena==")
    env = spec.make()
    ex = next(env.iter_examples("train", 0))
    prompt = env.reset(ex)
    assert "You are playing Guess The Number" in prompt and prompt.endswith("Enter your guess.\n")
    steps, reward = _bisect(GUESS, ex)
    assert reward == 1.0 and len(steps) <= 5 and all(s.reward == 0.0 for s in steps[:-1])


def test_win_loss_and_shaped_rewards_and_the_forgiven_invalid_move():
    ex = next(get_env(GUESS).make().iter_examples("train", 1))
    for mode in ("win", "shaped"):
        env = get_env(GUESS + f",reward={mode}").make()
        env.reset(ex)
        secret = _secret(env)
        wrong = [g for g in range(1, 21) if g != secret][:7]
        steps = [env.step(f"[{g}]") for g in wrong]
        last = next(s for s in steps if s.terminated)
        # textarena allows max_turns + 1 guesses; a lost game pays closeness only with reward=shaped
        assert steps.index(last) == 6
        assert last.reward == (0.0 if mode == "win" else pytest.approx(1 - abs(wrong[6] - secret) / 19))
        assert steps[0].observation.startswith("\n")  # the turn had no newline: the game's answer starts one
    env = get_env(GUESS).make()
    env.reset(ex)
    first = env.step("no number here\n")
    assert not first.terminated and first.observation.startswith("You attempted an invalid move.")
    second = env.step("still none\n")
    assert second.terminated and second.reward == 0.0


def test_seeds_splits_and_the_callers_random_state():
    env = get_env(GUESS).make()
    train = list(zip(range(50), env.iter_examples("train", 0), strict=False))
    held = list(zip(range(50), env.iter_examples("heldout", 0), strict=False))
    assert all(int(e.answer) % 2 == 0 for _, e in train) and all(int(e.answer) % 2 == 1 for _, e in held)
    assert [e for _, e in train] == [e for _, e in zip(range(50), env.iter_examples("train", 0), strict=False)]
    # one seed, one game; the caller's random stream untouched by textarena's reseeding
    random.seed(123)
    state = random.getstate()
    a, b = get_env(GUESS).make(), get_env(GUESS).make()
    a.reset(train[0][1])
    b.reset(train[0][1])
    assert _secret(a) == _secret(b) and a.step("[10]\n") == b.step("[10]\n")
    assert random.getstate() == state


@pytest.mark.parametrize(("game", "action"), [("Mastermind-v0", "[1 2 3 4]"), ("TowerOfHanoi-v0", "[A C]"),
                                              ("FrozenLake-v0", "[down]")])
def test_other_single_player_games_run(game, action):
    env = get_env(f"textarena:game={game}").make()
    ex = next(env.iter_examples("train", 0))
    assert env.reset(ex).strip()
    s = env.step(action)
    assert s.terminated or (s.observation and action not in s.observation.splitlines())  # the echo is dropped
    env.close()


@pytest.mark.parametrize(("game", "why"), [
    ("Battleship-v0", "is a game for more than one player"),
    ("MarketEntryGame-v0", "is a game for more than one player"),  # accepts one player at reset, but is not one
    ("TwentyQuestions-v0", "needs an API key (OPENROUTER_API_KEY)"),
    ("Hangman-v0", "needs NLTK data downloaded at start"),
    ("UltimateTexasHoldem-v0", "its code does not compile under Python"),
    ("BabyAiText-v0", "it does not start here (ModuleNotFoundError: No module named 'gym')"),
])
def test_games_that_cannot_run_here_are_refused_in_one_line(game, why):
    with pytest.raises(RlkitError) as e:
        get_env(f"textarena:game={game}")
    assert f"game {game} cannot be played here: " in str(e.value) and why in str(e.value)
    assert "\n" not in str(e.value)
