"""The agent loop runs environments concurrently: on the real tiny model, through the real CLI (and the sampling driver
on a real HF engine for what only the engine object shows). Calls of different trajectories run at once
(`--env-workers` threads; `async def` methods on an event loop), and with the default `--env-schedule` on hf the table
at a seed is the same whatever the environment's latencies and `--env-workers`; `ready` hands each trajectory to the
engine as soon as its environment answered; a call past `--env-timeout` ends its trajectory also when the driver runs
off the main thread; an environment calling sys.exit() is one line, not the end of the process."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlkit.io import streams

from conftest import run_cli_inproc

pytestmark = pytest.mark.slow

ENVS = '''
import asyncio
import hashlib
import threading
import time
from pathlib import Path

from rlkit.envs.base import Step


def latency(key: str, scale: float) -> float:
    """A seeded random time in [0, scale)."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return scale * (h % 1000) / 1000


LOCK, RUNNING = threading.Lock(), {}  # path -> [calls running now, the most at once]


class Peak:
    """The most calls of the instances given `path` running at once, written to `path` as it grows."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self):
        with LOCK:
            c = RUNNING.setdefault(self.path, [0, 0])
            c[0] += 1
            if c[0] > c[1]:
                c[1] = c[0]
                if self.path:
                    Path(self.path).write_text(str(c[1]))

    def __exit__(self, *exc):
        with LOCK:
            RUNNING[self.path][0] -= 1


class Sleepy:
    """Three model turns; each reset and step sleeps a seeded random time (latencies `lat`, up to `scale` s); the
    observation and reward depend on the model's turn only."""

    def __init__(self, scale: float = 0.05, lat: int = 0, peak: str = ""):
        self.scale, self.lat, self.peak = scale, lat, Peak(peak)

    def reset(self, example):
        with self.peak:
            self.id, self.turn = example.prompt_id, 0
            time.sleep(latency(f"{self.lat}|{self.id}|reset", self.scale))
            return example.prompt

    def step(self, action):
        with self.peak:
            self.turn += 1
            time.sleep(latency(f"{self.lat}|{self.id}|{self.turn}|{action}", self.scale))
            return self.answer(action)

    def answer(self, action):
        if self.turn >= 3:
            return Step(None, float(len(action) % 3), terminated=True)
        return Step(f" [{self.turn}:{len(action)}]=", 0.25)


class AsyncSleepy(Sleepy):
    """Sleepy's episodes, its methods async (awaited on the driver's event loop)."""

    async def reset(self, example):
        with self.peak:
            self.id, self.turn = example.prompt_id, 0
            await asyncio.sleep(latency(f"{self.lat}|{self.id}|reset", self.scale))
            return example.prompt

    async def step(self, action):
        with self.peak:
            self.turn += 1
            await asyncio.sleep(latency(f"{self.lat}|{self.id}|{self.turn}|{action}", self.scale))
            return self.answer(action)


class Scarce(Sleepy):
    """Sleepy without latencies, declaring no session limit, but only `sessions` of its instances can be between
    reset and close at once: a reset beyond them raises Busy (a server at capacity); the most at once go to `peak`."""

    held: set = set()
    most = 0

    def __init__(self, sessions: int = 2, peak: str = ""):
        super().__init__(0.0)
        self.sessions, self.path = sessions, peak

    def reset(self, example):
        from rlkit.envs import Busy

        with LOCK:
            if len(Scarce.held) >= self.sessions:
                raise Busy("no session free", wait=30)
            Scarce.held.add(id(self))
            Scarce.most = max(Scarce.most, len(Scarce.held))
            Path(self.path).write_text(str(Scarce.most))
        return super().reset(example)

    def close(self):
        with LOCK:
            Scarce.held.discard(id(self))


