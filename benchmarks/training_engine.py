"""The training engine, old code against new on one machine in one run: peak memory of one `rlkit update` step
with and without micro-batches, and tokens/s of `update` and `score-ref` with packed against padded batches.

Usage: python benchmarks/training_engine.py [--old DIR] [--parts memory throughput] [--workdir DIR] [--json FILE]
           [--mem-size 100m] [--mem-rows 128] [--mem-completion 32] [--micro-batch-size 4]
           [--tp-size small] [--tp-rows 128] [--tp-minibatch 32] [--min-len 8] [--max-len 512]
           [--repeat N] [--threads N] [--cases WORD ...] [--new-flags '...'] [--case-timeout S] [--smoke]

Old code: --old DIR is a checkout of the commit to compare against, e.g. `git worktree add /tmp/old <commit>`;
its cases run with the same Python, that tree first on the import path (its top-level stages/ loaded as
rlkit.stages, as the installed package maps it). New code: the rlkit this Python imports (the checkout this
script is in, installed editable). Without --old only the new cases run. A case whose flag `rlkit <stage>
--help` (new code) does not list is "not available" and skipped, so the script runs against the old
engine too. Each case is a process of its own (`rlkit.cli.main(argv)`, the argv a user types, after the
imports), run one after the other with nothing else of this script running.

Part "memory": `update --beta 0 --epochs 1 --minibatch-size ROWS` on a ~100M-parameter Qwen2 (the model of
benchmarks/update_memory.py: built from a config, random init, a 32k byte-level BPE tokenizer trained on
generated text) and one batch of ROWS rows of fixed-length completions: ONE optimizer step. Cases: old code
(one forward and backward of all rows), new code without micro-batches and new code with --micro-batch-size N
(gradient accumulation: ROWS / N forwards and backwards, one optimizer step); the three give the same loss and
gradient norm. Figures: peak RSS (ru_maxrss of
the process: load, train, save), train peak (its VmHWM when the step's progress line is printed), "step
adds" (train peak minus the peak of a process that only imports, loads the fp32 policy and reads the batch:
activations, gradients, AdamW moments); on a GPU, the update's own gpu_mem_peak_gib
(torch.cuda.max_memory_allocated). Goal: the micro-batched step at <= 0.35x the old one.

Part "throughput": a smaller Qwen2 (--tp-size; default `small`, 3,672,320 parameters, 8k vocabulary) and a
table of ROWS rows whose completion lengths are drawn uniformly from MIN..MAX tokens (seeded), like a
reasoning task's. `update --beta 0 --epochs 1 --minibatch-size M`: trained tokens/s is the update's own
`tokens_per_s` metric (prompt + completion tokens trained over the training loop's seconds). `score-ref`
(reference = the same model frozen in fp32): the stage's seconds over a full table minus its seconds over a
2-row table (the fixed costs: loading the model, reading, writing) run in the same process; tokens/s =
prompt + completion tokens scored over that difference. Cases: old code (right-padded batches), new code
--no-packing and new code --packing. Padding fraction = padded positions / all positions of the forward
batches: for the padded layout computed from the table's lengths (update: each minibatch of the trainer's
seeded order, padded to its longest row; score-ref: its length-sorted --batch-tokens batches), for the packed
one from `rlkit.ops.packing.layout` (new code) over the same groups, and the update's own
`padding_fraction` metric where it reports one. score-ref's log-probs of the cases are compared (max
absolute difference from the old code's): packing must not change what is computed.

Inputs are synthetic rows on the model's own prompts: a 1-token `rlkit rollout` of the model gives the
prompts, ids and manifest; the completions are random token ids of the drawn lengths; old_logprobs are
-ln(vocabulary) (a random-init model's log-probs are near it); reward/verifier is 1 for a seeded half of each
group, so advantages and gradients are not zero. --smoke: tiny sizes (a few-million-parameter model, short
rows), for checking the script itself; its figures mean nothing. The JSON (--json) holds every figure,
command and log path; --workdir keeps models, tables and outputs (a rerun reuses the models and tables).
On a quiet 2-core CPU the whole run takes about 5 minutes (memory 2, throughput 1.5 a round); other
processes on the machine move the seconds a lot (not the memory): --repeat 3 --threads 1 there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import update_memory as um  # noqa: E402  (the model builder, the measured-process runner)

REPO = Path(__file__).resolve().parents[1]
BUILD_VERSION = 1

# A mid-size shape for --tp-size 20m (21,9M parameters): the same builder as update_memory's sizes.
um.SIZES.setdefault("20m", um.Size(hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1408, vocab=8192,
                                   corpus_examples=4000, prompts=16, n=4, max_new_tokens=64, minibatch=32))

# Runs rlkit's CLI in-process after the imports, from the tree named (or the installed rlkit), and writes
# each run's exit code and seconds to the result file.
LAUNCH = r"""
import importlib, importlib.util, json, os, resource, sys, time
spec = json.loads(sys.argv[1])
tree = spec["tree"]
if tree:
    sys.path.insert(0, tree)
