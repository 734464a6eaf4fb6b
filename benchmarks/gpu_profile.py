"""Profile of the RL pipeline's model stages on one device: per stage, tokens/s and peak memory, for each training
mode (fp32, bf16 autocast, bf16 + gradient checkpointing, LoRA) on a ~0.5B-parameter Qwen2 built from a config.

Usage: python benchmarks/gpu_profile.py [--size 0.5b|tiny] [--device auto|cpu|cuda|cuda:N] [--modes fp32 bf16 ...]
           [--workdir DIR] [--json FILE]

1. Builds (once per --workdir) a Qwen2ForCausalLM from a config (random init, seed 0), saved as a plain Hugging
   Face directory. At --size 0.5b it has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
   MLP 4864, tied embeddings, QKV biases) and its 151,936-token vocabulary: 494,032,768 parameters. The
   vocabulary is the one thing a profile cannot shrink: the output head is 136M of those parameters and its
   logits are the largest tensors of sampling, log-probs and their backward, so a model with a 100-token
   vocabulary would profile another workload. Nothing is downloaded, so the tokenizer is byte-level (one token per
   byte, as Qwen2's pre-tokenizer splits text, so an ASCII character is one token) padded to 151,936 entries with
   filler tokens that text never encodes to but that decode. A random model samples almost only those (the
   chance of <eos> is about 1/151,936 a token), so every completion runs to --max-new-tokens and every mode
   sees the same lengths. --size tiny: the same architecture
   at a few million parameters (vocabulary 8,192), for CI and quick checks (well under a minute on 2 cores).
2. Writes the workload: an SFT data file (prompt + completion of fixed lengths), a prompts file (fixed-length
   prompts ending in a sum, with its answer) and a reward function `coin` (a stable hash of the completion, 0 or
   1) so that groups have rewards that differ and the update has non-zero advantages, as a real run has.
3. Per mode, in a process of its own, runs the stages one after the other through the `rlkit` command line
   (`rlkit.cli.main(argv)`, the argv a user types), each with `--device` and the mode's flags. One runner process
   imports torch, transformers and rlkit once and forks a fresh child per mode before anything touches CUDA (so
   a mode pays no import time, which at --size tiny would be most of the run, and modes share no memory):
       sft --model MODEL --data sft.jsonl          (--dtype, --gradient-checkpointing, --lora-rank of the mode)
       freeze-ref --policy SFT                     (fp32 mode: --dtype fp32, others bf16; not profiled: no model runs)
       rollout --engine hf --prompts prompts.jsonl (the hf engine samples in fp32 in every mode)
       score-ref --ref REF                         (fp32 mode: --dtype fp32; others: --dtype stored, i.e. bf16)
       update --policy SFT --in scored.arrow       (the mode's flags; GRPO, 1 epoch)

Figures per stage. tokens/s: sft and update report their own `tokens_per_s` metric (training tokens over the
training loop's seconds; update's includes the pi_old recompute pass that --dtype bf16 runs); rollout: completion
tokens sampled over the stage's seconds; score-ref: prompt + completion tokens scored over the stage's seconds
(both include loading the model, not the imports). Memory on a GPU: sft and update report `gpu_mem_peak_gib`
(torch.cuda.max_memory_allocated over training); rollout and score-ref: the same allocator peak, read around the
stage (its statistics reset before it). On a CPU (no GPU): the process's peak resident memory over the stage
(VmHWM, reset before each stage through /proc/self/clear_refs), said so in the header. Trainable parameters: the
element count of the AdamW `exp_avg` tensors `update` saves. The JSON (--json) holds every figure, argv and log.

A stage that fails (a flag this rlkit does not take, out of memory, ...) is reported with its error line, and the
mode's later stages are not run. On a CPU, bf16 autocast is fast only with AVX512-BF16/AMX: bf16 figures of an
AVX2 CPU say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BUILD_VERSION = 2  # bump when the model or tokenizer recipe changes: reruns then rebuild


@dataclass(frozen=True)
class Size:
    """A Qwen2 shape and the workload that goes with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompt_len: int  # characters = tokens (ASCII, one byte a token), of every prompt (SFT and rollout)
    completion_len: int  # tokens of every SFT completion, and rollout's --max-new-tokens
    sft_examples: int
    sft_batch_tokens: int
    prompts: int  # rollout prompts
    n: int  # samples per prompt
    minibatch: int  # update --minibatch-size
    lora_rank: int


