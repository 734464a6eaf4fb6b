"""`rlkit update` per training mode on a ~100M-parameter Qwen2 with a 32k BPE vocabulary: peak resident
memory, tokens/s and optimizer-state bytes of fp32, bf16 autocast, gradient checkpointing and LoRA.

Usage: python benchmarks/update_memory.py [--size 100m|small] [--workdir DIR] [--modes fp32 bf16 ...]
           [--prompts P --n G --max-new-tokens T --minibatch-size M] [--mode-timeout S] [--json FILE]
           [--malloc-mmap-threshold BYTES]

1. Builds (once per --workdir) a Qwen2ForCausalLM from a config (random init, seed 0; tied embeddings)
   and a byte-level BPE tokenizer trained with `tokenizers` on generated text (arithmetic prompts and
   answers, number words, made-up words), saved as a plain Hugging Face directory (safetensors).
2. Samples ONE rollout batch with the real stage, `rlkit rollout --engine hf` (P prompts x G samples x
   T tokens; a random-init model rambles to T). Its verifier rewards are all 0 (the model cannot add),
   which gives every completion advantage 0, so `batch.arrow` is that table with `reward/verifier` set
   to 1 for a seeded half of each group: the update then has non-zero advantages and gradients. Memory
   and time do not depend on it (autograd runs the same backward either way); it keeps the benchmark
   honest against any shortcut for all-zero advantages. `rollouts.arrow` is the stage's own table.
3. Runs `rlkit update --beta 0 --epochs 1 --minibatch-size M` once per mode, each in its own process,
   one after the other, with nothing else of this script running; M should leave at least 2 optimizer
   steps, so that the second step's forward and backward run with the AdamW moments already allocated
   (the steady-state peak). A mode whose flag `rlkit update --help` does not list is "not available".

Figures per mode: peak RSS = the update process's ru_maxrss (os.wait4: the whole process, Python,
torch, model, batch, training, saving). train peak = its VmHWM read from /proc when the trainer logs its
last optimizer step; train-load = train peak minus the peak of a baseline process that does the same
imports, loads the same fp32 policy (every mode loads fp32: bf16 is autocast over fp32 master weights;
the weights are mmapped, so it reads every page once, as training does) and reads the batch, then exits:
what training adds (activations, gradients, AdamW moments, autocast copies, adapters). tokens/s and
train_seconds are the update's own metrics (`--metrics`); train_seconds includes the pi_old recompute
pass that `--old-logprobs auto` runs for --dtype other than fp32 (column pi_old). Optimizer state = the
size of OUT/trainer/optimizer.safetensors; trainable parameters = the element count of its `exp_avg`
tensors. The JSON (--json) also holds each process's RSS once a second.
A rerun with the same --workdir reuses the model and the batch (per P, G, T) and reruns the updates.
On a CPU, bf16 autocast is fast only with AVX512-BF16/AMX; elsewhere torch falls back to slow bf16
matmuls (on an AVX2-only CPU, several times to tens of times slower than fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BUILD_VERSION = 1  # bump when the model or tokenizer recipe changes: reruns then rebuild


@dataclass(frozen=True)
class Size:
    """A Qwen2 shape and the default batch that goes with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    corpus_examples: int  # arithmetic examples in the tokenizer's training text
    prompts: int
    n: int
    max_new_tokens: int
    minibatch: int


SIZES = {
    # 100,697,856 parameters: 25.2M embedding (tied with the output head) + 12 x 6.29M
    "100m": Size(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32768,
                 corpus_examples=20000, prompts=16, n=4, max_new_tokens=64, minibatch=32),
    # 3,672,320 parameters, the same architecture: for tests and quick checks
    "small": Size(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=768, vocab=8192,
                  corpus_examples=4000, prompts=2, n=4, max_new_tokens=16, minibatch=4),
}

MODES: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["--dtype", "bf16"],
    "bf16-gc": ["--dtype", "bf16", "--gradient-checkpointing"],
    "lora16": ["--lora-rank", "16"],
    "lora16-bf16-gc": ["--lora-rank", "16", "--dtype", "bf16", "--gradient-checkpointing"],
}

RLKIT = [sys.executable, "-m", "rlkit"]
SPECIALS = ("<pad>", "<bos>", "<eos>")

