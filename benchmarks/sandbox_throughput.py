"""Programs and tool calls per second through the code sandbox, and what the sandbox costs per program and per call.

Programs: trivial programs (`print(int(input()) * 2)` against one stdio test, compared on the host) through
`rlkit.sandbox.programs.run_programs` with 1 worker and with one per CPU, under bwrap and under kind "none"
(the same harness in a bare subprocess, the same limits, no namespaces): the difference per program is the
sandbox's own overhead (bwrap's namespaces, mounts and the uid drop).

Tool calls: trajectories of `--calls` calls each (`n = n + 1; print(n * 2)`), from 1 thread and from `--threads`
threads at once (the driver's --env-workers: one trajectory per thread at a time), through three paths:
  python tool   the built-in `python` tool's interpreter (`rlkit.sandbox.interpreter`), one per trajectory, kept
                across its calls: the first call starts it, the others reuse it;
  fresh         the same with state=0: a fresh sandboxed interpreter for every call;
  worker tool   the path a tool that runs code had before the python tool: a user's function that exec()s the code,
                run by `Tools(..., sandbox=KIND)` in the shared sandboxed workers (a process forked per call);
each under bwrap and under kind "none" (the same processes bare): calls/s, ms per call, and the sandbox's overhead
per call (bwrap ms - bare ms).

    python benchmarks/sandbox_throughput.py                 # 256 programs, 64 trajectories x 8 calls
    python benchmarks/sandbox_throughput.py --programs 4096 --trajectories 256 --threads 32
    python benchmarks/sandbox_throughput.py --what tools
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from rlkit.sandbox import Sandbox
from rlkit.sandbox.programs import TestCase, TestSuite, run_programs


def measure(kind: str, workers: int, n: int) -> float:
    jobs = [("print(int(input()) * 2)", TestSuite((TestCase("stdio", f"{i}\n", str(2 * i)),))) for i in range(n)]
    sb = Sandbox(kind, workers=workers)
    sb.check()
    t = time.perf_counter()
    out = run_programs(sb, jobs)
    took = time.perf_counter() - t
    bad = [o for o in out if o.reason != "passed"]
    if bad:
        raise SystemExit(f"{len(bad)} of {n} trivial programs failed under {kind}: {bad[0]}")
    return n / took


WORKER_TOOL = '''import contextlib
import io


def run_python(code: str) -> str:
    """exec() the code, its stdout captured (a sandboxed worker runs each call in a process of its own)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue()