SIZES = {
    # Qwen2.5-0.5B's shape and vocabulary: 494,032,768 parameters (136,134,656 of them the tied embedding).
    # The minibatch is 16 rows x 384 tokens: fp32 training keeps ~2.7 MB of activations a token (24 layers of
    # hidden 896 and MLP 4864), ~17 GiB here, so that every mode fits an 80 GiB GPU with room for the logits.
    "0.5b": Size(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, prompt_len=128,
                 completion_len=256, sft_examples=512, sft_batch_tokens=8192, prompts=64, n=8, minibatch=16,
                 lora_rank=16),
    # the same architecture at 6,033,664 parameters, for CI: the whole profile in well under a minute on 2 cores
    "tiny": Size(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, vocab=8192, prompt_len=24,
                 completion_len=16, sft_examples=64, sft_batch_tokens=1024, prompts=4, n=4, minibatch=8,
                 lora_rank=8),
}


@dataclass(frozen=True)
class Mode:
    train: tuple[str, ...]  # sft and update flags
    ref_dtype: str  # freeze-ref --dtype
    score_dtype: str  # score-ref --dtype


MODES = {
    "fp32": Mode(("--dtype", "fp32"), "fp32", "fp32"),
    "bf16": Mode(("--dtype", "bf16"), "bf16", "stored"),
    "bf16-gc": Mode(("--dtype", "bf16", "--gradient-checkpointing"), "bf16", "stored"),
    "lora": Mode(("--dtype", "bf16", "--lora-rank", "{lora_rank}"), "bf16", "stored"),  # rank per --size
}
STAGES = ("sft", "rollout", "score-ref", "update")  # profiled (freeze-ref runs between them, unprofiled)
RLKIT = [sys.executable, "-m", "rlkit"]
FILLER = "<f{}>"  # the padding tokens' text
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


# ------------------------------------------------------------------------------------------------
# The model (built in a child of the runner)


