"""The built-in `guess` environment and task: the game's rules (feedback, win, loss at the turn limit, invalid
guesses), the split of secrets, the SFT transcripts replayed through the environment, and the sampling driver
running it on the real tiny model, token-exact."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rlkit.envs import Step, get_env
from rlkit.envs.guess import Game, Guess, GuessNumber, first_integer, replay
from rlkit.errors import RlkitError
from rlkit.tasks import get_task
from rlkit.tasks.base import Example


def new_game(secret: int, **opts) -> GuessNumber:
    env = GuessNumber(**opts)
    assert env.reset(Example("p", env.game.prompt, str(secret), "train")) == env.game.prompt
    return env


# -- the rules ------------------------------------------------------------------------------------------------------

def test_feedback_then_a_win():
    env = new_game(13)
    assert env.step("10\n") == Step("higher\n", 0.0)  # the secret is higher than the guess
    assert env.step("16\n") == Step("lower\n", 0.0)
    assert env.step("12\n") == Step("higher\n", 0.0)
    assert env.step("13\n") == Step(None, 1.0, terminated=True)
    assert env.turn == 4


@pytest.mark.parametrize("turns", [1, 3, 6])
def test_the_last_turn_can_win_and_one_more_wrong_guess_loses(turns):
    env = new_game(20, turns=turns)
    for _ in range(turns - 1):
        assert env.step("1\n") == Step("higher\n", 0.0)
    assert env.step("20\n") == Step(None, 1.0, terminated=True)
    env = new_game(20, turns=turns)
    for _ in range(turns - 1):
        assert env.step("1\n").observation == "higher\n"
    assert env.step("19\n") == Step(None, 0.0, terminated=True)  # out of turns: lost, reward 0


@pytest.mark.parametrize("action", ["\n", "ten\n", "0\n", "21\n", "-3\n", "1000\n", "", "<eos>"])
def test_invalid_guesses_say_so_and_count_as_turns(action):
    env = new_game(5, turns=3)
    want = "invalid\n" if action.endswith("\n") else "\ninvalid\n"
    assert env.step(action) == Step(want, 0.0)
    assert env.step(action) == Step(want, 0.0)
    assert env.step(action) == Step(None, 0.0, terminated=True)


@pytest.mark.parametrize(("text", "n"), [("7\n", 7), ("7 or 8\n", 7), ("x12y\n", 12), ("  3", 3), ("-2\n", -2),
                                        ("05\n", 5), ("no\n", None), ("", None)])
def test_the_guess_is_the_first_integer(text, n):
    assert first_integer(text) == n


def test_a_turn_cut_before_its_newline_gets_the_feedback_on_its_own_line():
    env = new_game(3)
    assert env.step("10") == Step("\nlower\n", 0.0)  # --max-new-tokens cut the turn: the transcript stays lines
    assert env.step("1\n") == Step("higher\n", 0.0)
    assert env.step("3") == Step(None, 1.0, terminated=True)


def test_the_environment_as_the_driver_loads_it():
    spec = get_env("guess:high=50,turns=4")
    env = spec.make()
    assert (env.game.high, env.game.turns) == (50, 4) and spec.spec == "guess:high=50,turns=4"
    assert spec.attribute("stop") == ("\n",) and spec.attribute("max_new_tokens") == 5
    assert len("9999\n") <= GuessNumber.max_new_tokens  # the largest guess and its newline fit one turn
    with pytest.raises(RlkitError, match="step\\(\\) before reset\\(\\)"):
        GuessNumber().step("3\n")


@pytest.mark.parametrize(("spec", "error"), [
    ("guess:high=1", "environment guess: high=1: expected 2 <= high <= 9999"),
    ("guess:high=10000", "high=10000: expected 2 <= high <= 9999"),
    ("guess:turns=0", "environment guess: turns=0: expected turns >= 1"),
    ("guess:heldout=1", "heldout=1: expected 0 <= heldout < 1"),
    ("guess:high=ten", "not a valid int"),
    ("guess:rounds=3", "unknown option 'rounds'"),
])
def test_bad_environment_options_are_one_line(spec, error):
    with pytest.raises(RlkitError, match=re.escape(error)):
        get_env(spec).make()


@pytest.mark.parametrize("answer", ["0", "21", "seven", ""])
def test_reset_refuses_a_secret_out_of_range(answer):
    with pytest.raises(RlkitError, match=re.escape("is not a secret number in 1..20")):
        GuessNumber().reset(Example("p", "Guess 1-20:\n", answer, "train"))


# -- examples and the split -----------------------------------------------------------------------------------------

def test_by_default_every_secret_is_played_in_both_splits():
    game = Game()
    assert game.heldout_secrets() == frozenset() and game.secrets("train") == game.secrets("heldout") == list(
        range(1, 21))
    for seed in (0, 1):  # the held-out split: each secret's game once, shuffled by the seed
        ex = list(game.iter_examples("heldout", seed))
        assert sorted(int(e.answer) for e in ex) == list(range(1, 21)) and {e.split for e in ex} == {"heldout"}
    assert [e.answer for e in game.iter_examples("heldout", 0)] != [e.answer for e in game.iter_examples("heldout", 1)]


@pytest.mark.parametrize("high", [2, 5, 20, 100])
def test_held_out_secrets_are_never_trained_on(high):
    game = Game(high=high, heldout=0.2)
    held = game.heldout_secrets()
    assert 1 <= len(held) < high and held == Game(high=high, heldout=0.2).heldout_secrets()  # whatever the seeds
    train = {int(e.answer) for s in (0, 1, 2) for e in itertools.islice(game.iter_examples("train", s), 400)}
    assert train == set(range(1, high + 1)) - held
    drawn = [int(e.answer) for e in itertools.islice(game.iter_examples("train", 0), 5 * len(train))]
    for k in range(5):  # in passes: every secret once a pass, so a batch's games spread evenly over the secrets
        assert sorted(drawn[k * len(train):(k + 1) * len(train)]) == sorted(train)
    assert drawn[:len(train)] != drawn[len(train):2 * len(train)] or len(train) == 1
    for seed in (0, 1):
        ex = list(game.iter_examples("heldout", seed))  # unique: each held-out secret once
        assert sorted(int(e.answer) for e in ex) == sorted(held)
        assert {e.prompt for e in ex} == {f"Guess 1-{high}:\n"} and {e.split for e in ex} == {"heldout"}
    assert sorted(int(e.answer) for e in game.iter_examples("train", 3, unique=True)) == game.secrets("train")


@pytest.mark.parametrize("high", [3, 20, 100])
def test_bisection_reaches_held_out_secrets_through_positions_training_games_reach(high):
    """Each held-out secret is the middle of a range bisection meets, and a training secret lies in that range too:
    the bisecting player's game against it runs through positions a training game also reaches, and is won."""
    game = Game(high=high, heldout=0.2)
    ranges, train = game.bisection_ranges(), set(game.secrets("train"))
    assert sorted(ranges) == list(range(1, high + 1))  # every secret is the middle of one range
    best = Guess(high=high, turns=high.bit_length(), heldout_fraction=0.2, bisect=1.0, linear=0.0)
    prefixes = {best.completion(ex)[:best.completion(ex).rfind("\n", 0, -1) + 1]
                for ex in best.examples("train", 20 * high, 0)}
    for ex in game.iter_examples("heldout", 0):
        lo, hi = ranges[int(ex.answer)]
        assert train & set(range(lo, hi + 1))
        text = best.completion(ex)
        assert best.reward(text, ex.answer) == 1.0
        before_win = text[:text.rfind("\n", 0, -1) + 1]  # the game up to its winning guess
        assert any(p.startswith(before_win) for p in prefixes) or before_win == ""