import rlkit
if tree and not os.path.isdir(os.path.join(tree, "rlkit", "stages")):
    d = os.path.join(tree, "stages")  # the package maps stages/ to rlkit.stages; a bare checkout needs it mapped
    s = importlib.util.spec_from_file_location("rlkit.stages", os.path.join(d, "__init__.py"),
                                               submodule_search_locations=[d])
    m = importlib.util.module_from_spec(s)
    sys.modules["rlkit.stages"] = m
    s.loader.exec_module(m)
    rlkit.stages = m
import torch, transformers  # noqa: F401
from rlkit import cli
importlib.import_module("rlkit.stages." + spec["module"])
res = {"rlkit": rlkit.__file__, "stages": list(sys.modules["rlkit.stages"].__path__)[0], "runs": []}
cuda = torch.cuda.is_available()
for argv in spec["runs"]:
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    res["runs"].append({"rc": rc, "seconds": time.perf_counter() - t0,
                        "cpu_seconds": u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime,
                        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None})
    if rc:
        break
res["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open(spec["result"], "w") as f:
    json.dump(res, f)
"""

# Padding fractions of the batches each layout forms (run with the new code: it asks rlkit.ops.packing).
LAYOUTS = r"""
import json, sys
import torch
a = json.loads(sys.argv[1])
prompts, comps = a["prompts"], a["comps"]
lens = [p + c for p, c in zip(prompts, comps)]
def padded(groups):
    return [1 - sum(lens[i] for i in g) / (len(g) * max(lens[i] for i in g)) for g in groups]
# update: the trainer's minibatches (the order seeded by --seed 0 and 0 updates done)
order = torch.randperm(len(lens), generator=torch.Generator().manual_seed(0)).tolist()
mbs = [order[s : s + a["minibatch"]] for s in range(0, len(order), a["minibatch"])]
from rlkit.io.data import token_batches
sbs = token_batches(lens, a["batch_tokens"])
out = {"update": {"padded": padded(mbs)}, "score-ref": {"padded": padded(sbs)}}
try:
    from rlkit.ops.packing import layout
except ImportError as e:
    out["packed_error"] = f"rlkit.ops.packing: {e}"
else:
    def packed(groups):
        fr = []
        for g in groups:
            s = layout([[1] * lens[i] for i in g], [prompts[i] for i in g], packed=True, capacity=0)
            fr.append(1 - s.tokens / s.positions)
        return fr
    out["update"]["packed"] = packed(mbs)
    out["score-ref"]["packed"] = packed(sbs)
print(json.dumps(out))
"""


# ------------------------------------------------------------------------------------------------
# Helpers


def help_flags(command: str) -> set[str]:
    """Every option `rlkit COMMAND --help` (new code) lists."""
    env = {**os.environ, "COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "rlkit", command, "--help"], capture_output=True, text=True, env=env)
    flags = set()
    for line in r.stdout.splitlines():
        for cell in re.split(r"\s{2,}", line.strip(" \u2502|")):  # the names cells: --packing  --no-packing
            if not cell.startswith("-"):
                break
            flags.update(re.findall(r"--[a-z][\w-]*", cell))
    return flags


THREADS: list[int] = []  # --threads: the measured processes' OpenMP/torch threads


def tree_env(tree: Path | None) -> dict:
    env = dict(os.environ)
    if THREADS:
        env.update(OMP_NUM_THREADS=str(THREADS[0]), MKL_NUM_THREADS=str(THREADS[0]))
    if tree is not None:  # rlkit's own subprocesses (if any) import the same tree
        env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def launch(tree: Path | None, module: str, runs: list[list[str]], result: Path) -> list[str]:
    spec = {"tree": str(tree) if tree else None, "module": module, "runs": runs, "result": str(result)}
    return [sys.executable, "-c", LAUNCH, json.dumps(spec)]


def build(work: Path, size: str) -> Path:
    """The Qwen2 of update_memory's size `size` under work/models/size (built once, then reused)."""
    model = work / "models" / size
    stamp = um.build_stamp(size, 0) | {"bench": BUILD_VERSION}
    built = model / "bench-build.json"
    if built.is_file() and {k: json.loads(built.read_text()).get(k) for k in stamp} == stamp:
        return model
    shutil.rmtree(model, ignore_errors=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "--build-model", str(model), "--build-size", size], check=True)
    return model


