"""The agent loop against slow environments, old code against new, on both engines: rollout wall and environment wait
(the wall during which the engine had nothing to sample) for an environment whose `step` takes 0.5 s and one with
heavy-tailed latency (most steps 20 ms, one in ten 2 s), each trajectory exactly 4 model turns.

Usage: python benchmarks/agent_loop.py --old /work/main [--policy DIR] [--prompts 64] [--n 4] [--workers 256]
                                       [--engines hf,vllm] [--kinds instant,fixed,heavy] [--repeats 1]
Every row is one process (`rlkit.sampling.run_episodes` on the real engine and the tiny policy, vLLM on its CPU
backend), run against the rlkit tree it names: the old one (`--old`, its checkout; sampled its way: every reset and
step one after another, on the main thread) and this one (`--env-workers` threads; `--env-schedule turns`, hf's
default, and `ready`, vLLM's). Each process runs a warm-up batch, then the instant environment, the 0.5 s one and the
heavy-tailed one, in that order. The figures per row:
  wall        the rollout's seconds (and the same run's against the instant environment);
  env wait    the wall outside the engine's calls (`sample`; a stream's `poll`, which waits for the engine's next
              step): the time nothing was being sampled because every trajectory waited on its environment;
  own max     the longest serial environment time of any one trajectory (the sum of its own steps' latencies), which
              no schedule can hide: the goal is env wait <= 1.25 x own max;
  same rows   the share of rows equal to the instant run's (turns: 100% whatever the latencies; ready: how
              reproducible the continuous table is when the latencies change).
The environment's latencies are drawn per trajectory from (prompt, sample) by a seeded generator, the same in every
row. `--kinds instant --repeats 5` times the instant environment alone (the median of 5 runs in one process): old
against new where the environment costs nothing. Without --policy the tiny model is trained for a few seconds first (its turns' text does not matter here).
The old code's rows sleep through every step in turn (about 8.5 min for the 0.5 s environment at the default sizes),
which costs the machine nothing but time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = '''
import random
import threading
import time

from rlkit.envs.base import Step

TURNS = 4
SLEPT = []  # each finished trajectory's own environment seconds
_LOCK = threading.Lock()
_SEEN = {}  # prompt id -> resets so far (the sample index, in the order the trajectories start)


class Agent:
    """TURNS model turns whatever the model says; each step sleeps: nothing (instant), 0.5 s (fixed), or 20 ms with
    one step in ten 2 s (heavy), drawn per trajectory from (prompt, sample)."""

    def __init__(self, kind: str = "instant"):
        self.kind = kind

    def reset(self, example):
        with _LOCK:
            j = _SEEN[example.prompt_id] = _SEEN.get(example.prompt_id, -1) + 1
        self.rng = random.Random(f"{example.prompt_id}|{j}")
        self.turn, self.slept = 0, 0.0
        return example.prompt

    def step(self, action):
        self.turn += 1
        d = {"instant": 0.0, "fixed": 0.5}.get(self.kind)
        if d is None:
            d = 2.0 if self.rng.random() < 0.1 else 0.02
        time.sleep(d)
        self.slept += d
        if self.turn >= TURNS:
            SLEPT.append(self.slept)
            return Step(None, 1.0, terminated=True)
        return Step(f" [{self.turn}]=", 0.0)
'''
KINDS = ("instant", "fixed", "heavy")


class Timed:
    """The engine, the seconds spent in its `sample` calls and in its streams' `poll` counted in `busy`."""

    def __init__(self, engine) -> None:
        self.engine, self.busy = engine, 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def sample(self, *args, **kw):
        t = time.perf_counter()
        try:
            return self.engine.sample(*args, **kw)
        finally:
            self.busy += time.perf_counter() - t

    def stream(self, **kw):
        from rlkit.engines.base import stream

        return TimedStream(self, stream(self.engine, **kw))


class TimedStream:
    def __init__(self, timed: Timed, inner) -> None:
        self.timed, self.inner = timed, inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def poll(self):
        t = time.perf_counter()
        try:
            return self.inner.poll()
        finally:
            self.timed.busy += time.perf_counter() - t