def test_examples_are_seeded_and_shared_by_the_task_and_the_environment():
    env, task = GuessNumber(), get_task("guess")
    a = list(itertools.islice(env.iter_examples("train", 7), 50))
    assert a == task.examples("train", 50, 7) == list(itertools.islice(get_env("guess").make().iter_examples(
        "train", 7), 50))
    assert a != task.examples("train", 50, 8)
    assert len(set(e.prompt_id for e in a)) == 50 and len(a[0].prompt) <= 16


# -- the task: SFT transcripts ---------------------------------------------------------------------------------------

def play_back(transcript: str, secret: int, **opts) -> tuple[str, float]:
    """A transcript's guesses played against a fresh GuessNumber, written out as the driver appends them: each
    line the model's turn, then the environment's observation; (the game's text, its reward)."""
    env = new_game(secret, **opts)
    out, reward = "", None
    for line in re.findall(r"[^\n]*\n", transcript)[::2]:  # the guesses: every other line
        out += line
        st = env.step(line)
        if st.terminated:
            reward = st.reward
            break
        out += st.observation
    assert reward is not None, f"the game did not end: {transcript!r}"
    return out, reward


@pytest.mark.parametrize("spec", ["guess", "guess:high=100,turns=8,bisect=0.2,linear=0.6", "guess:high=3,turns=1"])
def test_sft_transcripts_are_what_the_environment_produces(spec):
    task = get_task(spec)
    opts = {"high": task.high, "turns": task.turns}
    outcomes = Counter()
    for ex in task.examples("train", 300, 0):
        text = task.completion(ex)
        again, reward = play_back(text, int(ex.answer), **opts)
        assert again == text, (text, again)
        assert task.reward(text, ex.answer) == reward and replay(text, ex.answer, task.game) == (
            reward, len(task.guesses(ex)))
        outcomes[reward] += 1
    if task.turns > 1:
        assert outcomes[1.0] > 0 and outcomes[0.0] > 0  # a noisy player: it wins, and loses some


