"""Where a round's time goes: one RLVR round (`rollout | score-ref | update`, recipes/rlvr.sh) and the persistent
pipe (`rollout --follow | score-ref | update --follow`, recipes/rlvr-follow.sh, at LAG=0 unless --lag),
each stage's wall split into phases, for the code at --old REV and this checkout side by side on one machine.

Usage: python benchmarks/round_profile.py [--runs DIR] [--old REV] [--modes rounds follow] [--rounds 3]
                                          [--prompts 512] [--n 8] [--repeats 1] [--lag 0] [--rate 100] [--top 8]
                                          [--timeline] [--no-profile] [--json FILE] [--keep DIR]
--runs DIR: a recipes/rlvr.sh run whose DIR/sft and DIR/ref are used (default: `rlkit sft` and `rlkit freeze-ref`
with the recipe's defaults, made once in a temporary folder). --old REV: the code to compare with (a git revision
of this repository, checked out as a worktree; `--old ''` profiles this checkout alone).

Each variant runs per mode:
- plain, --repeats times, old and new in turn (the median run's figures): each process's wall, the round's (or
  the pipe's) wall, the CPU seconds of all its processes, samples per second and tokens per second (prompt +
  completion tokens of the rows scored), ms per sample;
- under py-spy (sampling profiler: `pip install py-spy`, or `make setup`; `--idle`, so waiting shows), for the
  phases: each stage's main-thread samples are put in the first phase whose frames they hold (PHASES, in order),
  and aligned on the pipe's clock, so the share of the wall in which no stage runs compute (forward, backward,
  the optimizer step, sampling) is rlkit's and the libraries' overhead. The top of each stage's self time follows.
The profiler costs CPU of its own (a 2-core machine shares it); the plain runs' seconds are the figures. Seconds on
a shared machine move with its load: compare old and new from one run of this script, and CPU seconds beside wall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KNOBS = dict(max_new=16, epochs=2, minibatch=128, beta=0.01, kl="k3+", dual_clip=3, lr=5e-5, temperature=1.0)

# (phase, compute?, frame patterns): a sample belongs to the first phase one of whose patterns is a substring of
# one of its frames ("function (file)"). Imports come first: an import in progress is start-up whatever calls it.
# Before these, a sample whose innermost frame blocks (WAITING) is waiting for input; one with no Python frame is
# the interpreter starting or tearing down (or native code called from no Python frame).
WAITING = ("TableReader.__iter__", "TableReader.batches", "wait_for (", "Condition.wait", "Event.wait", "select (",
           "sleep (", "Queue.get", "PendingTable.result", "_wait_for_tstate_lock")
PHASES: list[tuple[str, bool, tuple[str, ...]]] = [
    ("imports", False, ("_find_and_load", "_handle_fromlist")),
    ("model load and checks", False, ("load_policy", "load_reference", "load_tokenizer", "from_pretrained",
                                      "verify_reference", "verify_weights", "verify_step", "fingerprint", "sha256",
                                      "check_model_dir", "HFEngine.start", "Trainer.__init__", "Trainer.load",
                                      "load_reward_model", "VLLMEngine.__init__", "_start_engine", "switch (",
                                      "HFEngine.reload", "load_state_dict")),
    ("sampling", True, ("GenerationMixin.generate", "LLM.generate", "HFEngine.sample", "VLLMEngine.sample")),
    ("scoring forward", True, ("score_tokens", "score_texts")),
    ("backward", True, ("Tensor.backward", "Precision.backward")),
    ("optimizer step", True, ("Optimizer.profile_hook_step", "Adam.step", "AdamW.step", "clip_grad_norm_",
                              "Precision.clip", "Precision.apply")),
    ("forward", True, ("Module._call_impl", "completion_logprobs")),
    ("save and publish", False, ("Trainer.save", "save_file", "atomic_dir", "save_pretrained", "publish (",
                                 "save_model")),
    ("verifier and rewards", False, ("verify (", "_Verifier", "reward_fns", "combine_rewards")),
    ("tokenize and decode", False, ("batch_decode", "encode_prompts", "encode_responses", "PreTrainedTokenizer",
                                    "TokenizersBackend", "apply_chat_template")),
    ("arrow and pipe I/O", False, ("rlkit/io/streams.py", "pyarrow", "to_pylist", "write_table", "TableWriter",
                                   "open_table")),
    ("other", False, ("",)),
]
# the timeline's coarser phases
_COARSE = {"imports": "start-up", "model load and checks": "start-up", "sampling": "compute",
           "scoring forward": "compute", "backward": "compute", "optimizer step": "compute", "forward": "compute",
           "interpreter start and exit": "interpreter"}
COMPUTE = {name for name, c, _ in PHASES if c}


# -- running a pipe


def _py_spy() -> str:
    """py-spy: on PATH, or beside this interpreter (a virtual environment's bin/)."""
    return shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def _env(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("RLKIT_DEBUG", None)
    return env


def _cmd(tree: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from rlkit.cli import main; sys.argv[0] = 'rlkit'; sys.exit(main())",
            *args]


def _stage_args(mode: str, sft: Path, ref: Path, policy: Path, out: Path, seed: int, a) -> list[list[str]]:
    k = KNOBS
    upd = ["--algo", "grpo", "--lr", str(k["lr"]), "--epochs", str(k["epochs"]), "--minibatch-size",
           str(k["minibatch"]), "--beta", str(k["beta"]), "--kl-estimator", k["kl"], "--dual-clip", str(k["dual_clip"]),
           "--seed", "0"]
    if mode == "rounds":
        return [["rollout", "--policy", str(policy), "--task", "arithmetic", "--num-prompts", str(a.prompts), "--n",
                 str(a.n), "--max-new-tokens", str(k["max_new"]), "--temperature", str(k["temperature"]),
                 "--seed", str(seed)],
                ["score-ref", "--ref", str(ref)],
                ["update", "--policy", str(policy), "--out", str(out), *upd]]
    return [["rollout", "--follow", str(out), "--policy", str(sft), "--task", "arithmetic", "--batch-prompts",
             str(a.prompts), "--n", str(a.n), "--max-new-tokens", str(k["max_new"]), "--temperature",
             str(k["temperature"]), "--seed", "0", "--max-lag", str(a.lag), "--max-steps", str(a.rounds)],
            ["score-ref", "--ref", str(ref)],
            ["update", "--follow", "--policy", str(sft), "--out", str(out), "--max-steps", str(a.rounds), "--max-lag",
             str(a.lag), *upd]]


def _pipe(tree: Path, stages: list[list[str]], work: Path, tag: str, rate: int | None) -> dict:
    """Run the three stages as one pipe (score-ref's output also teed to a file, for the row and token counts);
    -> each process's start and end (perf_counter) and, under py-spy, its profile file."""
    env = _env(tree)
    procs, times, profiles, logs = [], [], [], []
    r_prev = subprocess.DEVNULL
    tee = None
    for i, args in enumerate(stages):
        last = i == len(stages) - 1
        log = open(work / f"{tag}-{args[0]}.log", "w")
        logs.append(log)
        if last:
            w = os.open(work / f"{tag}-update.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            # the scored stream, teed to a file on its way to update
            r_tee, w_tee = os.pipe()
            tee = subprocess.Popen(["tee", str(work / f"{tag}-scored.arrow")], stdin=r_prev, stdout=w_tee)
            os.close(r_prev)
            os.close(w_tee)
            r_prev = r_tee
            r_next = None
        else:
            r_next, w = os.pipe()
        cmd = _cmd(tree, args)
        prof = None
        if rate:  # py-spy writes its own lines to stdout: the stage's stdout is the pipe, py-spy's the log
            prof = work / f"{tag}-{args[0]}.json"
            cmd = [_py_spy(), "record", "--rate", str(rate), "--idle", "--threads", "--nonblocking", "--format",
                   "speedscope", "-o", str(prof), "--", "bash", "-c", f'exec "$@" >&{w} {w}>&-', "bash", *cmd]
            p = subprocess.Popen(cmd, stdin=r_prev, stdout=log, stderr=log, env=env, cwd=work, pass_fds=(w,))
        else:
            p = subprocess.Popen(cmd, stdin=r_prev, stdout=w, stderr=log, env=env, cwd=work)
        times.append([time.perf_counter(), None])
        if r_prev is not subprocess.DEVNULL:
            os.close(r_prev)
        os.close(w)
        r_prev = r_next
        procs.append(p)
        profiles.append(prof)

    def waiter(k):
        procs[k].wait()
        times[k][1] = time.perf_counter()

    ws = [threading.Thread(target=waiter, args=(k,)) for k in range(len(procs))]
    for t in ws:
        t.start()
    for t in ws:
        t.join()
    tee.wait()
    for log in logs:
        log.close()
    for args, p in zip(stages, procs, strict=True):
        if p.returncode != 0:
            msg = (work / f"{tag}-{args[0]}.log").read_text()[-3000:]
            raise SystemExit(f"{tag}: rlkit {args[0]} failed (exit {p.returncode}):\n{msg}")
    return {"times": times, "profiles": profiles}


def _counts(scored: Path) -> tuple[int, int]:
    """(rows, prompt + completion tokens) of an rlkit Arrow stream file."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with open(scored, "rb") as f:
        t = pa.ipc.open_stream(f).read_all()
    toks = sum(int(pc.sum(pc.list_value_length(t.column(c))).as_py() or 0) for c in ("prompt_ids", "completion_ids"))
    return t.num_rows, toks


def run_mode(tree: Path, mode: str, sft: Path, ref: Path, work: Path, a, tag: str, rate: int | None) -> dict:
    """One mode's run: `rounds` rounds of separate processes, or the follow pipe for `rounds` steps."""
    import resource

    names = ("rollout", "score-ref", "update")
    walls: dict[str, float] = defaultdict(float)
    rounds, profiles, rows, toks = [], [], 0, 0
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # (stages, tag) of each pipe: a round each, or the one follow pipe
    if mode == "rounds":
        outs = [work / f"{tag}-round-{i}" for i in range(1, a.rounds + 1)]
        pipes = [(_stage_args(mode, sft, ref, [sft, *outs][i - 1], outs[i - 1], i, a), f"{tag}-r{i}")
                 for i in range(1, a.rounds + 1)]
    else:
        pipes = [(_stage_args(mode, sft, ref, sft, work / f"{tag}-steps", 0, a), f"{tag}-f")]
    for stages, ptag in pipes:
        r = _pipe(tree, stages, work, ptag, rate)
        t0 = min(t[0] for t in r["times"])
        rounds.append(max(t[1] for t in r["times"]) - t0)
        for n, (s, e) in zip(names, r["times"], strict=True):
            walls[n] += e - s
        profiles.append((r["profiles"], [s - t0 for s, _ in r["times"]], [e - s for s, e in r["times"]]))
        n_rows, n_toks = _counts(work / f"{ptag}-scored.arrow")
        rows, toks = rows + n_rows, toks + n_toks
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)  # every process of the runs (and tee)
    return {"wall": sum(rounds), "rounds": rounds, "walls": dict(walls), "rows": rows, "tokens": toks, "cpu": cpu,
            "profiles": profiles}


# -- reading the profiles


def _classify(frames: list[str]) -> str:
    if not frames:
        return "interpreter start and exit"
    if any(w in frames[-1] for w in WAITING) and not any("_find_and_load" in f for f in frames):
        return "waiting for input"
    for name, _, pats in PHASES:
        if any(p in f for f in frames for p in pats):
            return name
    return "other"


def _main_timeline(path: Path) -> tuple[list[list[str]], float]:
    """The main thread's samples (each a list of "function (file)" frames, outermost first) and the seconds
    one sample stands for."""
    d = json.loads(path.read_text())
    frames = d["shared"]["frames"]
    names = [f"{f['name']} ({_short(f.get('file') or '')})" for f in frames]
    # the main thread: the process's first, whose thread id is the lowest (py-spy names them "Thread TID ...")
    prof = min(d["profiles"], key=lambda p: int(re.search(r"\d+", p["name"]).group()) if re.search(r"\d+", p["name"])
               else 1 << 62)
    samples = [[names[i] for i in s] for s in prof["samples"]]
    w = prof["weights"][0] if prof["weights"] else 0.01
    return samples, w


def _short(file: str) -> str:
    for root in ("site-packages/", "/rlkit/", "/stages/"):
        if root in file:
            tail = file.split(root, 1)[1]
            return ("rlkit/" + tail) if root == "/rlkit/" else ("stages/" + tail) if root == "/stages/" else tail
    return os.path.basename(file)


def read_profiles(run: dict, top: int) -> dict:
    """Per stage: seconds per phase (scaled so the samples fill the process's measured wall), the top self-time
    functions; per pipe: the seconds in which no stage computes (the overhead on the pipe's clock)."""
    names = ("rollout", "score-ref", "update")
    phases = {n: Counter() for n in names}
    selfs = {n: Counter() for n in names}
    overhead = 0.0
    timeline: list[str] = []
    first: dict[str, list[float]] = {n: [] for n in names}  # per run (round): when the stage first computes
    for profs, starts, walls in run["profiles"]:
        busy: list[tuple[float, float]] = []  # (start, end) of compute samples on the pipe's clock
        for n, prof, s0, wall in zip(names, profs, starts, walls, strict=True):
            samples, w = _main_timeline(prof)
            scale = wall / (len(samples) * w) if samples else 1.0
            dt = w * scale
            segs: list[list] = []  # [phase, start, end] on the pipe's clock
            began = None
            for k, fr in enumerate(samples):
                ph = _classify(fr)
                if began is None and ph in COMPUTE:
                    began = s0 + k * dt
                phases[n][ph] += dt
                ph_t = _COARSE.get(ph, ph)
                if segs and segs[-1][0] == ph_t:
                    segs[-1][2] = s0 + (k + 1) * dt
                else:
                    segs.append([ph_t, s0 + k * dt, s0 + (k + 1) * dt])
                if fr:
                    selfs[n][fr[-1]] += dt
                if ph in COMPUTE:
                    busy.append((s0 + k * dt, s0 + (k + 1) * dt))
            first[n].append(began if began is not None else float("nan"))
            timeline.append(f"{n}: " + ", ".join(f"{p} {a:.1f}-{b:.1f}" for p, a, b in _merge(segs)))
        end = max(s + w for s, w in zip(starts, walls, strict=True))
        covered, last = 0.0, 0.0
        for s, e in sorted(busy):
            s = max(s, last)
            if e > s:
                covered += e - s
                last = e
        overhead += end - covered
    return {"phases": phases, "top": {n: selfs[n].most_common(top) for n in names}, "overhead": overhead,
            "timeline": timeline, "first": first}


def _merge(segs: list[list], least: float = 0.3) -> list[list]:
    """Phase segments with those shorter than `least` seconds folded into their neighbours."""
    out: list[list] = []
    for seg in segs:
        if out and (seg[2] - seg[1] < least or out[-1][0] == seg[0]):
            out[-1][2] = seg[2]
        elif out and out[-1][2] - out[-1][1] < least:
            out[-1] = [seg[0], out[-1][1], seg[2]]
        else:
            out.append(list(seg))
    return out


# -- the report


def _fmt_row(label: str, cells: list[str], widths: list[int]) -> str:
    return f"{label:34}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))


def report(results: dict, modes: list[str], variants: list[str], profiled: bool, timelines: bool = False,
           lag: int = 0) -> None:
    w = [12] * len(variants)
    for mode in modes:
        title = (f"{'rounds' if mode == 'rounds' else f'persistent pipe (follow, lag {lag})'}: "
                 f"{results[(variants[0], mode)]['rows']} samples")
        print(f"\n== {title}")
        print(_fmt_row("", variants, w))
        rs = [results[(v, mode)] for v in variants]
        print(_fmt_row("wall s (median run)", [f"{r['wall']:.1f}" for r in rs], w))
        if len(rs[0]["all_walls"]) > 1:
            print(_fmt_row("  every run's wall s", ["/".join(f"{x:.1f}" for x in r["all_walls"]) for r in rs], w))
        print(_fmt_row("CPU s, all processes (median)", [f"{r['cpu']:.1f}" for r in rs], w))
        if mode == "rounds":
            print(_fmt_row("  per round s", ["/".join(f"{x:.1f}" for x in r["rounds"]) for r in rs], w))
        for n in ("rollout", "score-ref", "update"):
            print(_fmt_row(f"  {n} process wall s", [f"{r['walls'][n]:.1f}" for r in rs], w))
            print(_fmt_row(f"    {n} samples/s, tokens/s", [f"{r['rows'] / r['walls'][n]:.0f}, "
                                                          f"{r['tokens'] / r['walls'][n]:.0f}" for r in rs], w))
        print(_fmt_row("samples/s", [f"{r['rows'] / r['wall']:.0f}" for r in rs], w))
        print(_fmt_row("tokens/s", [f"{r['tokens'] / r['wall']:.0f}" for r in rs], w))
        print(_fmt_row("ms per sample", [f"{1000 * r['wall'] / r['rows']:.2f}" for r in rs], w))
        if len(variants) == 2:
            print(_fmt_row("speed-up (old wall / new wall)", ["", f"{rs[0]['wall'] / rs[1]['wall']:.2f}x"], w))
        if not profiled:
            continue
        ps = [results[(v, mode, "profile")] for v in variants]
        pw = [results[(v, mode, "profiled-run")]["wall"] for v in variants]
        print(_fmt_row("profiled wall s (py-spy running)", [f"{x:.1f}" for x in pw], w))
        print(_fmt_row("  no stage computing s", [f"{p['overhead']:.1f}" for p in ps], w))
        shares = [f"{p['overhead'] / x:.0%}" for p, x in zip(ps, pw, strict=True)]
        print(_fmt_row("  overhead share of the wall", shares, w))
        for n in ("rollout", "score-ref", "update"):
            print(_fmt_row(f"  {n}: first compute at s", ["/".join(f"{x:.1f}" for x in p["first"][n]) for p in ps],
                           w))
        for n in ("rollout", "score-ref", "update"):
            print(f"  {n}: seconds per phase (profiled run)")
            total = [sum(p["phases"][n].values()) for p in ps]
            for ph, compute in [(p, c) for p, c, _ in PHASES] + [("waiting for input", False),
                                                                  ("interpreter start and exit", False)]:
                vals = [p["phases"][n].get(ph, 0.0) for p in ps]
                if max(vals) < 0.05:
                    continue
                print(_fmt_row(f"    {ph}{' *' if compute else ''}", [f"{v:.1f}" for v in vals], w))
            comp = [sum(p["phases"][n].get(ph, 0.0) for ph in COMPUTE) for p in ps]
            print(_fmt_row("    compute share (* phases)", [f"{c / t:.0%}" if t else "-" for c, t in
                                                             zip(comp, total, strict=True)], w))
    if profiled:
        for mode in modes:
            for v in variants:
                print(f"\n-- top self time, {v}, {mode} (seconds, profiled run)")
                for n, rows in results[(v, mode, "profile")]["top"].items():
                    print(f"  {n}: " + "; ".join(f"{f} {s:.2f}" for f, s in rows))
                if timelines:
                    print(f"-- timeline, {v}, {mode} (main threads' phases, seconds on the pipe's clock)")
                    for line in results[(v, mode, "profile")]["timeline"]:
                        print(f"  {line}")


def _jsonable(results: dict, modes: list[str], variants: list[str], profiled: bool) -> dict:
    """{variant: {mode: figures}}: the plain run's walls, rows and tokens; the profiled run's phases per stage,
    first compute, overhead seconds and wall."""
    out: dict = {}
    for v in variants:
        for mode in modes:
            r = results[(v, mode)]
            fig = {k: r[k] for k in ("wall", "rounds", "walls", "rows", "tokens", "cpu", "all_walls")}
            if profiled:
                p = results[(v, mode, "profile")]
                fig["profile"] = {"wall": results[(v, mode, "profiled-run")]["wall"], "overhead": p["overhead"],
                                  "walls": results[(v, mode, "profiled-run")]["walls"],
                                  "phases": {n: dict(c) for n, c in p["phases"].items()}, "first": p["first"],
                                  "top": p["top"]}
            out.setdefault(v, {})[mode] = fig
    return out


def _checkout(rev: str, dest: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(dest), rev], check=True,
                   capture_output=True)
    (dest / "rlkit" / "stages").symlink_to(dest / "stages")  # what the wheel installs as rlkit.stages
    return dest


def _prepare(tree: Path, work: Path) -> tuple[Path, Path]:
    env = _env(tree)
    sft, ref = work / "sft", work / "ref"
    for args in (["sft", "--task", "arithmetic", "--num-examples", "24000", "--eval-num", "300", "--seed", "0",
                  "--out", str(sft)], ["freeze-ref", "--policy", str(sft), "--out", str(ref), "--dtype", "bf16"]):
        subprocess.run(_cmd(tree, args), check=True, env=env, cwd=work, stdout=subprocess.DEVNULL)
    return sft, ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, help="A recipes/rlvr.sh run directory: its sft/ and ref/ are used.")
    ap.add_argument("--old", default="", help="Git revision of the old code ('' : this checkout only).")
    ap.add_argument("--modes", nargs="+", default=["rounds", "follow"], choices=["rounds", "follow"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="Plain runs per variant, old and new in turn; medians.")
    ap.add_argument("--lag", type=int, default=0, help="The follow pipe's --max-lag (recipes/rlvr-follow.sh's LAG).")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second.")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--no-profile", action="store_true", help="The plain runs only (no py-spy).")
    ap.add_argument("--timeline", action="store_true", help="Also print each stage's phases in time order.")
    ap.add_argument("--json", type=Path, help="Also write the figures to FILE as JSON.")
    ap.add_argument("--keep", type=Path, help="Keep the runs, logs and profiles under DIR.")
    a = ap.parse_args()
    profiled = not a.no_profile
    if profiled and not Path(_py_spy()).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (or --no-profile)")
    with tempfile.TemporaryDirectory() as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        trees = {"new": REPO}
        if a.old:
            trees = {"old": _checkout(a.old, Path(tmp) / "old"), "new": REPO}
        try:
            if a.runs:
                sft, ref = a.runs / "sft", a.runs / "ref"
            else:
                sft, ref = _prepare(REPO, work)
            results: dict = {}
            for mode in a.modes:
                runs: dict[str, list[dict]] = {v: [] for v in trees}
                for i in range(a.repeats):  # old and new in turn, so that a change in the machine's load hits both
                    for v, tree in trees.items():
                        run = run_mode(tree, mode, sft, ref, work, a, f"{v}-{mode}-{i}", None)
                        runs[v].append(run)
                        print(f"{v} {mode} #{i + 1}: wall {run['wall']:.1f}s, CPU {run['cpu']:.1f}s", file=sys.stderr,
                              flush=True)
                for v, tree in trees.items():
                    rs = sorted(runs[v], key=lambda r: r["wall"])
                    results[(v, mode)] = {**rs[(len(rs) - 1) // 2], "all_walls": [r["wall"] for r in runs[v]],
                                          "cpu": statistics.median(r["cpu"] for r in runs[v])}
                    if profiled:
                        run = run_mode(tree, mode, sft, ref, work, a, f"{v}-{mode}-prof", a.rate)
                        results[(v, mode, "profiled-run")] = run
                        results[(v, mode, "profile")] = read_profiles(run, a.top)
            report(results, a.modes, list(trees), profiled, a.timeline, a.lag)
            if a.json:
                a.json.write_text(json.dumps(_jsonable(results, a.modes, list(trees), profiled), indent=1))
        finally:
            if a.old:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["old"])],
                               capture_output=True)


if __name__ == "__main__":
    main()