def run_case(name: str, tree: Path | None, module: str, runs: list[list[str]], logs: Path, timeout: float | None) -> dict:
    """One case in a process of its own: rlkit.cli.main(argv) for each argv of `runs`, measured."""
    result, log = logs / f"{name}.result.json", logs / f"{name}.log"
    result.unlink(missing_ok=True)
    r = um.run_measured(launch(tree, module, runs, result), log, timeout, tree_env(tree))
    res = json.loads(result.read_text()) if result.is_file() else {}
    status = "ok"
    if r["timed_out"]:
        status = f"timed out after {timeout:g}s"
    elif r["exit_code"] or not res or any(x["rc"] for x in res.get("runs", [])):
        status = f"failed (exit {r['exit_code']}): {um.last_line(log)}"
    return {"case": name, "status": status, "log": str(log), "wall_s": r["wall_s"], "peak_rss_kib": r["peak_rss_kib"],
            "hwm_train_end_kib": r["hwm_train_end_kib"], "imported": {k: res.get(k) for k in ("rlkit", "stages")},
            "runs": res.get("runs", []), "argv": [shlex.join(["rlkit", *a]) for a in runs]}


def wanted(a, case: str) -> bool:
    """--cases old new mb packing ...: a case runs when its name has one of the words (default: every case)."""
    return not a.cases or any(w in case for w in a.cases)


def metrics_of(path: Path) -> dict:
    try:
        return json.loads(path.read_text().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return {}


def ratio(v, base) -> str:
    return f"{v / base:.2f}x" if isinstance(v, int | float) and isinstance(base, int | float) and base else "-"


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


# ------------------------------------------------------------------------------------------------
# Inputs


def template(work: Path, model: Path, tool: Path | None, prompts: int, n: int) -> Path:
    """A 1-token rollout of `model`: the prompts (ids, groups, answers) and manifest the synthetic rows use."""
    out = work / "tables" / f"{model.name}-template-p{prompts}-n{n}.arrow"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "import sys; from rlkit.cli import main; sys.exit(main(sys.argv[1:]))",
           "rollout", "--policy", str(model), "--task", "arithmetic", "--num-prompts", str(prompts), "--n", str(n),
           "--max-new-tokens", "1", "--seed", "0", "--engine", "hf", "--device", "cpu", "--quiet", "--out", str(out)]
    env = tree_env(tool)
    if tool is not None:  # the old tree's stages as rlkit.stages, as LAUNCH maps them
        cmd = [*launch(tool, "rollout", [cmd[3:]], out.with_suffix(".result.json"))]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def synthesize(tmpl: Path, dst: Path, lengths: list[int], vocab: int, seed: int) -> dict:
    """`tmpl`'s rows with completions of `lengths` random token ids (ids >= 3: no pad/bos/eos), old_logprobs
    -ln(vocab), reward/verifier 1 for a seeded half of each group."""
    from rlkit.io import streams

    table, reader = streams.read_table(tmpl, ["rollouts"])
    cols = table.to_pydict()
    assert len(lengths) == table.num_rows
    rng = random.Random(seed)
    comps = [[rng.randrange(len(um.SPECIALS), vocab) for _ in range(n)] for n in lengths]
    cols["completion_ids"] = comps
    cols["completion"] = [f"[{n} synthetic tokens]" for n in lengths]
    cols["old_logprobs"] = [[-math.log(vocab)] * n for n in lengths]
    cols["finish_reason"] = ["length"] * len(lengths)
    cols["reward/verifier"] = um.half_rewarded(cols["group_id"], f"training-engine|{seed}")
    manifest = dict(reader.manifest or {})
    for k in ("config", "options"):
        if isinstance(manifest.get(k), dict):
            manifest[k] = {**manifest[k], "max_new_tokens": max(lengths)}
    manifest["benchmark"] = ("benchmarks/training_engine.py: completions replaced by random token ids of drawn "
                             "lengths, old_logprobs -ln(vocab), reward/verifier 1 for a seeded half of each group")
    extra = [f for f in table.schema if f.name.startswith("reward/")]
    tmp = dst.with_name(dst.name + ".tmp")
    with streams.write_table("rollouts", tmp, manifest, extra) as w:
        w.write(cols)
    tmp.rename(dst)
    prm = [len(p) for p in cols["prompt_ids"]]
    return {"rows": len(lengths), "prompt_tokens": prm, "completion_tokens": lengths,
            "tokens": sum(prm) + sum(lengths)}