class Stuck(Sleepy):
    """Sleepy without latencies, but the instance made `stuck_at`-th spins for ever (a Python loop) in its second step,
    counting its spins in `spins`."""

    made = 0

    def __init__(self, stuck_at: int = 1, spins: str = ""):
        super().__init__(0.0)
        self.k, Stuck.made = Stuck.made, Stuck.made + 1
        self.stuck, self.spins = self.k == stuck_at, spins

    def step(self, action):
        self.turn += 1
        n = 0
        while self.stuck and self.turn == 2:
            n += 1
            if n % 100_000 == 0:
                Path(self.spins).write_text(str(n))
        return self.answer(action)
'''
P, N = 3, 2


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("envs") / "envs.py"
    f.write_text(ENVS)
    return f


def _table(sft_dir: Path, env: str, out: Path, *args: str):
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", env, "--num-prompts", str(P), "--n", str(N),
                       "--seed", "5", "--max-new-tokens", "6", "--out", str(out), *args)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    t, _ = streams.read_table(out, ["rollouts"])
    return t


def test_the_table_at_a_seed_is_the_same_whatever_the_latencies_and_env_workers(sft_dir, envs, tmp_path):
    """hf's default `--env-schedule` (turns): the calls run at once, the turns stay batched as they always were, so
    the rows (every column) are the same with instant calls one at a time and with seeded random latencies on 8
    workers, on the default number, or awaited (async def) on the event loop."""
    peak = {k: tmp_path / f"peak-{k}" for k in ("one", "eight", "async")}
    base = _table(sft_dir, f"{envs}:Sleepy:scale=0,peak={peak['one']}", tmp_path / "a.arrow", "--env-workers", "1")
    assert base.num_rows == P * N and set(base.column("turns").to_pylist()) == {3}
    tables = [
        _table(sft_dir, f"{envs}:Sleepy:scale=0.08,lat=1,peak={peak['eight']}", tmp_path / "b.arrow",
               "--env-workers", "8"),
        _table(sft_dir, f"{envs}:Sleepy:scale=0.08,lat=2", tmp_path / "c.arrow"),
        _table(sft_dir, f"{envs}:AsyncSleepy:scale=0.08,lat=3,peak={peak['async']}", tmp_path / "d.arrow",
               "--env-workers", "1"),
    ]
    for t in tables:
        assert t.schema.remove_metadata() == base.schema.remove_metadata()
        for name in base.column_names:
            assert t.column(name).to_pylist() == base.column(name).to_pylist(), name
    assert peak["one"].read_text() == "1"  # one call at a time: today's order
    assert 1 < int(peak["eight"].read_text()) <= 8  # calls of different trajectories at once, at most 8
    assert int(peak["async"].read_text()) > 1  # async methods awaited together, not queued for the one thread


def test_ready_hands_each_trajectory_to_the_engine_as_its_environment_answers(sft_dir, envs):
    """`--env-schedule ready` on hf: the next batch is the trajectories ready when the engine is free, so a slow
    trajectory's step does not hold the others back; each row is still token-exact (the engine's turns, the
    environment's observations)."""
    from rlkit import engines
    from rlkit.envs import get_env
    from rlkit.io import data
    from rlkit.sampling import Prompts, Sampling, run_episodes
    from rlkit.tasks import get_task

    engine = engines.create("hf", sft_dir, engines.EngineOptions(seed=0, device="cpu"))
    batches = []
    sample = engine.sample

    def recorded(prompt_ids, **kw):
        batches.append(len(prompt_ids))
        return sample(prompt_ids, **kw)

    engine.sample = recorded
    ex = get_task("arithmetic").examples("train", 4, 1)
    prompts = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex],
                      data.encode_prompts(engine.tokenizer, [e.prompt for e in ex], False))
    s = Sampling(n=2, max_new_tokens=6, max_turns=5, env_schedule="ready", env_workers=8)
    ep = run_episodes(engine, engine.tokenizer, get_env(f"{envs}:Sleepy:scale=0.3,lat=4"), prompts, s, seed=3)
    engine.close()
    c = ep.columns
    assert c["turns"] == [3] * 8 and c["end_reason"] == ["terminated"] * 8
    assert sum(batches) == 8 * 3 and len(batches) > 3  # the turns went in more batches than the 3 of `turns`
    tok = engine.tokenizer
    for ids, mask, msgs in zip(c["completion_ids"], c["loss_mask"], c["messages"], strict=True):
        said = [m["content"] for m in msgs if m["role"] == "assistant"]
        obs = [tok(m["content"], add_special_tokens=False)["input_ids"] for m in msgs[1:] if m["role"] == "user"]
        assert [tok.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)] == \
            ["".join(said)]
        assert [t for t, m in zip(ids, mask, strict=True) if not m] == [t for o in obs for t in o]


@pytest.mark.parametrize("schedule", ["turns", "ready"])
def test_a_reset_refused_as_busy_waits_for_a_session(sft_dir, envs, tmp_path, schedule):
    """An environment whose resets find no session free (Busy) beyond 2 at once: the trajectories wait for the ones
    that end (whose close gives the session back), and every one of them runs to its end."""
    peak = tmp_path / "peak"
    t = _table(sft_dir, f"{envs}:Scarce:sessions=2,peak={peak}", tmp_path / "r.arrow", "--env-schedule", schedule)
    assert t.column("end_reason").to_pylist() == ["terminated"] * P * N and set(t.column("turns").to_pylist()) == {3}
    assert peak.read_text() == "2"


def test_a_call_past_its_limit_ends_its_trajectory_also_off_the_main_thread(sft_dir, envs, tmp_path):
    """The time limit is the driver's own (a watchdog thread), not SIGALRM: run_episodes in a thread of its own (as a
    library user may run it) gives the spinning trajectory up after --env-timeout, its Python loop stops, and the
    others run to their end."""
    from rlkit import engines
    from rlkit.envs import get_env
    from rlkit.io import data
    from rlkit.sampling import Prompts, Sampling, run_episodes
    from rlkit.tasks import get_task

    engine = engines.create("hf", sft_dir, engines.EngineOptions(seed=0, device="cpu"))
    ex = get_task("arithmetic").examples("train", 2, 1)
    prompts = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex],
                      data.encode_prompts(engine.tokenizer, [e.prompt for e in ex], False))
    spins = tmp_path / "spins"
    out: list = []
    s = Sampling(n=2, max_new_tokens=6, max_turns=5, env_timeout=1.0, env_errors="end", env_workers=2)
    th = threading.Thread(target=lambda: out.append(run_episodes(
        engine, engine.tokenizer, get_env(f"{envs}:Stuck:stuck_at=1,spins={spins}"), prompts, s, seed=3)), daemon=True)
    th.start()
    th.join(120)
    engine.close()
    assert not th.is_alive() and out, "run_episodes did not return: the stuck call was never given up"
    c = out[0].columns
    assert c["end_reason"][1] == "error: step did not return within 1 s" and c["reward/env"][1] == 0.0
    assert [c["end_reason"][k] for k in (0, 2, 3)] == ["terminated"] * 3
    n = spins.read_text()
    threading.Event().wait(0.5)
    assert spins.read_text() == n  # the loop was stopped in its thread, not left spinning


EXITS = '''
import sys

from rlkit.envs.base import Step


class Quits:
    def reset(self, example):
        return example.prompt

    def step(self, action):
        sys.exit(3)
'''


def test_an_environment_calling_sys_exit_is_one_line(sft_dir, tmp_path):
    f = tmp_path / "quits.py"
    f.write_text(EXITS)
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", f"{f}:Quits", "--num-prompts", "2", "--n", "2",
                       "--out", str(out))
    err = r.stderr.decode()
    lines = err.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert lines[-1].startswith("rlkit: error: environment Quits: step() called sys.exit(3) on prompt ")
    assert not out.exists()