def build_tokenizer(vocab: int):
    """A byte-level tokenizer of `vocab` entries: the specials, one token per byte (Qwen2's byte-level
    pre-tokenization, a BPE without merges, so ASCII text is one token a character), and filler tokens that no text
    encodes to but that decode ('<fN>'). Byte-level because transformers loads the tokenizer of a `qwen2` checkpoint
    as Qwen2Tokenizer, which re-applies Qwen2's byte-level pre-tokenizer whatever tokenizer.json says."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    base = [*SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    table = {t: i for i, t in enumerate(base)}
    table.update({FILLER.format(i): len(base) + i for i in range(vocab - len(base))})
    tok = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", table["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False)


def build_model(out: Path, size_name: str, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = SIZES[size_name]
    tokenizer = build_tokenizer(size.vocab)
    assert len(tokenizer) == size.vocab, (len(tokenizer), size.vocab)
    config = Qwen2Config(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
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
# The runner process (`--runner SPEC`): one forked child builds the model, one per mode runs its stages


def _reset_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_mode(plan_path: Path) -> None:
    """Run the plan's stages in order through `rlkit.cli.main(argv)`, each with its stderr in its own log, and
    write after each one what it measured; stop at the first stage that fails."""
    import resource

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `rlkit` sets before torch loads
    plan = json.loads(plan_path.read_text())
    import torch

    from rlkit import cli

    def cuda_index() -> int:
        return plan["cuda_index"] if plan["cuda_index"] is not None else torch.cuda.current_device()

    done: list[dict] = []
    result = {"stages": done}
    start = time.perf_counter()
    for st in plan["stages"]:
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(cuda_index())
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(cuda_index())
        reset = _reset_hwm()
        sys.stderr.flush()
        saved = os.dup(2)
        with open(st["log"], "w") as log:
            log.write("$ rlkit " + shlex.join(st["argv"]) + "\n")
            log.flush()
            os.dup2(log.fileno(), 2)
            t0 = time.perf_counter()
            try:
                rc = cli.main(list(st["argv"]))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException as e:  # noqa: BLE001 (recorded: the profile reports it and goes on)
                import traceback

                traceback.print_exc()
                rc = f"{type(e).__name__}: {e}"
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize(cuda_index())
            secs = time.perf_counter() - t0
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        rec = {"stage": st["stage"], "exit_code": rc, "seconds": round(secs, 3),
               "peak_rss_kib": _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               "rss_peak_is": "stage (VmHWM reset before it)" if reset else "process so far (ru_maxrss)"}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rec["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(cuda_index())
        done.append(rec)
        plan_path.with_suffix(".result.json").write_text(json.dumps(result, indent=2) + "\n")
        if rc != 0:
            break
    result["wall_s"] = round(time.perf_counter() - start, 1)
    used_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # the stages ran on a GPU
    result["machine"] = machine(torch, cuda_index() if used_cuda else None)
    plan_path.with_suffix(".result.json").write_text(json.dumps(result, indent=2) + "\n")


def runner(spec_path: Path) -> None:
    """Import what the stages import, once; then build the model (if asked) and run each mode, each in a child
    forked from here. Nothing here touches CUDA, so every child initialises it afresh."""
    import traceback

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `rlkit` sets before torch loads
    spec = json.loads(spec_path.read_text())
    import datasets  # noqa: F401 (sft --data reads through it)
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    from rlkit import cli  # noqa: F401
    from rlkit.stages import freeze_ref, rollout, score_ref, sft, update  # noqa: F401

    jobs = ([(build_model, (Path(spec["build"]["dir"]), spec["build"]["size"]))] if spec.get("build") else [])
    jobs += [(run_mode, (Path(p),)) for p in spec["plans"]]
    for fn, args in jobs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 (the parent reports what is missing)
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if fn is build_model and code != 0:
            sys.exit(f"gpu_profile: building the model failed (exit {code})")
        if fn is run_mode:
            args[0].with_suffix(".exit").write_text(f"{code}\n")


def machine(torch, index: int | None) -> dict:
    import platform
    import re

    import transformers

    cpu = "unknown"
    try:
        m = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else platform.processor() or "unknown"
    except OSError:
        pass
    out = {"cpu": cpu, "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cuda_available": torch.cuda.is_available()}
    if index is not None:
        p = torch.cuda.get_device_properties(index)
        out.update(gpu=torch.cuda.get_device_name(index), gpu_index=index, gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                   cuda_version=torch.version.cuda)
    return out


# ------------------------------------------------------------------------------------------------
# The parent: workload files, one child per mode, the figures (no torch here)


def write_workload(d: Path, size: Size, seed: int = 0) -> dict[str, Path]:
    """sft.jsonl (prompt_len + completion_len characters a row), prompts.jsonl (prompt_len characters ending in a
    sum, with its answer), reward.py (the `coin` reward function)."""
    import string

    rng = random.Random(f"gpu-profile|{seed}")
    letters = string.ascii_letters + string.digits + " .,;"

    def prompt() -> tuple[str, str]:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        q = f"\n<{a}+{b}>="
        return "".join(rng.choice(letters) for _ in range(size.prompt_len - len(q))) + q, str(a + b)

    d.mkdir(parents=True, exist_ok=True)
    with open(d / "sft.jsonl", "w") as f:
        for _ in range(size.sft_examples):
            p, ans = prompt()
            text = (ans + " " + "".join(rng.choice(letters) for _ in range(size.completion_len)))[:size.completion_len]
            f.write(json.dumps({"prompt": p, "completion": text}) + "\n")
    with open(d / "prompts.jsonl", "w") as f:
        for _ in range(size.prompts):
            p, ans = prompt()
            f.write(json.dumps({"prompt": p, "answer": ans}) + "\n")
    (d / "reward.py").write_text(
        '"""gpu_profile.py\'s reward: 0 or 1 by a stable hash of the completion, so groups get differing rewards."""\n'
        "import zlib\n\n\n"
        "def coin(completion):\n"
        "    return float(zlib.crc32(completion.encode()) % 2)\n")
    return {"sft": d / "sft.jsonl", "prompts": d / "prompts.jsonl", "reward": d / "reward.py"}