'''


def _tools_env(path: str, kind: str):
    """A `Tools` environment whose one tool runs the code: ("python", "fresh") the built-in tool with state=1/0,
    ("worker", ...) the function above in the sandboxed workers."""
    from rlkit.envs.python import PythonTool
    from rlkit.envs.tools import Tools

    if path == "worker":
        import importlib

        return Tools(functions=[importlib.import_module("_bench_worker_tool").run_python], sandbox=kind)
    return Tools(functions=[PythonTool(state=path == "python")], sandbox=kind)


def measure_tools(path: str, kind: str, threads: int, trajectories: int, calls: int) -> float:
    """Tool calls per second over `trajectories` trajectories of `calls` calls each, `threads` at once."""
    import json

    from rlkit.tasks.base import Example

    name = "run_python" if path == "worker" else "python"
    ex = Example("p", "", "", "train")
    todo = list(range(trajectories))
    lock = threading.Lock()
    bad: list[str] = []

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                k = todo.pop()
            env = _tools_env(path, kind)
            try:
                env.reset(ex)
                for i in range(calls):
                    code = f"n = {i} if {i} == 0 or 'n' not in globals() else n + 1\nprint({k} * 1000 + {i})"
                    step = env.step(f"<tool_call>{json.dumps({'name': name, 'arguments': {'code': code}})}</tool_call>")
                    got = step.observation[0]["content"].strip()
                    if got != str(k * 1000 + i):
                        bad.append(got)
            finally:
                env.close()

    warm = _tools_env(path, kind)  # the sandbox probed, the worker pool (worker tool) started once, outside the clock
    t = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    took = time.perf_counter() - t
    warm.close()
    if bad:
        raise SystemExit(f"{len(bad)} of {trajectories * calls} tool calls ({path}, {kind}) answered wrongly: {bad[0]!r}")
    return trajectories * calls / took


def tools(args) -> None:
    cpus = os.cpu_count() or 1
    d = Path(tempfile.mkdtemp(prefix="rlkit-bench-"))
    d.chmod(0o755)
    (d / "_bench_worker_tool.py").write_text(WORKER_TOOL)
    (d / "_bench_worker_tool.py").chmod(0o644)
    sys.path.insert(0, str(d))
    rows = []
    for threads in sorted({1, args.threads}):
        for path in ("python", "fresh", "worker"):
            bw = measure_tools(path, "bwrap", threads, args.trajectories, args.calls)
            bare = measure_tools(path, "none", threads, args.trajectories, args.calls)
            rows.append((threads, path, bw, bare))
    labels = {"python": "python tool", "fresh": "python state=0", "worker": "worker tool (old)"}
    print(f"\n{args.trajectories} trajectories x {args.calls} tool calls, {cpus} CPUs")
    print(f"{'threads':>7} | {'path':<17} | {'bwrap calls/s':>13} | {'bare calls/s':>12} | {'bwrap ms/call':>13} | "
          f"{'bare ms/call':>12} | {'overhead ms':>11}")
    for threads, path, bw, bare in rows:
        print(f"{threads:>7} | {labels[path]:<17} | {bw:>13.1f} | {bare:>12.1f} | {1000 / bw:>13.2f} | "
              f"{1000 / bare:>12.2f} | {1000 / bw - 1000 / bare:>11.2f}")
    if args.threads > 1:
        for path in ("python", "fresh", "worker"):
            one = next(r for r in rows if r[0] == 1 and r[1] == path)
            many = next(r for r in rows if r[0] == args.threads and r[1] == path)
            print(f"scaling 1 -> {args.threads} threads, {labels[path]}: bwrap x{many[2] / one[2]:.2f}, "
                  f"bare x{many[3] / one[3]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", default="programs,tools", help="programs, tools or both (comma-separated)")
    ap.add_argument("--programs", type=int, default=256)
    ap.add_argument("--trajectories", type=int, default=64, help="tool calls: trajectories (one interpreter each)")
    ap.add_argument("--calls", type=int, default=8, help="tool calls: calls per trajectory")
    ap.add_argument("--threads", type=int, default=8, help="tool calls: trajectories at once (as --env-workers)")
    args = ap.parse_args()
    if "programs" in args.what.split(","):
        programs(args)
    if "tools" in args.what.split(","):
        tools(args)


def programs(args) -> None:
    cpus = os.cpu_count() or 1
    n = args.programs
    rows = []
    for workers in sorted({1, cpus}):
        bw = measure("bwrap", workers, n)
        bare = measure("none", workers, n)
        rows.append((workers, bw, bare))
    print(f"{n} trivial programs, one stdio test each, {cpus} CPUs")
    print(f"{'workers':>7} | {'bwrap prog/s':>12} | {'bare prog/s':>11} | {'bwrap ms/prog':>13} | "
          f"{'bare ms/prog':>12} | {'overhead ms':>11} | {'ratio':>5}")
    for workers, bw, bare in rows:
        print(f"{workers:>7} | {bw:>12.1f} | {bare:>11.1f} | {1000 / bw:>13.2f} | {1000 / bare:>12.2f} | "
              f"{1000 / bw - 1000 / bare:>11.2f} | {bare / bw:>5.2f}")
    if len(rows) == 2:
        print(f"scaling 1 -> {cpus} workers: bwrap x{rows[1][1] / rows[0][1]:.2f}, bare x{rows[1][2] / rows[0][2]:.2f}")


if __name__ == "__main__":
    main()