def table(work: Path, model: Path, tool: Path | None, name: str, groups: int, n: int, lengths: list[int],
          vocab: int, seed: int) -> tuple[Path, dict]:
    dst = work / "tables" / f"{model.name}-{name}.arrow"
    info = dst.with_suffix(".json")
    if dst.is_file() and info.is_file():
        return dst, json.loads(info.read_text())
    got = synthesize(template(work, model, tool, groups, n), dst, lengths, vocab, seed)
    info.write_text(json.dumps(got) + "\n")
    return dst, got


# ------------------------------------------------------------------------------------------------
# Parts


def memory_part(a, work: Path, tool: Path | None, update_flags: set[str]) -> dict:
    size = um.SIZES[a.mem_size]
    model = build(work, a.mem_size)
    params = json.loads((model / "bench-build.json").read_text())["parameters"]
    G = 4
    batch, info = table(work, model, tool, f"mem-r{a.mem_rows}-c{a.mem_completion}", a.mem_rows // G, G,
                        [a.mem_completion] * a.mem_rows, size.vocab, 0)
    base = subprocess.run([sys.executable, "-c", um.BASELINE, json.dumps({"policy": str(model), "batch": str(batch)})],
                          capture_output=True, text=True, env=tree_env(tool))
    baseline = json.loads(base.stdout.strip().splitlines()[-1]) if base.returncode == 0 else None
    runs = work / "runs" / "memory"
    runs.mkdir(parents=True, exist_ok=True)
    mb = ["--micro-batch-size", str(a.micro_batch_size)]
    cases = []
    if a.old:
        cases.append(("old", a.old, []))
    cases += [("new", None, list(a.new_flags)), (f"new-mb{a.micro_batch_size}", None, [*a.new_flags, *mb])]
    rows = []
    for name, tree, extra in cases:
        if not wanted(a, name):
            continue
        out, metrics = runs / name, runs / f"{name}.metrics.jsonl"
        argv = ["update", "--policy", str(model), "--in", str(batch), "--beta", "0", "--epochs", "1",
                "--minibatch-size", str(a.mem_rows), "--out", str(out), "--metrics", str(metrics), *extra]
        missing = [f for f in extra if f.startswith("--") and f.split("=")[0] not in update_flags] if tree is None else []
        if missing:
            rows.append({"case": name, "status": f"not available (`rlkit update --help` lists no {', '.join(missing)})",
                         "argv": [shlex.join(["rlkit", *argv])]})
            continue
        shutil.rmtree(out, ignore_errors=True)
        metrics.unlink(missing_ok=True)
        r = run_case(name, tree, "update", [argv], runs, a.case_timeout or None)
        m = metrics_of(metrics)
        end = r["hwm_train_end_kib"]
        r.update(peak_rss_mib=r["peak_rss_kib"] / 1024, train_peak_mib=end / 1024 if end else None,
                 step_adds_mib=(end - baseline["loaded_kib"]) / 1024 if end and baseline else None,
                 gpu_peak_gib=m.get("gpu_mem_peak_gib"), optimizer_steps=m.get("optimizer_steps"),
                 tokens_per_s=m.get("tokens_per_s"), train_seconds=m.get("train_seconds"), loss=m.get("loss"),
                 grad_norm=m.get("grad_norm"))
        rows.append(r)
    return {"model": {"size": a.mem_size, "parameters": params, "dir": str(model), "vocab": size.vocab,
                      "hidden": size.hidden, "layers": size.layers},
            "batch": {"rows": info["rows"], "completion": a.mem_completion, "tokens": info["tokens"],
                      "prompt_tokens_mean": sum(info["prompt_tokens"]) / info["rows"], "table": str(batch)},
            "baseline": baseline, "cases": rows}


def score_case(a, name, slug, tree, extra, ref, small, batch, info, runs, batch_tokens, score_flags) -> dict:
    """score-ref in one process: a warm-up on the 2-row table, the full table, the 2-row table again (its
    seconds are the stage's fixed costs: loading the reference, reading, writing)."""
    outs = [runs / f"score-{slug}-{k}.arrow" for k in ("warm", "full", "fixed")]
    argv = [["score-ref", "--ref", str(ref), "--in", str(src), "--out", str(o), "--dtype", "fp32",
             "--batch-tokens", str(batch_tokens), "--force", *extra] for src, o in zip((small, batch, small), outs, strict=True)]
    missing = [f for f in extra if f not in score_flags] if tree is None else []
    if missing:
        return {"case": name, "status": f"not available (`rlkit score-ref --help` lists no {', '.join(missing)})",
                "argv": [shlex.join(["rlkit", *argv[1]])]}
    r = run_case(f"score-{slug}", tree, "score_ref", argv, runs, a.case_timeout or None) | {"case": name}
    if r["status"] == "ok":
        full, fixed = r["runs"][1], r["runs"][2]
        secs = full["seconds"] - fixed["seconds"]
        r.update(stage_seconds=full["seconds"], fixed_seconds=fixed["seconds"], scoring_seconds=secs,
                 scoring_cpu_seconds=full["cpu_seconds"] - fixed["cpu_seconds"], tokens=info["tokens"],
                 tokens_per_s=info["tokens"] / secs if secs > 0 else None, out=str(outs[1]),
                 gpu_peak_gib=(full["gpu_peak_bytes"] or 0) / 2**30 or None)
    return r