def stage_plan(mode: str, size: Size, model: Path, files: dict[str, Path], runs: Path, device: str) -> list[dict]:
    m = MODES[mode]
    train = [f.format(lora_rank=size.lora_rank) for f in m.train]
    d = runs / mode
    sft, ref, roll, scored, upd = d / "sft", d / "ref", d / "rollouts.arrow", d / "scored.arrow", d / "update"
    max_len = size.prompt_len + size.completion_len + 8
    argvs = [
        ("sft", ["sft", "--model", str(model), "--data", str(files["sft"]), "--epochs", "1", "--lr", "1e-5",
                 "--batch-tokens", str(size.sft_batch_tokens), "--max-length", str(max_len), "--seed", "0",
                 "--device", device, *train, "--out", str(sft)]),
        ("freeze-ref", ["freeze-ref", "--policy", str(sft), "--out", str(ref), "--dtype", m.ref_dtype]),
        ("rollout", ["rollout", "--policy", str(sft), "--engine", "hf", "--prompts", str(files["prompts"]),
                     "--n", str(size.n), "--max-new-tokens", str(size.completion_len), "--seed", "0",
                     "--reward-fn", f"coin={files['reward']}:coin", "--device", device, "--out", str(roll)]),
        ("score-ref", ["score-ref", "--ref", str(ref), "--in", str(roll), "--dtype", m.score_dtype,
                       "--device", device, "--out", str(scored)]),
        ("update", ["update", "--policy", str(sft), "--in", str(scored), "--epochs", "1",
                    "--minibatch-size", str(size.minibatch), "--seed", "0", "--device", device, *train,
                    "--out", str(upd)]),
    ]
    return [{"stage": s, "argv": a, "log": str(d / "logs" / f"{s}.log"),
             "out": str({"sft": sft, "freeze-ref": ref, "rollout": roll, "score-ref": scored, "update": upd}[s])}
            for s, a in argvs]


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def trainable_params(update_out: Path) -> int | None:
    """Elements of the AdamW first moments `update` saved: the parameters it trains."""
    path = update_out / "trainer" / "optimizer.safetensors"
    if not path.is_file():
        return None
    count = 0
    for k, t in safetensors_header(path).items():
        if k.endswith("/exp_avg"):
            n = 1
            for s in t["shape"]:
                n *= s
            count += n
    return count


def error_line(log: Path) -> str:
    """The log's `rlkit: ...` error line (or its last line)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    errs = [ln for ln in lines if ln.startswith("rlkit: ")]
    return (errs or lines or ["(no output)"])[-1]


def device_line(log: Path, stage: str) -> str | None:
    """The stage's `STAGE: device ...` line, when it printed one."""
    if not log.is_file():
        return None
    want = f"{stage}: device "
    return next((ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.startswith(want)), None)