BASELINE = r"""
import json, os, re, resource, sys
def kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
a = json.loads(sys.argv[1])
import torch, transformers
from rlkit import cli
from rlkit.io import checkpoints, claims, streams  # noqa: F401 (update's imports: the CLI, torch, transformers)
imports = kib()
model, tokenizer = checkpoints.load_policy(a["policy"], "fp32")
with torch.no_grad():  # the weights are mmapped from the safetensors file: read each page once, as training will
    for p in model.parameters():
        p.sum()
model_kib = kib()
table, _ = streams.read_table(a["batch"], ["rollouts", "scored"])
loaded = kib()
cpu = open("/proc/cpuinfo").read()
flags = re.search(r"^flags\s*:(.*)$", cpu, re.M)
flags = set(flags.group(1).split()) if flags else set()
name = re.search(r"^model name\s*:\s*(.*)$", cpu, re.M)
mem = re.search(r"^MemTotal:\s*(\d+)", open("/proc/meminfo").read(), re.M)
try:
    bf16_kernels = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
except Exception:
    bf16_kernels = None
print(json.dumps({
    "imports_kib": imports, "model_kib": model_kib, "loaded_kib": loaded,
    "machine": {
        "cpu": name.group(1).strip() if name else "unknown", "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
        "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(), "mkldnn_bf16_kernels": bf16_kernels,
        "cpu_flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")},
        "python": sys.version.split()[0],
    }}))
"""


# ------------------------------------------------------------------------------------------------
# The model and its tokenizer (run in a child process: `--build-model DIR`)

ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen").split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    return number_words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + number_words(n % 1000))