def test_the_noisy_player_mixes_strategies_and_never_contradicts_the_feedback():
    task = get_task("guess")
    firsts, turns, wins = Counter(), [], 0
    for ex in task.examples("train", 2000, 1):
        gs, secret = task.guesses(ex), int(ex.answer)
        lo, hi = 1, 20
        for g in gs:
            assert lo <= g <= hi  # within what the feedback still allows
            lo, hi = (g + 1, hi) if secret > g else (lo, g - 1) if secret < g else (g, g)
        firsts[gs[0]] += 1
        turns.append(len(gs))
        wins += gs[-1] == secret
    assert firsts[10] / 2000 == pytest.approx(0.4 + 0.3 / 20, abs=0.04)  # bisect, or random landing on 10
    assert firsts[1] / 2000 == pytest.approx(0.3 + 0.3 / 20, abs=0.04)  # linear: count up from 1
    assert wins / 2000 == pytest.approx(0.85, abs=0.04) and sum(turns) / 2000 == pytest.approx(4.35, abs=0.15)
    # bisection alone always wins 1..20 within 5 turns: the room RL has
    best = get_task("guess:bisect=1,linear=0")
    assert all(len(best.guesses(ex)) <= 5 and best.reward(best.completion(ex), ex.answer) == 1.0
               for ex in best.examples("train", 200, 1))


@pytest.mark.parametrize(("text", "reward"), [
    ("10\nlower\n5\nhigher\n7\n", 1.0),
    ("10\nlower\n5\nhigher\n7", 1.0),  # the last turn's newline may be missing (eos ended it)
    ("10\nlower\n5\nhigher\n7\n<anything after the win is not read>", 1.0),
    ("7\n", 1.0),
    ("10\nhigher\n5\nhigher\n7\n", 0.0),  # feedback not the environment's
    ("10\nlower\n5\n", 0.0),  # broke off
    ("10\nlower\n5\nhigher\n", 0.0),
    ("", 0.0),
    ("x\ninvalid\n7\n", 1.0),
    ("1\nhigher\n2\nhigher\n3\nhigher\n4\nhigher\n5\nhigher\n6\nhigher\n7\n", 0.0),  # the 7th turn: too late
])
def test_the_task_verifier_replays_a_written_game(text, reward):
    assert get_task("guess").reward(text, "7") == reward


@pytest.mark.parametrize(("spec", "error"), [
    ("guess:bisect=0.8,linear=0.3", "expected shares >= 0 that sum to at most 1"),
    ("guess:linear=-0.1", "expected shares >= 0"),
    ("guess:high=1", "task guess: high=1: expected 2 <= high <= 9999"),
    ("guess:turns=x", "--task guess: turns='x' is not an integer"),
    ("guess:level=3", "unknown option 'level' for task guess"),
])
def test_bad_task_options_are_one_line(spec, error):
    with pytest.raises(RlkitError, match=re.escape(error)):
        get_task(spec)


def test_task_spec_round_trips_and_its_length_fits_a_game():
    t = get_task("guess:high=100,turns=8,bisect=0.5")
    assert isinstance(t, Guess) and get_task(t.spec) == t and t.name == "guess"
    longest = max((t.completion(ex) for ex in t.examples("train", 500, 0)), key=len)
    assert len(longest) <= t.max_new_tokens
    assert len("100\ninvalid\n" * 8) <= t.max_new_tokens  # the longest game a model can write