def stage_figures(st: dict, rec: dict, on_gpu: bool) -> dict:
    """The profile's figures of one finished stage from its outputs: tokens, tokens/s, peak memory."""
    from rlkit.io import streams

    out, name = Path(st["out"]), st["stage"]
    row: dict = {"seconds": rec["seconds"], "peak_rss_mib": round(rec["peak_rss_kib"] / 1024, 1),
                 "rss_peak_is": rec["rss_peak_is"], "device_line": device_line(Path(st["log"]), name)}
    measured = rec.get("cuda_peak_bytes")
    row["gpu_mem_peak_gib"] = round(measured / 2**30, 3) if measured is not None else None
    row["gpu_mem_from"] = "the stage's allocator peak (torch.cuda.max_memory_allocated)" if measured is not None else None
    if name in ("sft", "update"):
        man = json.loads((out / "rlkit.json").read_text())
        metrics = man.get("metrics") or {}
        tokens = metrics.get("tokens")  # sft's; update logs the rate alone: its input's tokens, once an epoch
        if tokens is None and "--in" in st["argv"]:
            table, _ = streams.read_table(Path(st["argv"][st["argv"].index("--in") + 1]), ["rollouts", "scored"])
            tokens = sum(len(p) + len(c) for p, c in zip(table.column("prompt_ids").to_pylist(),
                                                         table.column("completion_ids").to_pylist(), strict=True))
        row.update(tokens=tokens, tokens_per_s=metrics.get("tokens_per_s"),
                   train_seconds=metrics.get("train_seconds"), manifest_device=man.get("device"),
                   manifest_gpu=man.get("gpu"), train_config=(man.get("config") or {}).get("train"))
        if metrics.get("gpu_mem_peak_gib") is not None:
            row.update(gpu_mem_peak_gib=metrics["gpu_mem_peak_gib"], gpu_mem_from="the stage's gpu_mem_peak_gib metric")
        elif on_gpu:
            row["gpu_mem_from"] = ((row["gpu_mem_from"] or "nothing") + "; its metrics have no gpu_mem_peak_gib")
        if name == "update":
            row.update(trainable_params=trainable_params(out), loss=metrics.get("loss"), grad_norm=metrics.get("grad_norm"),
                       old_logprobs=metrics.get("old_logprobs"))
    elif name in ("rollout", "score-ref"):
        table, reader = streams.read_table(out, ["rollouts", "scored"])
        comp = sum(len(c) for c in table.column("completion_ids").to_pylist())
        prompt = sum(len(p) for p in table.column("prompt_ids").to_pylist())
        tokens = comp if name == "rollout" else comp + prompt
        row.update(rows=table.num_rows, tokens=tokens, tokens_per_s=round(tokens / rec["seconds"], 1),
                   manifest_device=(reader.manifest or {}).get("device"))
        if name == "rollout":
            row["completion_tokens_mean"] = round(comp / max(1, table.num_rows), 1)
            rewards = table.column("reward/coin").to_pylist() if "reward/coin" in table.column_names else []
            row["reward_coin_mean"] = round(sum(rewards) / len(rewards), 3) if rewards else None
    return row


