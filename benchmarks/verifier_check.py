"""The verifier check's cost (`rlkit.tasks.trust.check_verifier`, run once per stage invocation that uses a task's
verifier) and its verdict, per task: what a stage adds before any model loads.

Usage: python benchmarks/verifier_check.py [SPEC ...] [--all-reasoning-gym] [--repeats 5]
Default specs: arithmetic, math, code, and reasoning-gym's basic_arithmetic, gsm_symbolic and zebra_puzzles. Each task
is made once (`get_task`, not timed), then checked: `first` is the first check in the process (it pays the verifier's
own first imports, math-verify's sympy for instance, which the stage pays anyway when it scores, and a reasoning-gym
generator's 8 questions), `again` the median of --repeats further checks (the verifier's own cost). A code task's
programs run in the default sandbox (bwrap). Each row also says what the check found: ok, the gold answers
rejected, the junk paid (refused), or why it skipped. --all-reasoning-gym runs every reasoning-gym dataset too (a few
minutes: some generators take a tenth of a second a question).
"""

from __future__ import annotations

import argparse
import statistics
import time

DEFAULT = ["arithmetic", "math", "code", "reasoning-gym:dataset=basic_arithmetic", "reasoning-gym:dataset=gsm_symbolic",
           "reasoning-gym:dataset=zebra_puzzles"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--all-reasoning-gym", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from rlkit.errors import RlkitError
    from rlkit.tasks import get_task, task_sandbox
    from rlkit.tasks.trust import check_verifier

    specs = args.specs or list(DEFAULT)
    if args.all_reasoning_gym:
        from rlkit.tasks.reasoning_gym import _names

        specs += [f"reasoning-gym:dataset={n}" for n in _names()]
    print(f"{'task':58} {'first':>9} {'again':>9}  verdict")
    for spec in specs:
        try:
            task = get_task(spec)
            sandbox = task_sandbox(task, None)
        except RlkitError as e:
            print(f"{spec:58} {'':>9} {'':>9}  cannot be made: {e}")
            continue
        t0 = time.perf_counter()
        out = check_verifier(task, sandbox)
        first = time.perf_counter() - t0
        again = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            check_verifier(task, sandbox)
            again.append(time.perf_counter() - t0)
        if out.skipped:
            verdict = f"skipped: {out.skipped}"
        elif out.paid:
            p = out.paid[0]
            verdict = f"REFUSED: {len(out.paid)} junk answers paid, e.g. {p.junk} {p.text[:40]!r}"
        elif out.rejected:
            verdict = f"WARNED: {out.rejected} of {out.golds} gold answers rejected, e.g. {out.rejected_example[1][:40]!r}"
        else:
            verdict = f"ok ({out.examples} examples, {out.golds} gold answers)"
        print(f"{spec:58} {first * 1000:7.1f}ms {statistics.median(again) * 1000:7.1f}ms  {verdict}", flush=True)


if __name__ == "__main__":
    main()