def corpus(size: Size, seed: int = 0):
    """Generated training text for the BPE: enough distinct words for `size.vocab` merges."""
    from rlkit.tasks import VERBOSE, get_task

    rng = random.Random(seed)
    for ex in get_task("arithmetic").examples("train", size.corpus_examples, seed):
        yield ex.prompt + rng.choice(VERBOSE).format(ex.answer)
    for i in range(0, 100_000, 7 if size.vocab > 10_000 else 37):
        yield f"{i} is {number_words(i)}."
    syllables = [c + v for c in "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr".split()
                 for v in "a e i o u ai ea ee ie oo ou".split()]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(2 * size.vocab)]
    for _ in range(size.vocab + size.vocab // 4):
        # half Zipf-like (a few frequent words), half uniform over the lexicon
        yield " ".join(lexicon[min(int(rng.paretovariate(0.8)) - 1, len(lexicon) - 1)] if rng.random() < 0.5
                       else rng.choice(lexicon) for _ in range(rng.randint(5, 20)))


def build_tokenizer(size: Size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size.vocab, min_frequency=2, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(size), trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   padding_side="left", clean_up_tokenization_spaces=False)


def build_model(out: Path, size_name: str, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = SIZES[size_name]
    tokenizer = build_tokenizer(size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    (tmp / "bench-build.json").write_text(json.dumps(build_stamp(size_name, seed) | {"parameters": params}) + "\n")
    tmp.rename(out)


def build_stamp(size_name: str, seed: int) -> dict:
    return {"version": BUILD_VERSION, "size": size_name, "seed": seed, **asdict(SIZES[size_name])}


# ------------------------------------------------------------------------------------------------
# Helpers of the parent process (no torch here)


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def optimizer_summary(out: Path) -> dict:
    """Bytes of the update's optimizer-state file, and the trainable parameters it holds moments for."""
    path = out / "trainer" / "optimizer.safetensors"
    if not path.is_file():
        path = next(iter(sorted(out.rglob("optimizer.safetensors"))), None)
    if path is None:
        return {"optimizer_bytes": None}
    head = safetensors_header(path)
    moments = [t for k, t in head.items() if k.endswith("/exp_avg")]
    count = 0
    for t in moments:
        n = 1
        for s in t["shape"]:
            n *= s
        count += n
    return {"optimizer_bytes": path.stat().st_size, "optimizer_file": str(path.relative_to(out)),
            "trainable_params": count, "moment_dtype": ",".join(sorted({t["dtype"] for t in moments}))}


def help_flags() -> set[str]:
    """Every option `rlkit update --help` lists (a wide terminal, so no name is cut short)."""
    env = {**os.environ, "COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"}
    r = subprocess.run([*RLKIT, "update", "--help"], capture_output=True, text=True, env=env, check=True)
    flags = set()
    for line in r.stdout.splitlines():
        cell = re.split(r"\s{2,}", line.strip(" \u2502|"))[0]  # the names column of an option's row
        if cell.startswith("-"):
            flags.update(re.findall(r"--[a-z][\w-]*", cell))
    return flags


def proc_kib(pid: int, key: str) -> int | None:
    """VmRSS / VmHWM of a live process, KiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


TRAIN_START = re.compile(r"^update: reward = ")  # printed by the trainer once the model and batch are loaded
STEP = re.compile(r"^update: (\d+)/(\d+) \[")  # a progress line; the one with N/N ends the last step


def run_measured(cmd: list[str], log: Path, timeout: float | None, env: dict | None = None) -> dict:
    """Run `cmd` alone: its exit code, wall seconds, peak RSS (ru_maxrss of os.wait4, KiB), and its
    high-water mark (VmHWM) when the training loop starts and when its last optimizer step is logged
    (read as each log line arrives), plus an RSS sample a second."""
    t0 = time.monotonic()
    marks: dict[str, int | None] = {}
    timeline: list[tuple[float, int]] = []
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             text=True, errors="replace")

        def read() -> None:
            for line in p.stdout:
                if TRAIN_START.match(line) and "train_start" not in marks:
                    marks["train_start"] = proc_kib(p.pid, "VmHWM")
                step = STEP.match(line)
                if step and step.group(1) == step.group(2):
                    marks["train_end"] = proc_kib(p.pid, "VmHWM")
                    marks["train_end_s"] = round(time.monotonic() - t0, 1)
                f.write(line)
                f.flush()  # the log can be followed while it runs

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        killed, last = False, -1.0
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            now = time.monotonic() - t0
            if now - last >= 1.0:
                rss = proc_kib(p.pid, "VmRSS")
                if rss is not None:
                    timeline.append((round(now, 1), rss))
                last = now
            if timeout and not killed and now > timeout:
                p.kill()
                killed = True
            time.sleep(0.05)
        reader.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return {"exit_code": p.returncode, "wall_s": round(time.monotonic() - t0, 1), "peak_rss_kib": ru.ru_maxrss,
            "timed_out": killed, "hwm_train_start_kib": marks.get("train_start"),
            "hwm_train_end_kib": marks.get("train_end"), "train_end_s": marks.get("train_end_s"),
            "rss_timeline_kib": timeline}


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def half_rewarded(group_ids: list[int], salt: str) -> list[float]:
    """Reward 1 for a seeded half of each group's rows (seeded by `salt` and the group), 0 for the rest."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    reward = [0.0] * len(group_ids)
    for g, rows in groups.items():
        for i in random.Random(f"{salt}|{g}").sample(rows, len(rows) // 2):
            reward[i] = 1.0
    return reward


def mixed_rewards(src: Path, dst: Path) -> None:
    """`src` with `reward/verifier` 1 for a seeded half of each group's samples, 0 for the rest."""
    from rlkit.io import streams

    table, reader = streams.read_table(src, ["rollouts"])
    cols = table.to_pydict()
    cols["reward/verifier"] = half_rewarded(cols["group_id"], "update-memory")
    manifest = {**(reader.manifest or {}), "benchmark": "benchmarks/update_memory.py: reward/verifier replaced by "
                "1 for a seeded half of each group (the random-init policy scores 0 everywhere)"}
    extra = [f for f in table.schema if f.name.startswith("reward/")]
    with streams.write_table("rollouts", dst, manifest, extra) as w:
        w.write(cols)


def ratio(v, base) -> str:
    return f"{v / base:.2f}x" if isinstance(v, int | float) and isinstance(base, int | float) and base else "-"


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="100m")
    ap.add_argument("--workdir", type=Path, help="Keep the model, batch and update outputs here (reused by a rerun); "
                    "default: a temporary folder, removed at the end.")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--prompts", type=int, help="Prompts in the batch (default: per --size).")
    ap.add_argument("--n", type=int, help="Samples per prompt (default: per --size).")
    ap.add_argument("--max-new-tokens", type=int, help="Completion tokens (default: per --size).")
    ap.add_argument("--minibatch-size", type=int, help="update --minibatch-size (default: per --size).")
    ap.add_argument("--mode-timeout", type=float, default=0, help="Kill an update after this many seconds "
                    "(its peak RSS so far is reported as a lower bound); 0: no limit.")
    ap.add_argument("--malloc-mmap-threshold", type=int, help="Set glibc's MALLOC_MMAP_THRESHOLD_ (bytes, e.g. "
                    "131072) for the measured processes: a fixed threshold returns every large freed tensor to the "
                    "system, so RSS follows live tensors instead of heap fragmentation (default: glibc's dynamic one, "
                    "what a user gets).")
    ap.add_argument("--json", type=Path, help="Write the results as JSON to this file.")
    ap.add_argument("--build-model", type=Path, help=argparse.SUPPRESS)  # internal: the child that builds
    a = ap.parse_args()
    if a.build_model:
        build_model(a.build_model, a.size)
        return
    size = SIZES[a.size]
    P, G = a.prompts or size.prompts, a.n or size.n
    T, M = a.max_new_tokens or size.max_new_tokens, a.minibatch_size or size.minibatch
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="update-memory-")
    work = (a.workdir or Path(tmp.name)).resolve()
    try:
        results = measure(a, work, P, G, T, M)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report(results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")


def measure(a, work: Path, P: int, G: int, T: int, M: int) -> dict:
    root = work / a.size
    model = root / "model"
    stamp = build_stamp(a.size, 0)
    built = json.loads((model / "bench-build.json").read_text()) if (model / "bench-build.json").is_file() else {}
    timings: dict[str, float | str] = {}
    if {k: built.get(k) for k in stamp} != stamp:
        shutil.rmtree(root, ignore_errors=True)  # batches and runs of another model go with it
        root.mkdir(parents=True)
        t0 = time.monotonic()
        subprocess.run([sys.executable, __file__, "--size", a.size, "--build-model", str(model)], check=True)
        timings["build_s"] = round(time.monotonic() - t0, 1)
        built = json.loads((model / "bench-build.json").read_text())
    else:
        timings["build_s"] = "reused"
    bdir = root / f"batch-p{P}-n{G}-t{T}"
    batch = bdir / "batch.arrow"
    rollout_cmd = [*RLKIT, "rollout", "--policy", str(model), "--task", "arithmetic", "--num-prompts", str(P),
                   "--n", str(G), "--max-new-tokens", str(T), "--seed", "0", "--engine", "hf",
                   "--out", str(bdir / "rollouts.arrow")]
    if not batch.is_file():
        shutil.rmtree(bdir, ignore_errors=True)
        bdir.mkdir(parents=True)
        r = run_measured(rollout_cmd, bdir / "rollout.log", None)
        if r["exit_code"]:
            sys.exit(f"rollout failed (exit {r['exit_code']}): see {bdir / 'rollout.log'}: {last_line(bdir / 'rollout.log')}")
        timings["rollout_s"] = r["wall_s"]
        mixed_rewards(bdir / "rollouts.arrow", batch)
    else:
        timings["rollout_s"] = "reused"
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(a.malloc_mmap_threshold)} if a.malloc_mmap_threshold else {})}
    base = subprocess.run([sys.executable, "-c", BASELINE, json.dumps({"policy": str(model), "batch": str(batch)})],
                          capture_output=True, text=True, check=True, env=env)
    baseline = json.loads(base.stdout.strip().splitlines()[-1])
    from rlkit.io import streams

    table, _ = streams.read_table(batch, ["rollouts"])
    comp = [len(c) for c in table.column("completion_ids").to_pylist()]
    prm = [len(c) for c in table.column("prompt_ids").to_pylist()]
    stage, _ = streams.read_table(bdir / "rollouts.arrow", ["rollouts"])
    batch_info = {"stage_reward_mean": sum(stage.column("reward/verifier").to_pylist()) / stage.num_rows,
                  "prompts": P, "n": G, "max_new_tokens": T, "rows": table.num_rows, "minibatch_size": M,
                  "optimizer_steps": -(-table.num_rows // M), "tokens": sum(comp) + sum(prm),
                  "completion_tokens_mean": sum(comp) / len(comp), "prompt_tokens_mean": sum(prm) / len(prm)}
    flags = help_flags()
    runs = root / "runs" / (f"{bdir.name}-m{M}" + (f"-mmap{a.malloc_mmap_threshold}" if a.malloc_mmap_threshold else ""))
    runs.mkdir(parents=True, exist_ok=True)
    modes = []
    for mode in a.modes:
        extra = MODES[mode]
        out, metrics, log = runs / mode, runs / f"{mode}.metrics.jsonl", runs / f"{mode}.log"
        cmd = [*RLKIT, "update", "--policy", str(model), "--in", str(batch), "--beta", "0", "--epochs", "1",
               "--minibatch-size", str(M), "--out", str(out), "--metrics", str(metrics), *extra]
        row: dict = {"mode": mode, "flags": " ".join(extra), "command": shlex.join(cmd)}
        missing = [f for f in extra if f.startswith("--") and f not in flags]
        if missing:
            modes.append({**row, "status": f"not available (`rlkit update --help` lists no {', '.join(missing)})"})
            continue
        shutil.rmtree(out, ignore_errors=True)  # else update would skip an up-to-date --out
        metrics.unlink(missing_ok=True)
        r = run_measured(cmd, log, a.mode_timeout or None, env)
        end = r["hwm_train_end_kib"]
        row.update(r, peak_rss_mib=round(r["peak_rss_kib"] / 1024, 1),
                   train_peak_mib=round(end / 1024, 1) if end else None,
                   train_over_load_mib=round((end - baseline["loaded_kib"]) / 1024, 1) if end else None,
                   after_train_mib=round((r["peak_rss_kib"] - end) / 1024, 1) if end else None)
        if r["timed_out"]:
            row["status"] = f"timed out after {a.mode_timeout:g}s (peak RSS so far)"
        elif r["exit_code"]:
            row["status"] = f"failed (exit {r['exit_code']}): {last_line(log)}"
        else:
            row["status"] = "ok"
            m = json.loads(metrics.read_text().splitlines()[-1])
            row.update({k: m.get(k) for k in ("tokens_per_s", "train_seconds", "optimizer_steps", "old_logprobs",
                                              "grad_norm", "loss")})
            row.update(optimizer_summary(out))
        modes.append(row)
    return {"size": a.size, "model": {"dir": str(model), "parameters": built["parameters"],
                                      **{k: built[k] for k in asdict(SIZES[a.size]) if k not in batch_info}},
            "batch": {**batch_info, "dir": str(bdir)}, "timings": timings, "baseline": baseline,
            "rollout_command": shlex.join(rollout_cmd), "modes": modes, "workdir": str(work),
            "malloc_mmap_threshold": a.malloc_mmap_threshold}


def report(res: dict) -> None:
    m, b, base, mach = res["model"], res["batch"], res["baseline"], res["baseline"]["machine"]
    print(f"model: Qwen2ForCausalLM from a config, random init (seed 0), {m['parameters']:,} parameters "
          f"(hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV, MLP "
          f"{m['intermediate']}, vocabulary {m['vocab']:,} byte-level BPE, tied embeddings); {m['dir']}")
    print(f"batch: {b['rows']} completions = {b['prompts']} prompts x {b['n']} samples x <= {b['max_new_tokens']} "
          f"tokens (mean {b['completion_tokens_mean']:.1f} completion + {b['prompt_tokens_mean']:.1f} prompt tokens), "
          f"{b['tokens']:,} tokens; minibatch {b['minibatch_size']} -> {b['optimizer_steps']} optimizer steps; "
          f"the rollout stage's mean verifier reward {b['stage_reward_mean']:.3f}, trained on 0/1 per half-group")
    print(f"machine: {mach['cpu']}, {mach['usable_cores']} cores ({mach['torch_threads']} torch threads), "
          f"{mach['memory_gib']} GiB; torch {mach['torch']}, transformers {mach['transformers']}; CPU capability "
          f"{mach['cpu_capability']}, oneDNN {mach['mkldnn']}, oneDNN bf16 kernels {mach['mkldnn_bf16_kernels']}, "
          f"flags {', '.join(f'{k}={v}' for k, v in mach['cpu_flags'].items())}")
    print("  (CPU bf16 autocast is fast only with AVX512-BF16/AMX; without them torch runs bf16 matmuls on a "
          "slow fallback: bf16 speed here says little about a GPU or a bf16-capable CPU)")
    print("allocator: glibc malloc, " + (f"MALLOC_MMAP_THRESHOLD_={res['malloc_mmap_threshold']} (fixed)"
          if res.get("malloc_mmap_threshold") else "default dynamic mmap threshold (freed large tensors may stay "
          "in the heap: RSS includes fragmentation; see --malloc-mmap-threshold)"))
    t = res["timings"]
    print(f"setup: model build {t['build_s']}{'' if t['build_s'] == 'reused' else ' s'}, "
          f"rollout {t['rollout_s']}{'' if t['rollout_s'] == 'reused' else ' s'} (whole process)")
    print(f"baseline process (imports, fp32 policy loaded with every weight resident, batch read, nothing "
          f"trained): peak RSS {base['loaded_kib'] / 1024:,.0f} MiB (imports alone {base['imports_kib'] / 1024:,.0f} "
          f"MiB, + loading the policy: modeling code, tokenizer, weights {(base['model_kib'] - base['imports_kib']) / 1024:,.0f} "
          f"MiB)")
    ok = {r["mode"]: r for r in res["modes"] if r.get("status") == "ok"}
    ref = ok.get("fp32", {})
    ref_opt = ref["optimizer_bytes"] / 2**20 if ref.get("optimizer_bytes") else None
    head = (f"{'mode':16} {'peak RSS MiB':>12} {'x fp32':>6} {'train peak':>10} {'train-load':>10} {'x fp32':>6} "
            f"{'tokens/s':>8} {'x fp32':>6} {'train s':>7} {'opt MiB':>7} {'x fp32':>6} {'trainable':>11} "
            f"{'pi_old':>9} {'wall s':>6}")
    print(head)
    print("-" * len(head))
    for r in res["modes"]:
        if "peak_rss_kib" not in r:
            print(f"{r['mode']:16} {r['status']}")
            continue
        omib = r["optimizer_bytes"] / 2**20 if r.get("optimizer_bytes") else None
        lower = ">=" if r["timed_out"] else ""
        print(f"{r['mode']:16} {lower + fmt(r['peak_rss_mib'], ',.0f'):>12} {ratio(r['peak_rss_mib'], ref.get('peak_rss_mib')):>6} "
              f"{fmt(r['train_peak_mib'], ',.0f'):>10} {fmt(r['train_over_load_mib'], ',.0f'):>10} "
              f"{ratio(r['train_over_load_mib'], ref.get('train_over_load_mib')):>6} "
              f"{fmt(r.get('tokens_per_s'), ',.1f'):>8} {ratio(r.get('tokens_per_s'), ref.get('tokens_per_s')):>6} "
              f"{fmt(r.get('train_seconds'), '.1f'):>7} {fmt(omib, ',.1f'):>7} {ratio(omib, ref_opt):>6} "
              f"{fmt(r.get('trainable_params'), ','):>11} {r.get('old_logprobs') or '-':>9} {r['wall_s']:>6.1f}"
              + ("" if r["status"] == "ok" else f"  {r['status']}"))
    print("peak RSS: ru_maxrss of the update process (whole run: load, train, save); train peak: its VmHWM when the "
          "last optimizer step is logged; train-load: train peak minus the baseline process's peak (what training "
          "adds: activations, gradients, AdamW moments, autocast copies, adapters); tokens/s, train s: the update's "
          "metrics (train s includes a pi_old recompute pass where pi_old says recompute); opt MiB: "
          "trainer/optimizer.safetensors; trainable: parameters with AdamW moments; wall s: whole process")
    after = [f"{r['mode']} +{r['after_train_mib']:,.0f} MiB" for r in res["modes"] if (r.get("after_train_mib") or 0) > 16]
    if after:
        print("peak above the training peak, after the last step (saving the checkpoint): " + ", ".join(after))
    print("commands (rlkit = " + shlex.join(RLKIT) + "):")
    print("  " + res["rollout_command"].replace(shlex.join(RLKIT), "rlkit", 1)
          + "   # then reward/verifier set to 1 for half of each group -> batch.arrow")
    for r in res["modes"]:
        print(f"  [{r['mode']}] " + r["command"].replace(shlex.join(RLKIT), "rlkit", 1))


if __name__ == "__main__":
    main()