def run_modes(a, work: Path) -> dict:
    size = SIZES[a.size]
    root = work / a.size
    model = root / "model"
    stamp = build_stamp(a.size, 0)
    built = json.loads((model / "bench-build.json").read_text()) if (model / "bench-build.json").is_file() else {}
    build = None
    if {k: built.get(k) for k in stamp} != stamp:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        build = {"dir": str(model), "size": a.size}
    files = write_workload(root / "data", size)
    runs = root / "runs"
    cuda_index = int(a.device.split(":")[1]) if a.device.startswith("cuda:") else None
    plans = {}
    for mode in a.modes:
        d = runs / mode
        shutil.rmtree(d, ignore_errors=True)  # else each stage would skip its up-to-date --out
        (d / "logs").mkdir(parents=True)
        plans[mode] = stage_plan(mode, size, model, files, runs, a.device)
        (d / "plan.json").write_text(json.dumps({"stages": plans[mode], "cuda_index": cuda_index}, indent=2) + "\n")
    spec = root / "runner.json"
    spec.write_text(json.dumps({"build": build, "plans": [str(runs / m / "plan.json") for m in a.modes]}, indent=2))
    t0 = time.monotonic()
    with open(root / "runner.log", "w") as log:
        r = subprocess.run([sys.executable, __file__, "--runner", str(spec)], stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "RLKIT_DEBUG": "0"})
    wall = round(time.monotonic() - t0, 1)
    if not (model / "bench-build.json").is_file():
        sys.exit(f"gpu_profile: the runner exited {r.returncode} without a model: {error_line(root / 'runner.log')} "
                 f"(see {root / 'runner.log'})")
    built = json.loads((model / "bench-build.json").read_text())
    modes, machine_info = [], None
    for mode in a.modes:
        d, plan = runs / mode, plans[mode]
        res_path, exit_path = d / "plan.result.json", d / "plan.exit"
        res = json.loads(res_path.read_text()) if res_path.is_file() else {"stages": []}
        child = exit_path.read_text().strip() if exit_path.is_file() else "never started"
        machine_info = res.get("machine") or machine_info
        on_gpu = bool((res.get("machine") or {}).get("gpu"))
        row: dict = {"mode": mode, "flags": " ".join(f.format(lora_rank=size.lora_rank) for f in MODES[mode].train),
                     "wall_s": res.get("wall_s"), "stages": {}, "status": "ok"}
        recs = {r["stage"]: r for r in res["stages"]}
        for st in plan:
            name, rec = st["stage"], recs.get(st["stage"])
            cmd = "rlkit " + shlex.join(st["argv"])
            if rec is None:
                why = ("not run: an earlier stage failed" if row["status"] != "ok" else
                       f"not run: the mode's process exited {child} (see {root / 'runner.log'})")
                row["stages"][name] = {"status": why, "command": cmd}
                row["status"] = row["status"] if row["status"] != "ok" else f"{name}: {why}"
                continue
            if rec["exit_code"] != 0:
                line = error_line(Path(st["log"]))
                row["stages"][name] = {"status": f"failed (exit {rec['exit_code']}): {line}", "command": cmd,
                                       "log": st["log"], "seconds": rec["seconds"]}
                row["status"] = f"{name} failed (exit {rec['exit_code']}): {line}"
                continue
            if name in STAGES:
                row["stages"][name] = {"status": "ok", "command": cmd, "log": st["log"],
                                       **stage_figures(st, rec, on_gpu)}
        row["trainable_params"] = row["stages"].get("update", {}).get("trainable_params")
        modes.append(row)
    return {"size": a.size, "device_requested": a.device, "machine": machine_info or {},
            "model": {"dir": str(model), "parameters": built["parameters"], "built": build is not None, **asdict(size)},
            "workload": {"sft_examples": size.sft_examples, "sft_tokens_per_example": size.prompt_len + size.completion_len,
                         "prompts": size.prompts, "n": size.n, "rollout_rows": size.prompts * size.n,
                         "prompt_tokens": size.prompt_len + 1, "max_new_tokens": size.completion_len,
                         "update_minibatch": size.minibatch, "update_epochs": 1},
            "memory": "gpu" if (machine_info or {}).get("gpu") else "rss",
            "runner_wall_s": wall, "modes": modes, "workdir": str(work)}