def update_case(a, name, slug, tree, extra, model, batch, runs, update_flags) -> dict:
    out, metrics = runs / f"update-{slug}", runs / f"update-{slug}.metrics.jsonl"
    uextra = [*extra, *(a.new_flags if tree is None else [])]
    argv = ["update", "--policy", str(model), "--in", str(batch), "--beta", "0", "--epochs", "1",
            "--minibatch-size", str(a.tp_minibatch), "--out", str(out), "--metrics", str(metrics), *uextra]
    missing = [f for f in uextra if f.startswith("--") and f not in update_flags] if tree is None else []
    if missing:
        return {"case": name, "status": f"not available (`rlkit update --help` lists no {', '.join(missing)})",
                "argv": [shlex.join(["rlkit", *argv])]}
    shutil.rmtree(out, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    r = run_case(f"update-{slug}", tree, "update", [argv], runs, a.case_timeout or None) | {"case": name}
    m = metrics_of(metrics)
    r.update({k: m.get(k) for k in ("tokens_per_s", "train_seconds", "optimizer_steps", "loss", "grad_norm",
                                    "padding_fraction", "gpu_mem_peak_gib")})
    if r["runs"]:
        r["cpu_seconds"] = r["runs"][0]["cpu_seconds"]
    return r


def median_round(rounds: list[dict]) -> dict:
    """The round with the median tokens/s (the lower middle one of an even count), with every round's figure."""
    ok = sorted((r for r in rounds if r.get("status") == "ok" and r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
    if not ok:
        return rounds[-1]
    return ok[(len(ok) - 1) // 2] | {"rounds_tokens_per_s": [r.get("tokens_per_s") for r in rounds]}


def throughput_part(a, work: Path, tool: Path | None, update_flags: set[str], score_flags: set[str]) -> dict:
    size = um.SIZES[a.tp_size]
    model = build(work, a.tp_size)
    params = json.loads((model / "bench-build.json").read_text())["parameters"]
    G = 4
    rng = random.Random(f"lengths|{a.min_len}|{a.max_len}|{a.tp_rows}")
    lengths = [rng.randint(a.min_len, a.max_len) for _ in range(a.tp_rows)]
    batch, info = table(work, model, tool, f"tp-r{a.tp_rows}-l{a.min_len}-{a.max_len}", a.tp_rows // G, G, lengths,
                        size.vocab, 1)
    small, _ = table(work, model, tool, f"tp-r{a.tp_rows}-l{a.min_len}-{a.max_len}-head", 1, 2, lengths[:2],
                     size.vocab, 1)
    runs = work / "runs" / "throughput"
    runs.mkdir(parents=True, exist_ok=True)
    ref = work / "refs" / a.tp_size
    if not (ref / "rlkit.json").is_file():
        shutil.rmtree(ref, ignore_errors=True)
        ref.parent.mkdir(parents=True, exist_ok=True)
        r = run_case(f"freeze-ref-{a.tp_size}", tool, "freeze_ref",
                     [["freeze-ref", "--policy", str(model), "--dtype", "fp32", "--out", str(ref), "--quiet"]],
                     runs, None)
        if r["status"] != "ok":
            sys.exit(f"freeze-ref failed: {r['status']} (see {r['log']})")
    batch_tokens = 16384
    lay = subprocess.run([sys.executable, "-c", LAYOUTS, json.dumps({
        "prompts": info["prompt_tokens"], "comps": info["completion_tokens"], "minibatch": a.tp_minibatch,
        "batch_tokens": batch_tokens})], capture_output=True, text=True)
    layouts = json.loads(lay.stdout) if lay.returncode == 0 else {"error": lay.stderr.strip().splitlines()[-1:]}

    cases = [("old", a.old, [])] if a.old else []
    cases += [("new --no-packing", None, ["--no-packing"]), ("new --packing", None, ["--packing"])]
    cases = [c for c in cases if wanted(a, c[0])]
    got: dict[tuple[str, str], list[dict]] = {}  # (stage, case) -> one result per round
    for _ in range(a.repeat):  # rounds interleave the cases, so a machine's drift hits them alike
        for name, tree, extra in cases:
            slug = name.replace(" --", "-")
            got.setdefault(("score-ref", name), []).append(
                score_case(a, name, slug, tree, extra, ref, small, batch, info, runs, batch_tokens, score_flags))
            got.setdefault(("update", name), []).append(
                update_case(a, name, slug, tree, extra, model, batch, runs, update_flags))
    scored = [median_round(got[("score-ref", c[0])]) for c in cases]
    upd = [median_round(got[("update", c[0])]) for c in cases]
    # the same log-probs whatever the layout: each case's against the first case's
    ref_lp = None
    for r in scored:
        if r.get("status") != "ok":
            continue
        lp = logprobs_of(Path(r["out"]))
        if ref_lp is None:
            ref_lp, r["max_abs_diff"] = lp, 0.0
        else:
            r["max_abs_diff"] = max((abs(x - y) for a_, b_ in zip(ref_lp, lp, strict=True)
                                     for x, y in zip(a_, b_, strict=True)), default=0.0)
    return {"model": {"size": a.tp_size, "parameters": params, "dir": str(model), "vocab": size.vocab,
                      "hidden": size.hidden, "layers": size.layers},
            "batch": {"rows": info["rows"], "min_len": a.min_len, "max_len": a.max_len, "tokens": info["tokens"],
                      "completion_tokens": sum(info["completion_tokens"]), "minibatch": a.tp_minibatch,
                      "batch_tokens": batch_tokens, "table": str(batch)},
            "layouts": layouts, "score_ref": scored, "update": upd}


def logprobs_of(path: Path) -> list[list[float]]:
    from rlkit.io import streams

    t, _ = streams.read_table(path, ["scored"])
    return t.column("ref_logprobs").to_pylist()


# ------------------------------------------------------------------------------------------------
# Report


def machine() -> str:
    cpu = open("/proc/cpuinfo").read()
    name = re.search(r"^model name\s*:\s*(.*)$", cpu, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+)", open("/proc/meminfo").read(), re.M)
    return (f"{name.group(1).strip() if name else 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores, "
            f"{int(mem.group(1)) / 2**20:.1f} GiB" if mem else "")


def where(r: dict) -> str:
    imp = r.get("imported") or {}
    return f"{imp.get('rlkit')} + {imp.get('stages')}" if imp.get("rlkit") else "-"


def report_memory(res: dict) -> None:
    m, b = res["model"], res["batch"]
    print(f"\n== memory: one `update` step, {b['rows']} rows (= --minibatch-size, --epochs 1: one optimizer step)")
    print(f"model: Qwen2 from a config, random init, {m['parameters']:,} parameters (hidden {m['hidden']}, "
          f"{m['layers']} layers, vocabulary {m['vocab']:,}); rows: {b['prompt_tokens_mean']:.1f} prompt + "
          f"{b['completion']} completion tokens, {b['tokens']:,} tokens in all")
    base = res["baseline"]
    if base:
        print(f"load-only process (imports, fp32 policy resident, batch read): peak RSS {base['loaded_kib'] / 1024:,.0f} MiB")
    cases = res["cases"]
    old = next((c for c in cases if c["case"] == "old" and c["status"] == "ok"), {})
    new = next((c for c in cases if c["case"] == "new" and c["status"] == "ok"), {})
    head = (f"{'case':14} {'peak RSS MiB':>12} {'x old':>6} {'train peak':>10} {'x old':>6} {'step adds':>9} "
            f"{'x old':>6} {'x new':>6} {'GPU GiB':>7} {'steps':>5} {'loss':>9} {'grad norm':>9} {'tokens/s':>8} {'wall s':>6}")
    print(head)
    print("-" * len(head))
    for c in cases:
        if "peak_rss_mib" not in c:
            print(f"{c['case']:14} {c['status']}")
            continue
        print(f"{c['case']:14} {fmt(c['peak_rss_mib'], ',.0f'):>12} {ratio(c['peak_rss_mib'], old.get('peak_rss_mib')):>6} "
              f"{fmt(c['train_peak_mib'], ',.0f'):>10} {ratio(c['train_peak_mib'], old.get('train_peak_mib')):>6} "
              f"{fmt(c['step_adds_mib'], ',.0f'):>9} {ratio(c['step_adds_mib'], old.get('step_adds_mib')):>6} "
              f"{ratio(c['step_adds_mib'], new.get('step_adds_mib')):>6} {fmt(c['gpu_peak_gib'], '.2f'):>7} "
              f"{fmt(c['optimizer_steps'], 'd'):>5} {fmt(c['loss'], '.6f'):>9} {fmt(c['grad_norm'], '.6f'):>9} "
              f"{fmt(c['tokens_per_s'], ',.1f'):>8} {c['wall_s']:>6.1f}"
              + ("" if c["status"] == "ok" else f"  {c['status']}"))
    mbc = next((c for c in cases if c["case"].startswith("new-mb") and c.get("status") == "ok"), None)
    if mbc and old:
        print(f"goal <= 0.35x: {mbc['case']} / old = {ratio(mbc['train_peak_mib'], old['train_peak_mib'])} (train peak), "
              f"{ratio(mbc['step_adds_mib'], old['step_adds_mib'])} (step adds), "
              f"{ratio(mbc['gpu_peak_gib'], old['gpu_peak_gib'])} (GPU)")
    print("peak RSS: the process's ru_maxrss (load, train, save); train peak: its VmHWM when the step's progress "
          "line is printed; step adds: train peak minus the load-only process's peak; GPU GiB: the update's "
          "gpu_mem_peak_gib (a GPU only)")
    for c in cases:
        print(f"  [{c['case']}] {c['argv'][0]}" + (f"   # {where(c)}" if c.get("imported") else ""))


def frac(xs) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{sum(xs) / len(xs):.1%} (batches {xs[0]:.0%}..{xs[-1]:.0%})"


def rounds(c: dict) -> str:
    got = c.get("rounds_tokens_per_s") or []
    return "  rounds: " + ", ".join(fmt(v, ",.1f") for v in got) if len(got) > 1 else ""


def report_throughput(res: dict) -> None:
    m, b = res["model"], res["batch"]
    print(f"\n== throughput: {b['rows']} rows, completion lengths uniform in {b['min_len']}..{b['max_len']} tokens "
          f"({b['completion_tokens']:,} completion tokens, {b['tokens']:,} with the prompts)")
    print(f"model: Qwen2 from a config, random init, {m['parameters']:,} parameters (hidden {m['hidden']}, "
          f"{m['layers']} layers, vocabulary {m['vocab']:,}); update --minibatch-size {b['minibatch']} --epochs 1; "
          f"score-ref --batch-tokens {b['batch_tokens']}")
    lay = res["layouts"]
    if "error" in lay:
        print(f"padding fraction: not computed ({lay['error']})")
    else:
        for stage in ("update", "score-ref"):
            got = lay[stage]
            print(f"padding fraction, {stage}: padded {frac(got['padded'])}; packed "
                  + (frac(got["packed"]) if "packed" in got else f"not computed ({lay.get('packed_error')})"))
    for stage, cases, key in (("update", res["update"], "tokens_per_s"), ("score-ref", res["score_ref"], "tokens_per_s")):
        old = next((c for c in cases if c["case"] == "old" and c.get("status") == "ok"), {})
        pad = next((c for c in cases if c["case"] == "new --no-packing" and c.get("status") == "ok"), {})
        if stage == "update":
            head = f"{'update':18} {'tokens/s':>9} {'x old':>6} {'x padded':>8} {'train s':>7} {'steps':>5} {'pad frac':>8} {'wall s':>6}"
        else:
            head = (f"{'score-ref':18} {'tokens/s':>9} {'x old':>6} {'x padded':>8} {'scoring s':>9} {'stage s':>7} "
                    f"{'fixed s':>7} {'max |dlogp|':>11}")
        print(head)
        print("-" * len(head))
        for c in cases:
            if c.get("status") != "ok":
                print(f"{c['case']:18} {c['status']}")
                continue
            v = c.get(key)
            if stage == "update":
                print(f"{c['case']:18} {fmt(v, ',.1f'):>9} {ratio(v, old.get(key)):>6} {ratio(v, pad.get(key)):>8} "
                      f"{fmt(c.get('train_seconds'), '.2f'):>7} {fmt(c.get('optimizer_steps'), 'd'):>5} "
                      f"{fmt(c.get('padding_fraction'), '.1%'):>8} {c['wall_s']:>6.1f}" + rounds(c))
            else:
                print(f"{c['case']:18} {fmt(v, ',.1f'):>9} {ratio(v, old.get(key)):>6} {ratio(v, pad.get(key)):>8} "
                      f"{fmt(c.get('scoring_seconds'), '.2f'):>9} {fmt(c.get('stage_seconds'), '.2f'):>7} "
                      f"{fmt(c.get('fixed_seconds'), '.2f'):>7} {fmt(c.get('max_abs_diff'), '.2e'):>11}" + rounds(c))
    print("update tokens/s: the update's tokens_per_s metric (prompt + completion tokens trained / training-loop "
          "seconds); score-ref tokens/s: tokens scored / (stage seconds on the table - stage seconds on a 2-row "
          "table); max |dlogp|: largest difference of score-ref's log-probs from the first case's; with --repeat, "
          "the median round and every round's tokens/s; goal: packed >= 1.5x padded")
    for c in [*res["score_ref"], *res["update"]]:
        print(f"  [{c['case']}] {c['argv'][-1] if len(c['argv']) > 1 else c['argv'][0]}"
              + (f"   # {where(c)}" if c.get("imported") else ""))


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, help="A checkout of the old code (git worktree add DIR COMMIT): its cases run "
                    "beside the new code's. Default: new code only.")
    ap.add_argument("--parts", nargs="+", choices=("memory", "throughput"), default=["memory", "throughput"])
    ap.add_argument("--workdir", type=Path, help="Keep models, tables and outputs here (a rerun reuses the models and "
                    "tables); default: a temporary folder, removed at the end.")
    ap.add_argument("--json", type=Path, help="Write every figure, command and log path to this file.")
    ap.add_argument("--mem-size", choices=sorted(um.SIZES), default="100m")
    ap.add_argument("--mem-rows", type=int, default=128, help="Rows of the memory batch = --minibatch-size (one step).")
    ap.add_argument("--mem-completion", type=int, default=32, help="Completion tokens of each memory row.")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--tp-size", choices=sorted(um.SIZES), default="small")
    ap.add_argument("--tp-rows", type=int, default=128)
    ap.add_argument("--tp-minibatch", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=1, help="Throughput: run every case this many times, in "
                    "interleaved rounds, and report the median round (a noisy machine: 3).")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the measured processes (default: torch's, one a "
                    "core). On a machine other processes keep busy, 1 thread a process keeps the cases' ratios steady "
                    "(OpenMP's barriers wait on a descheduled thread: many small kernels suffer most).")
    ap.add_argument("--new-flags", default="", help="More flags for the new code's update cases, e.g. "
                    "'--micro-batch-tokens 4096' (one string, split as a shell does).")
    ap.add_argument("--cases", nargs="+", help="Run only the cases whose name holds one of these words, e.g. "
                    "old, mb, no-packing (default: all).")
    ap.add_argument("--case-timeout", type=float, default=0, help="Kill a case after this many seconds; 0: no limit.")
    ap.add_argument("--smoke", action="store_true", help="Tiny sizes: checks the script, figures mean nothing.")
    ap.add_argument("--build-model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--build-size", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.build_model:
        um.build_model(a.build_model, a.build_size)
        stamp = a.build_model / "bench-build.json"
        stamp.write_text(json.dumps(json.loads(stamp.read_text()) | {"bench": BUILD_VERSION}) + "\n")
        return
    if a.smoke:
        a.mem_size, a.mem_rows, a.mem_completion, a.micro_batch_size = "small", 8, 8, 2
        a.tp_size, a.tp_rows, a.tp_minibatch, a.min_len, a.max_len = "small", 8, 4, 2, 24
    a.new_flags = shlex.split(a.new_flags)
    if a.threads:
        THREADS.append(a.threads)
    if a.old is not None:
        a.old = a.old.resolve()
        if not (a.old / "rlkit" / "__init__.py").is_file() or not (a.old / "stages").is_dir():
            sys.exit(f"--old {a.old}: not an rlkit checkout (no rlkit/__init__.py and stages/)")
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="training-engine-")
    work = (a.workdir or Path(tmp.name)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        res: dict = {"machine": machine(), "python": sys.executable, "old": str(a.old) if a.old else None,
                     "new": str(REPO), "threads": a.threads}
        tool = a.old  # the old tree makes the inputs (templates, reference) when given: it does not move
        update_flags = help_flags("update")
        if "memory" in a.parts:
            res["memory"] = memory_part(a, work, tool, update_flags)
        if "throughput" in a.parts:
            res["throughput"] = throughput_part(a, work, tool, update_flags, help_flags("score-ref"))
    finally:
        if tmp is not None:
            tmp.cleanup()
    res["seconds"] = round(time.monotonic() - t0, 1)
    print(f"machine: {res['machine']}; old code: {res['old'] or '(none: --old not given)'}; new code: {res['new']}"
          + (f"; OMP_NUM_THREADS={res['threads']}" if res["threads"] else ""))
    if "memory" in res:
        report_memory(res["memory"])
    if "throughput" in res:
        report_throughput(res["throughput"])
    print(f"\n{res['seconds']:.0f} s in all")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