# -- the driver on the real tiny model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guess_policy(tmp_path_factory) -> Path:
    """The tiny model after a short SFT on guess transcripts: it writes one guess a line (not always well)."""
    out = tmp_path_factory.mktemp("guess") / "sft"
    r = subprocess.run([sys.executable, "-m", "rlkit", "sft", "--task", "guess", "--out", str(out), "--num-examples",
                        "800", "--eval-num", "4", "--batch-tokens", "256", "-q"], capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return out


def _prompts(tok, examples):
    from rlkit.sampling.driver import Prompts

    return Prompts(0, [e.prompt_id for e in examples], [e.answer for e in examples], [e.prompt for e in examples],
                   [tok(e.prompt)["input_ids"] for e in examples])


@pytest.mark.slow
def test_driver_runs_guess_on_the_tiny_model_token_exact(guess_policy):
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.sampling.driver import Sampling, run_episodes

    eng = engines.create("hf", guess_policy, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    spec = get_env("guess")
    ex = get_task("guess").examples("train", 8, 3)
    prompts = _prompts(tok, ex)
    s = Sampling(n=1, temperature=0, max_new_tokens=GuessNumber.max_new_tokens, max_turns=10)
    cols = run_episodes(eng, tok, spec, prompts, s, seed=1).columns

    # the same games by hand: greedy turns of the games still on, each feedback appended as its encoding (mask 0)
    want, mask = [[] for _ in ex], [[] for _ in ex]
    envs = [new_game(int(e.answer)) for e in ex]
    rewards, turns = [None] * len(ex), [0] * len(ex)
    active = list(range(len(ex)))
    while active:
        gen = eng.sample([prompts.prompt_ids[i] + want[i] for i in active], n=1, temperature=0, top_p=1.0,
                         max_new_tokens=GuessNumber.max_new_tokens, seed=0, stop=GuessNumber.stop)
        still = []
        for i, ids in zip(active, gen.completion_ids, strict=True):
            want[i] += ids
            mask[i] += [1] * len(ids)
            turns[i] += 1
            st = envs[i].step(tok.decode(ids, skip_special_tokens=True))
            if st.terminated:
                rewards[i] = st.reward
                continue
            obs = tok(st.observation, add_special_tokens=False)["input_ids"]
            want[i] += obs
            mask[i] += [0] * len(obs)
            still.append(i)
        active = still
    assert cols["completion_ids"] == want and cols["loss_mask"] == mask
    assert cols["reward/env"] == rewards and cols["turns"] == turns
    assert cols["terminated"] == [True] * len(ex) and cols["end_reason"] == ["terminated"] * len(ex)
    assert all(lp == 0.0 for lps, m in zip(cols["old_logprobs"], mask, strict=True)
               for lp, k in zip(lps, m, strict=True) if k == 0)
    texts = [tok.decode(c, skip_special_tokens=True) for c in want]
    assert all(re.match(r"\d+\n(higher|lower)\n", t) for t in texts if len(t) > 4), texts  # the format, learnt
    assert [replay(t, e.answer)[0] for t, e in zip(texts, ex, strict=True)] == rewards  # the verifier agrees


@pytest.mark.slow
def test_sampled_games_and_cut_turns_hold_the_environments_tokens(guess_policy):
    """Sampled (temperature 1), and with turns cut at 2 tokens (before the newline of a two-digit guess): every
    run of environment tokens is the encoding of what a fresh environment answers to the turns before it."""
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.sampling.driver import Sampling, run_episodes

    eng = engines.create("hf", guess_policy, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    ex = get_task("guess").examples("train", 6, 4)
    cut_seen = 0
    for max_new in (GuessNumber.max_new_tokens, 2):
        s = Sampling(n=3, temperature=1.0, max_new_tokens=max_new, max_turns=6)
        cols = run_episodes(eng, tok, get_env("guess"), _prompts(tok, ex), s, seed=5).columns
        for k, (ids, mask) in enumerate(zip(cols["completion_ids"], cols["loss_mask"], strict=True)):
            env = new_game(int(ex[k // 3].answer))
            runs = [(m, [t for _, t in g]) for m, g in itertools.groupby(zip(mask, ids, strict=True), lambda x: x[0])]
            assert [m for m, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
            for j in range(0, len(runs), 2):
                st = env.step(tok.decode(runs[j][1], skip_special_tokens=True))
                if j + 1 < len(runs):
                    assert not st.terminated
                    assert runs[j + 1][1] == tok(st.observation, add_special_tokens=False)["input_ids"]
                    cut_seen += st.observation.startswith("\n")
                else:
                    assert st.terminated and cols["reward/env"][k] == st.reward
            assert cols["turns"][k] == (len(runs) + 1) // 2 == env.turn
    assert cut_seen > 0  # turns cut before their newline did occur, and got their feedback on a line of its own


def test_a_random_guesser_is_judged_as_the_rules_say():
    """A thousand random games through the environment: the outcome is the rules' (win iff the secret was guessed
    within the turn limit), independent of how the guesses were written."""
    rng = random.Random(0)
    for _ in range(1000):
        secret, turns = rng.randint(1, 20), rng.randint(1, 6)
        env = new_game(secret, turns=turns)
        guesses = [rng.choice(["", "x", str(rng.randint(-2, 23))]) + rng.choice(["\n", " ok\n", ""])
                   for _ in range(turns)]
        for t, g in enumerate(guesses, 1):
            st = env.step(g)
            hit = first_integer(g) == secret
            if hit or t == turns:
                assert st == Step(None, float(hit), terminated=True)
                break
            n = first_integer(g)
            word = "invalid" if n is None or not 1 <= n <= 20 else "higher" if secret > n else "lower"
            assert st.observation == ("" if g.endswith("\n") else "\n") + word + "\n"