def follow_step(a, res: dict, work: Path) -> dict | None:
    """`--follow-steps N`: the fleet's step on the first mode that finished, as one pipe
    `rollout --follow D --engine hf | update --follow --out D` at --max-lag 0 for N steps from that mode's sft: what a
    step publishes (the weights the workers load: bf16 on a GPU) and in how many seconds, the snapshot (fp32 weights
    and AdamW, `--snapshot-every 1` on a stream) and the worker's in-place reload."""
    import re

    done = next((r for r in res["modes"] if r["status"] == "ok"), None)
    if not a.follow_steps or done is None:
        return None
    size, mode = SIZES[a.size], done["mode"]
    root = work / a.size
    runs, d = root / "runs" / mode, root / "runs" / f"{mode}-follow"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    files = {"prompts": root / "data" / "prompts.jsonl", "reward": root / "data" / "reward.py"}
    train = [f.format(lora_rank=size.lora_rank) for f in MODES[mode].train]
    cmd = shlex.join(RLKIT)
    roll = shlex.join(["rollout", "--follow", str(d / "ck"), "--policy", str(runs / "sft"), "--engine", "hf",
                       "--prompts", str(files["prompts"]), "--n", str(size.n), "--batch-prompts", str(size.prompts),
                       "--max-new-tokens", str(size.completion_len), "--seed", "0", "--reward-fn",
                       f"coin={files['reward']}:coin", "--device", a.device, "--max-lag", "0",
                       "--max-steps", str(a.follow_steps)])
    upd = shlex.join(["update", "--follow", "--policy", str(runs / "sft"), "--out", str(d / "ck"), "--epochs", "1",
                      "--minibatch-size", str(size.minibatch), "--seed", "0", "--beta", "0", "--device", a.device,
                      "--max-lag", "0", "--max-steps", str(a.follow_steps), *train])
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", f"set -o pipefail\n{cmd} {roll} | {cmd} {upd}"], capture_output=True, text=True,
                       env={**os.environ, "RLKIT_DEBUG": "0"})
    (d / "follow.log").write_text(r.stderr)
    out = {"mode": mode, "steps": a.follow_steps, "wall_s": round(time.monotonic() - t0, 1), "log": str(d / "follow.log")}
    if r.returncode != 0:
        return {**out, "status": f"failed (exit {r.returncode}): {error_line(d / 'follow.log')}"}
    pub = re.findall(r"in ([\d.]+)s \(([\d.]+) MiB (\w+) weights; snapshot in ([\d.]+)s, ([\d.]+) MiB", r.stderr)
    rel = re.findall(r"weight reloads, median ([\d.]+)s", r.stderr)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {**out, "status": "ok", "publish_s": med([float(p[0]) for p in pub]),
            "publish_mib": float(pub[0][1]) if pub else None, "publish_dtype": pub[0][2] if pub else None,
            "snapshot_s": med([float(p[3]) for p in pub]), "snapshot_mib": float(pub[0][4]) if pub else None,
            "reload_s": float(rel[0]) if rel else None}


# ------------------------------------------------------------------------------------------------
# The report


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def ratio(v, base) -> str:
    ok = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (v, base))
    return f"{v / base:.2f}x" if ok and base else "-"


