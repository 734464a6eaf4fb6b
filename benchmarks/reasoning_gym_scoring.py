"""reasoning-gym scoring throughput, old tree against new: the seconds `rlkit.tasks.verify` takes on 16 train
examples' gold answers and 16 junk answers of each generator named (what rollout, eval and the verifier check pay
per scored row).

Usage: PYTHONPATH=TREE python benchmarks/reasoning_gym_scoring.py [SPEC ...]   (run it once per tree)
Default specs: reasoning-gym's arc_agi, group_anagrams and basic_arithmetic. One warm-up row first (imports); the
mean reward is printed beside the time, so two trees' figures are of the same rewards.
"""

from __future__ import annotations

import sys
import time

DEFAULT = ["reasoning-gym:dataset=arc_agi", "reasoning-gym:dataset=group_anagrams",
           "reasoning-gym:dataset=basic_arithmetic"]


def main() -> None:
    from rlkit.tasks import get_task, verify

    for spec in sys.argv[1:] or DEFAULT:
        t = get_task(spec)
        ex = t.examples("train", 16, 0)
        responses = [t.completion(e) for e in ex] + ["xyzzy"] * len(ex)
        answers = [e.answer for e in ex] * 2
        verify(t, responses[:1], answers[:1])
        t0 = time.perf_counter()
        values = verify(t, responses, answers).values
        s = time.perf_counter() - t0
        print(f"{spec}: {len(responses)} rows in {s:.2f}s ({s / len(responses) * 1000:.1f} ms a row), mean reward "
              f"{sum(values) / len(values):.3f}", flush=True)


if __name__ == "__main__":
    main()
