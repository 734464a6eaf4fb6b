"""Multi-turn sampling throughput on the built-in `guess` environment (rlkit.envs.guess): trajectories per second
of each rollout engine (hf, and vLLM where it takes stop strings), with the sampling driver batching every
trajectory of the batch turn by turn (`rlkit.sampling.run_episodes` over the whole batch: one engine call per
turn) against one trajectory at a time (`run_episodes` called per trajectory with n=1: one engine call per turn
of each trajectory), side by side with the ratios, in one run.

Usage: python benchmarks/multiturn.py [--policy DIR] [--prompts 16] [--n 4] [--repeats 3] [--engines hf,vllm]
Without --policy it trains the tiny model on guess transcripts for a short while first (`rlkit sft --task guess`),
so the games run several turns as in training. Each engine runs in its own fresh process; a warm-up batch runs
first (vLLM's first call compiles), then each mode --repeats times, and the median is printed. Every
trajectory plays a game of at most 6 turns of at most 5 new tokens (`GuessNumber.max_new_tokens`).
Needs vLLM importable for the vLLM half (on a CPU: `make setup-vllm`); an engine that cannot run is reported
as such and left out. On its CPU backend the vLLM engine prefills whole prompts (no chunked prefill, which a seeded
request cannot use there), so a batch of any size runs (`--prompts 64 --n 8`: 512 trajectories a batch).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("batched", "one at a time")


def _child(engine: str, policy: Path, prompts: int, n: int, repeats: int, dump: Path) -> None:
    from rlkit import engines
    from rlkit.envs import get_env
    from rlkit.sampling import Prompts, Sampling, run_episodes

    t0 = time.perf_counter()
    opts = engines.EngineOptions(dtype="float32", seed=0) if engine == "vllm" else engines.EngineOptions()
    eng = engines.create(engine, policy, opts)
    init_s = time.perf_counter() - t0
    if "stop" not in inspect.signature(eng.sample).parameters:
        raise SystemExit(f"the {engine} engine takes no stop strings here: a game's turns cannot end at the newline")
    tok = eng.tokenizer
    env = get_env("guess")
    it = env.make().iter_examples("train", 0)
    ex = [next(it) for _ in range(prompts)]
    batch = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex],
                    [tok(e.prompt)["input_ids"] for e in ex])
    s = Sampling(n=n, temperature=1.0, max_new_tokens=env.attribute("max_new_tokens"), max_turns=6)
    one = Sampling(n=1, temperature=1.0, max_new_tokens=s.max_new_tokens, max_turns=s.max_turns)

    def batched(seed: int) -> list[dict]:
        return [run_episodes(eng, tok, env, batch, s, seed).columns]

    def one_at_a_time(seed: int) -> list[dict]:
        out = []
        for p in range(prompts):
            single = Prompts(p, batch.ids[p:p + 1], batch.answers[p:p + 1], batch.texts[p:p + 1],
                             batch.prompt_ids[p:p + 1])
            out += [run_episodes(eng, tok, env, single, one, seed * 1_000 + p * n + j).columns for j in range(n)]
        return out

    run = {"batched": batched, "one at a time": one_at_a_time}
    run["batched"](10_000)  # warm-up (vLLM compiles on its first calls)
    rows = {}
    for mode in MODES:
        secs, cols = [], []
        for r in range(repeats):
            t = time.perf_counter()
            cols = run[mode](r)
            secs.append(time.perf_counter() - t)
        games = [(w, k) for c in cols for w, k in zip(c["reward/env"], c["turns"], strict=True)]
        tokens = sum(len(ids) for c in cols for ids in c["completion_ids"])
        rows[mode] = {"secs": secs, "trajectories": len(games), "won": sum(w for w, _ in games) / len(games),
                      "turns": sum(k for _, k in games) / len(games), "tokens": tokens}
    dump.write_text(json.dumps({"engine": engine, "init_s": init_s, "modes": rows}))
    eng.close()


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every rlkit command: idle OpenMP threads sleep
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, help="a guess-trained policy (default: train one for a short while)")
    ap.add_argument("--prompts", type=int, default=16, help="games (secrets) per batch")
    ap.add_argument("--n", type=int, default=4, help="trajectories per game")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="hf,vllm", help="comma-separated engines to time (hf, vllm)")
    ap.add_argument("--sft-examples", type=int, default=3000, help="without --policy: the SFT run's examples")
    ap.add_argument("--child")
    ap.add_argument("--dump", type=Path)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.policy, a.prompts, a.n, a.repeats, a.dump)
        return
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        policy = a.policy
        if policy is None:
            policy = Path(tmp) / "sft"
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "rlkit", "sft", "--task", "guess", "--num-examples",
                            str(a.sft_examples), "--eval-num", "4", "--out", str(policy), "-q"], check=True)
            print(f"trained {policy} on {a.sft_examples} guess games in {time.perf_counter() - t:.0f} s")
        results = {}
        for engine in [e.strip() for e in a.engines.split(",") if e.strip()]:
            dump = Path(tmp) / f"{engine}.json"
            r = subprocess.run([sys.executable, __file__, "--child", engine, "--policy", str(policy), "--prompts",
                                str(a.prompts), "--n", str(a.n), "--repeats", str(a.repeats), "--dump", str(dump)],
                               capture_output=True, text=True)
            if r.returncode != 0:  # the error's own line (vLLM's shutdown messages come after it)
                lines = r.stderr.strip().splitlines() or ["?"]
                print(f"{engine}: not timed: {([x for x in lines if 'Error' in x] or lines)[-1].strip()}")
                continue
            results[engine] = json.loads(dump.read_text())
    if not results:
        raise SystemExit("no engine ran")
    traj = a.prompts * a.n
    print(f"\n{os.cpu_count()} CPUs, load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          "(other processes' load slows both modes, and torch's threads most)")
    print(f"guess (1-20, at most 6 turns of at most 5 new tokens): {a.prompts} games x {a.n} trajectories = {traj} "
          f"a batch, temperature 1, tiny policy, fp32; median of {a.repeats}")
    print(f"{'engine':8}{'mode':>15}{'traj/s':>9}{'seconds':>9}{'won':>7}{'turns':>7}{'tokens/traj':>13}"
          f"{'init s':>8}")
    rate = {}
    for e, d in results.items():
        for mode in MODES:
            m = d["modes"][mode]
            secs = statistics.median(m["secs"])
            rate[e, mode] = m["trajectories"] / secs
            print(f"{e:8}{mode:>15}{rate[e, mode]:>9.1f}{secs:>9.2f}{m['won']:>7.0%}{m['turns']:>7.2f}"
                  f"{m['tokens'] / m['trajectories']:>13.1f}{d['init_s']:>8.1f}")
    print()
    for e in results:
        print(f"{e}: batched / one at a time = {rate[e, 'batched'] / rate[e, 'one at a time']:.1f}x trajectories/s")
    if "hf" in results:
        for e in results:
            if e != "hf":
                for mode in MODES:
                    print(f"{e} / hf, {mode}: {rate[e, mode] / rate['hf', mode]:.2f}x trajectories/s")


if __name__ == "__main__":
    main()