def report(res: dict) -> None:
    m, w, mach = res["model"], res["workload"], res["machine"]
    gpu = res["memory"] == "gpu"
    print(f"model: Qwen2ForCausalLM from a config, random init (seed 0), {m['parameters']:,} parameters (hidden "
          f"{m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV, MLP {m['intermediate']}, "
          f"vocabulary {m['vocab']:,}, tied embeddings); {m['dir']}")
    print(f"workload: sft {w['sft_examples']} examples of {m['prompt_len']} + {m['completion_len']} tokens, 1 epoch; rollout "
          f"(hf engine, fp32) {w['prompts']} prompts x {w['n']} samples x {w['max_new_tokens']} new tokens after "
          f"{w['prompt_tokens']}-token prompts; score-ref those {w['rollout_rows']} rows; update 1 epoch, "
          f"minibatch {w['update_minibatch']}")
    if gpu:
        print(f"device: {mach.get('gpu')} (cuda:{mach.get('gpu_index')}, {mach.get('gpu_memory_gib')} GiB, "
              f"{mach.get('gpu_count')} visible, bf16 {mach.get('bf16')}); torch {mach.get('torch')} (CUDA "
              f"{mach.get('cuda_version')}), transformers {mach.get('transformers')}; --device {res['device_requested']}")
        mem_head, mem_key, mem_spec = "peak GPU GiB", "gpu_mem_peak_gib", ".2f"
        print("memory: peak GPU memory allocated by torch (sft, update: their gpu_mem_peak_gib metric; rollout, "
              "score-ref: torch.cuda.max_memory_allocated over the stage)")
    else:
        print(f"device: CPU ({mach.get('cpu', 'unknown')}, {mach.get('usable_cores')} cores), no GPU; torch "
              f"{mach.get('torch')}, transformers {mach.get('transformers')}; --device {res['device_requested']}")
        mem_head, mem_key, mem_spec = "peak RSS MiB", "peak_rss_mib", ",.0f"
        print("memory: NO GPU, so peak RSS instead of GPU memory: the process's peak resident memory over each stage "
              "(VmHWM reset before it; Python, torch and the model included)")
    base = next((r for r in res["modes"] if r["mode"] == "fp32"), None)
    head = (f"{'mode':8} {'stage':9} {'tokens':>9} {'tokens/s':>10} {'x fp32':>6} {mem_head:>12} {'x fp32':>6} "
            f"{'seconds':>7}  status")
    print(head)
    print("-" * len(head))
    for r in res["modes"]:
        for i, name in enumerate(STAGES):
            s = r["stages"].get(name, {"status": "not run"})
            b = (base or {}).get("stages", {}).get(name, {})
            label = r["mode"] if i == 0 else ""
            print(f"{label:8} {name:9} {fmt(s.get('tokens'), ','):>9} {fmt(s.get('tokens_per_s'), ',.1f'):>10} "
                  f"{ratio(s.get('tokens_per_s'), b.get('tokens_per_s')):>6} {fmt(s.get(mem_key), mem_spec):>12} "
                  f"{ratio(s.get(mem_key), b.get(mem_key)):>6} {fmt(s.get('seconds'), '.1f'):>7}  {s['status']}")
        print(f"{'':8} trainable parameters (update's AdamW state): {fmt(r.get('trainable_params'), ',')}; "
              f"flags: {r['flags']}; mode wall {fmt(r.get('wall_s'), '.1f')} s"
              + ("" if r["status"] == "ok" else f"; NOT FINISHED: {r['status']}"))
    print("tokens/s: sft, update: their tokens_per_s metric (the training loop; update's includes the pi_old "
          "recompute of --dtype bf16); rollout: completion tokens / stage seconds; score-ref: prompt + completion "
          "tokens / stage seconds (both include loading the model). Every stage ran through `rlkit` argv with "
          f"--device {res['device_requested']}; the commands are in the JSON (--json).")
    lines = sorted({s["device_line"] for r in res["modes"] for s in r["stages"].values() if s.get("device_line")})
    if lines:
        print("device lines the stages printed: " + "; ".join(lines))
    f = res.get("follow")
    if f is not None:
        print(f"follow ({f['mode']}, {f['steps']} steps, rollout --follow --engine hf | update --follow, --max-lag 0): "
              + (f"a step publishes {fmt(f['publish_mib'], '.1f')} MiB of {f['publish_dtype']} weights in "
                 f"{fmt(f['publish_s'], '.3f')} s; its snapshot {fmt(f['snapshot_mib'], '.1f')} MiB in "
                 f"{fmt(f['snapshot_s'], '.3f')} s; the worker reloads in {fmt(f['reload_s'], '.3f')} s (medians); "
                 f"wall {f['wall_s']} s" if f["status"] == "ok" else f"NOT FINISHED: {f['status']}"))
    print(f"whole run: {res['runner_wall_s']} s (the model {'built' if res['model']['built'] else 'reused'}); "
          f"work folder {res['workdir']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--device", default="auto", help="Every stage's --device (default auto: the GPU when there is one).")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--workdir", type=Path, help="Keep the model, data and every stage's output here (the model is "
                    "reused by a rerun); default: a temporary folder, removed at the end.")
    ap.add_argument("--json", type=Path, help="Write the results as JSON to this file.")
    ap.add_argument("--follow-steps", type=int, default=0, help="Then N steps of the fleet's pipe (rollout --follow | "
                    "update --follow) from the first mode's sft: publish, snapshot and reload seconds (default 0: none).")
    ap.add_argument("--runner", type=Path, help=argparse.SUPPRESS)  # internal: the process that forks the modes
    a = ap.parse_args()
    if a.runner:
        runner(a.runner)
        return
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="gpu-profile-")
    work = (a.workdir or Path(tmp.name)).resolve()
    try:
        res = run_modes(a, work)
        res["follow"] = follow_step(a, res, work)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    failed = [r["mode"] for r in res["modes"] if r["status"] != "ok"] + (
        ["follow"] if (res["follow"] or {}).get("status", "ok") != "ok" else [])
    if failed:
        sys.exit(f"gpu_profile: {len(failed)} mode(s) did not finish: {', '.join(failed)} (their error lines are above)")


if __name__ == "__main__":
    main()