def _child(a) -> None:
    import dataclasses

    from rlkit import engines
    from rlkit.envs import get_env
    from rlkit.io import data
    from rlkit.sampling import Prompts, Sampling, run_episodes
    from rlkit.tasks import get_task

    t0 = time.perf_counter()
    opts = engines.EngineOptions(dtype="fp32", seed=0) if a.engine == "vllm" else engines.EngineOptions(device="cpu")
    eng = Timed(engines.create(a.engine, a.policy, opts))
    init_s = time.perf_counter() - t0
    tok = eng.tokenizer
    ex = get_task("arithmetic").examples("train", a.prompts, 0)
    batch = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex],
                    data.encode_prompts(tok, [e.prompt for e in ex], False))
    fields = {f.name for f in dataclasses.fields(Sampling)}
    kw = {"env_workers": a.workers, "env_schedule": a.schedule} if a.schedule else {}
    if not set(kw) <= fields:
        raise SystemExit(f"this rlkit has no {', '.join(sorted(set(kw) - fields))}")
    s = Sampling(n=a.n, temperature=1.0, max_new_tokens=8, max_turns=4, env_timeout=0, **kw)
    warm = Prompts(0, batch.ids[:4], batch.answers[:4], batch.texts[:4], batch.prompt_ids[:4])
    run_episodes(eng, tok, get_env(f"{a.env_file}:Agent"), warm, s, seed=99)  # warm-up (vLLM's first calls)
    out = {"init_s": init_s, "runs": {}}
    base = None
    for kind in a.kinds.split(","):
        env = get_env(f"{a.env_file}:Agent:kind={kind}")
        mod = sys.modules[env.factory.__module__]
        runs = []
        for _ in range(a.repeats):
            mod.SLEPT.clear()
            mod._SEEN.clear()
            eng.busy = 0.0
            t = time.perf_counter()
            ep = run_episodes(eng, tok, env, batch, s, seed=7)
            wall = time.perf_counter() - t
            runs.append((wall, wall - eng.busy))
        wall, wait = sorted(runs)[len(runs) // 2]  # the median run
        rows = ep.columns["completion_ids"]
        base = base or rows
        out["runs"][kind] = {"wall": wall, "wait": wait, "walls": [w for w, _ in runs], "own_max": max(mod.SLEPT),
                             "own_mean": sum(mod.SLEPT) / len(mod.SLEPT), "env_sum": sum(mod.SLEPT),
                             "rows": len(rows), "same": sum(x == y for x, y in zip(rows, base, strict=True)) / len(rows)}
        print(f"  {a.label}: {kind} {wall:.1f} s", file=sys.stderr, flush=True)
    a.dump.write_text(json.dumps(out))
    eng.close()


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every rlkit command: idle OpenMP threads sleep
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, help="a checkout of the old rlkit (its rows are left out without it)")
    ap.add_argument("--policy", type=Path, help="a policy checkpoint (default: train the tiny one for a few seconds)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    ap.add_argument("--workers", type=int, default=256, help="--env-workers of the new code's rows")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the environments to time, instant first")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each environment; the median is shown")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--engine")
    ap.add_argument("--schedule")
    ap.add_argument("--env-file", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--dump", type=Path)
    a = ap.parse_args()
    if a.child:
        _child(a)
        return
    new = Path(__file__).resolve().parents[1]
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "agent_env.py"
        env_file.write_text(ENV)
        policy = a.policy
        if policy is None:
            policy = Path(tmp) / "sft"
            subprocess.run([sys.executable, "-m", "rlkit", "sft", "--out", str(policy), "--num-examples", "1500",
                            "--eval-num", "4", "--batch-tokens", "512", "-q"], check=True,
                           env={**os.environ, "PYTHONPATH": str(new)})
        rows = []
        for engine in [e.strip() for e in a.engines.split(",") if e.strip()]:
            plan = [("old", a.old, None, None)] if a.old else []
            plan += [("new", new, "turns", a.workers), ("new", new, "ready", a.workers)]
            if engine == "hf":  # the default number of workers
                plan += [("new", new, "turns", 32)]
            for code, tree, schedule, workers in plan:
                label = f"{engine} {code}" + (f" {schedule}, {workers} workers" if schedule else "")
                dump = Path(tmp) / f"{len(rows)}-{engine}.json"
                cmd = [sys.executable, __file__, "--child", "--engine", engine, "--policy", str(policy), "--prompts",
                       str(a.prompts), "--n", str(a.n), "--env-file", str(env_file), "--label", label, "--dump",
                       str(dump), "--kinds", a.kinds, "--repeats", str(a.repeats)]
                cmd += ["--schedule", schedule, "--workers", str(workers)] if schedule else []
                t = time.perf_counter()
                r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
                if r.returncode != 0:
                    lines = r.stderr.strip().splitlines() or ["?"]
                    print(f"{label}: not timed: {([x for x in lines if 'Error' in x] or lines)[-1].strip()}")
                    continue
                print(f"{label}: {time.perf_counter() - t:.0f} s in all", file=sys.stderr)
                rows.append((label, json.loads(dump.read_text())))
    if not rows:
        raise SystemExit("nothing ran")
    print(f"\n{os.cpu_count()} CPUs, load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(f"{a.prompts} prompts x {a.n} samples x 4 turns of <= 8 tokens = {a.prompts * a.n} trajectories, tiny "
          "policy, fp32, temperature 1")
    if "instant" in a.kinds.split(","):
        print(f"\n{'instant environment':34}{'wall s':>8}   (each run's wall; the median shown)")
        for label, d in rows:
            r = d["runs"]["instant"]
            print(f"{label:34}{r['wall']:>8.2f}   " + " ".join(f"{w:.2f}" for w in r["walls"]))
    for kind, title in (("fixed", "step 0.5 s"), ("heavy", "step 20 ms, one in ten 2 s")):
        if kind not in a.kinds.split(","):
            continue
        print(f"\n{title:34}{'wall s':>8}{'instant s':>11}{'env wait s':>12}{'own max s':>11}{'wait/own':>10}"
              f"{'same rows':>11}")
        for label, d in rows:
            r, i = d["runs"][kind], d["runs"].get("instant", {"wall": float("nan")})
            print(f"{label:34}{r['wall']:>8.1f}{i['wall']:>11.1f}{r['wait']:>12.1f}{r['own_max']:>11.2f}"
                  f"{r['wait'] / r['own_max']:>10.2f}{r['same']:>11.0%}")
    print("\nenv wait: the wall outside the engine's calls; own max: the slowest trajectory's own environment seconds "
          "(the goal: wait/own <= 1.25); same rows: the share of rows equal to the first environment's run.")

if __name__ == "__main__":
    main()
