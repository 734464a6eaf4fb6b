"""The planner's estimates: the model's shapes (`model_config`), the traces run in a child process
(`run_traces`), a stage's peak per GPU (`plan_training`, `plan_score_ref`, `plan_vllm`), what makes it fit
(`suggest_training`), and the start-up checks (`preflight*`). The package docstring says how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError

GIB = 2**30
# What a GPU holds beside the allocator's tensors: the CUDA context and kernels (~0.5-1 GiB on an H100) and the
# caching allocator's fragmentation; a plan fits when its peak plus this reserve is within the GPU's memory.
CONTEXT_GIB = 1.0
FRAGMENTATION = 0.05  # of the peak
MODELS_DIR = Path(__file__).parent / "models"  # shipped config.json of well-known models (no weights)


@dataclass(frozen=True)
class Hardware:
    gpus: int = 1
    gpu_memory_gib: float = 80.0


@dataclass(frozen=True)
class Work:
    """The shape of the work: each row `prompt` + `completion` tokens; `rows` of one optimizer step (update: the
    minibatch; train-rm: pairs), `batch_rows` rows held at once (update: the whole input batch)."""

    prompt: int
    completion: int
    rows: int
    batch_rows: int | None = None
    origin: dict[str, str] = field(default_factory=dict, compare=False)  # where each figure came from (rlkit plan)


@dataclass
class Estimate:
    """One process's memory on one GPU (bytes), and whether it fits."""

    stage: str
    parts: dict[str, int]  # what the process holds at its peak: weights, gradients, optimizer, activations, kv_cache,
    peak: int  # batch; the parts sum to it
    gpu_memory: int
    gpus: int
    method: str  # "traced" (fake tensors) or "vLLM's accounting"
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # the flags the plan is for
    suggestion: dict[str, Any] | None = None  # --suggest: flags that make it fit, and that plan's peak
    logits: int = 0  # the logits' (and their gradient's) own peak: within activations, at its own moment

    @property
    def reserve(self) -> int:
        return int(CONTEXT_GIB * GIB + FRAGMENTATION * self.peak)

    @property
    def fits(self) -> bool:
        return self.peak + self.reserve <= self.gpu_memory

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(fits=self.fits, peak_gib=round(self.peak / GIB, 2), gpu_memory_gib=round(self.gpu_memory / GIB, 2),
                 reserve_gib=round(self.reserve / GIB, 2),
                 parts_gib={k: round(v / GIB, 2) for k, v in self.parts.items()}, logits_gib=round(self.logits / GIB, 2))
        return d

    def fits_line(self) -> str:
        return (f"fits: {'yes' if self.fits else 'no'} (peak {self.peak / GIB:.1f} GiB of {self.gpu_memory / GIB:.0f} GiB"
                f" per GPU, with {self.reserve / GIB:.1f} GiB reserved for the CUDA context and fragmentation)")


# -- what the stages choose on a GPU, for the trace


def scoring_dtype(dtype: str) -> str:
    """torch dtype name a forward-only scorer runs in for score-ref's --dtype on a GPU (auto: bf16)."""
    return {"fp32": "float32", "stored": "float32"}.get(dtype, "bfloat16")


def on_gpu_hooks() -> None:
    """In the tracing process (a CPU): the training code's GPU-only choices made as on a GPU (FSDP2's bf16
    mixed-precision policy, LoRA's frozen base in bf16), through the functions the code asks. AdamW is traced
    with torch's foreach implementation, whose temporaries are at least the fused kernel's (an upper bound)."""
    from rlkit import training

    if hasattr(training, "fsdp_param_dtype"):
        original = training.fsdp_param_dtype
        training.fsdp_param_dtype = lambda dtype, device_type: original(dtype, "cuda")
    import torch

    from rlkit.training import lora

    original_hold = lora.hold_base
    lora.hold_base = lambda model, dtype, device: original_hold(model, dtype, torch.device("cuda"))


# -- the model


def model_config(path: str | Path, flag: str = "--policy", tiny: Any = None) -> dict[str, Any]:
    """config.json of a model directory (a checkpoint, or just its config), or of a shipped model by name
    (`qwen2.5-7b`); sft's embedded 'tiny' model (`tiny`: its TinyConfig) as sft builds it. No weight is read."""
    if str(path) == "tiny" and tiny is not None:
        from rlkit.tiny import build_tokenizer

        return {"model_type": "llama", "vocab_size": len(build_tokenizer()), "hidden_size": tiny.hidden,
                "intermediate_size": tiny.intermediate, "num_hidden_layers": tiny.layers,
                "num_attention_heads": tiny.heads, "num_key_value_heads": tiny.heads,
                "max_position_embeddings": tiny.max_positions, "tie_word_embeddings": True}
    p = Path(path)
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():  # a LoRA checkpoint: its base
        try:
            base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            base = None
        if base:
            return model_config(base, flag)
    shipped = MODELS_DIR / f"{str(path).lower()}.json"
    if not p.exists() and shipped.is_file():
        return json.loads(shipped.read_text())
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        names = ", ".join(sorted(x.stem for x in MODELS_DIR.glob("*.json")))
        raise RlkitError(f"{flag} {path}: no config.json there; expected a model directory (weights not needed) "
                         f"or one of the shipped shapes: {names}")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise RlkitError(f"{flag} {path}: config.json is not readable JSON ({e})") from e
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key not in cfg:
            raise RlkitError(f"{flag} {path}: config.json has no {key!r}; the planner needs a decoder-only transformer's "
                             "config (Llama, Qwen2, Mistral, ...)")
    return cfg


def parameters(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama-family decoder from its config (for vLLM's weights; the traces count their own)."""
    from rlkit.engines import memory

    return memory.parameters(cfg)


# -- tracing (a child process)


def run_traces(specs: list[dict]) -> list[dict]:
    """Each spec (`rlkit.planner.trace.Spec` fields) measured in one child process."""
    if not specs:
        return []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env.pop("LOCAL_RANK", None)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", "0"
    r = subprocess.run([sys.executable, "-m", "rlkit.planner.trace"], input=json.dumps(specs), capture_output=True,
                       text=True, env=env)
    lines = [json.loads(x.split(" ", 1)[1]) for x in r.stdout.splitlines() if x.startswith("@@plan ")]
    if r.returncode or len(lines) != len(specs):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RlkitError(f"plan: the memory trace failed (exit {r.returncode}): {tail}")
    for res in lines:
        if "error" in res:
            raise RlkitError(f"plan: the memory trace failed: {res['error']}")
    return lines


def estimate(stage: str, measured: dict, hw: Hardware, settings: dict, extra: dict[str, int] | None = None,
              notes: list[str] | None = None) -> Estimate:
    """A traced step -> its estimate: the steady peak, max(passes + AdamW's moments, the optimizer step), and its
    parts: what the rank holds at that moment (the parts sum to the peak)."""
    passes, step, opt = measured["passes"], measured["step"], measured["optimizer"]
    parts = dict(passes)
    if step is not None:
        with_moments = {**passes, "optimizer": passes["optimizer"] + opt}
        parts = with_moments if sum(with_moments.values()) >= sum(step.values()) else dict(step)
    for k, v in (extra or {}).items():
        parts[k] = parts.get(k, 0) + v
    return Estimate(stage, parts, sum(parts.values()), int(hw.gpu_memory_gib * GIB), hw.gpus, "traced",
                    list(notes or []), settings, logits=measured["logits"])


# -- the stages


def train_spec(stage: str, config: dict, work: Work, hw: Hardware, train: Any, **kw) -> dict:
    """The trace spec of a training stage's step for TrainOptions `train` on a GPU (--dtype auto: bf16; with no
    micro-batch flag: the GPU's default token budget)."""
    from rlkit.training import GPU_MICRO_BATCH_TOKENS

    dtype = "bf16" if train.dtype == "auto" else train.dtype
    size, tokens = train.micro_batch_size, train.micro_batch_tokens
    if size is None and tokens is None:
        tokens = GPU_MICRO_BATCH_TOKENS
    t = {"dtype": dtype, "gradient_checkpointing": train.gradient_checkpointing, "micro_batch_size": size,
         "micro_batch_tokens": tokens, "packing": train.packing,
         "lora": asdict(train.lora) if train.lora is not None else None}
    return {"stage": stage, "config": config, "rows": work.rows, "prompt": work.prompt, "completion": work.completion,
            "world": hw.gpus, "train": t, **kw}


def settings_of(train: Any, **more) -> dict[str, Any]:
    s = {"dtype": train.dtype, "gradient_checkpointing": train.gradient_checkpointing,
         "micro_batch_size": train.micro_batch_size, "micro_batch_tokens": train.micro_batch_tokens,
         "lora_rank": train.lora.rank if train.lora is not None else None}
    return {**s, **more}


def plan_training(stage: str, config: dict, work: Work, hw: Hardware, train: Any, *, algo: str = "grpo",
                  beta: float = 0.0) -> Estimate:
    return plan_trainings(stage, config, work, [(train, hw)], algo=algo, beta=beta)[0]


def plan_trainings(stage: str, config: dict, work: Work, cases: list[tuple[Any, Hardware]], *, algo: str = "grpo",
                   beta: float = 0.0) -> list[Estimate]:
    """Each (TrainOptions, Hardware) case of a training stage's step, traced in one child process."""
    kw = {"algo": algo, "beta": beta} if stage == "update" else {}
    measured = run_traces([train_spec(stage, config, work, hw, train, **kw) for train, hw in cases])
    out = []
    for (train, hw), m in zip(cases, measured, strict=True):
        extra, notes = {}, []
        if stage == "update":
            # the whole input batch moves to the GPU once (token ids, masks, pi_old, pi_ref): per row, measured
            extra["batch"] = m["host_bytes"] * (work.batch_rows or work.rows)
            if algo == "ppo":
                notes.append("ppo's critic (a second model with its own AdamW) is not in this plan")
        if train.lora is None and hw.gpus == 1:
            notes.append("full fine-tuning keeps fp32 weights, gradients and two AdamW moments: 16 bytes a parameter")
        dtype = "bf16" if train.dtype == "auto" else train.dtype
        out.append(estimate(stage, m, hw, settings_of(replace(train, dtype=dtype), gpus=hw.gpus, rows=work.rows),
                             extra, notes))
    return out


def plan_score_ref(config: dict, work: Work, hw: Hardware, dtype: str, batch_tokens: int, packing: bool,
                   reward_models: list[dict] | None = None) -> Estimate:
    """score-ref: the reference (and each reward model) held for the whole run, one forward batch of
    --batch-tokens at a time."""
    rows = max(1, batch_tokens // max(1, work.prompt + work.completion))
    base = {"stage": "score-ref", "config": config, "rows": rows, "prompt": work.prompt, "completion": work.completion,
            "train": {"dtype": dtype, "packing": packing}}
    specs = [base] + [{**base, "config": rm, "reward_model": True} for rm in reward_models or []]
    got = run_traces(specs)
    parts = {"weights": sum(g["passes"]["weights"] for g in got),
             "activations": max(g["passes"]["activations"] for g in got)}
    return Estimate("score-ref", parts, sum(parts.values()), int(hw.gpu_memory_gib * GIB), 1, "traced", [],
                    {"dtype": dtype, "batch_tokens": batch_tokens, "rows_per_batch": rows},
                    logits=max(g["logits"] for g in got))


def plan_vllm(config: dict, work: Work, hw: Hardware, *, dtype: str = "bf16", utilization: float = 0.9,
              n: int = 1, prompts: int = 1, max_num_seqs: int = 256, max_batched_tokens: int | None = None,
              profile: bool = True) -> Estimate:
    """rollout --engine vllm, by vLLM's own accounting (`rlkit.engines.memory.vllm_accounting`; the KV cache cannot
    be traced): its share of the GPU is the weights, the profiling run's activations and the KV cache. It cannot
    start unless the cache holds one whole sequence (prompt + completion); then the plan's peak is the weights,
    activations and that one sequence's cache, more than the share."""
    from rlkit.engines import memory

    gpu = int(hw.gpu_memory_gib * GIB)
    seq = work.prompt + work.completion
    acc = memory.vllm_accounting(config, gpu, utilization, seq, dtype=dtype, tp=hw.gpus, max_num_seqs=max_num_seqs,
                                 max_batched_tokens=max_batched_tokens, profile=profile)
    per_token, cache_tokens = acc["per_token"], acc["kv_cache_tokens"]
    parts = {"weights": acc["weights"], "activations": acc["activations"], "kv_cache": acc["kv_cache"]}
    notes = ["vLLM's KV cache is not traced: vLLM takes --gpu-memory-utilization of the GPU and gives the cache what "
             "its weights and profiled activations leave (vLLM's documented accounting)",
             f"KV cache: {cache_tokens:,} tokens ({per_token:,} bytes each): {cache_tokens // max(1, seq):,} sequences of "
             f"{seq:,} tokens at once ({n * prompts:,} asked for per batch)"]
    if not acc["starts"]:
        notes.append(f"the KV cache holds {cache_tokens:,} tokens, less than one sequence ({seq:,}): vLLM refuses to "
                     "start")
        parts["kv_cache"] = seq * per_token
    peak = sum(parts.values()) if not acc["starts"] else acc["share"]
    if acc["starts"]:
        parts["kv_cache"] = acc["share"] - acc["weights"] - acc["activations"]  # the parts are the share
    est = Estimate("rollout", parts, peak, gpu, hw.gpus, "vLLM's accounting", notes,
                   {"dtype": dtype, "gpu_memory_utilization": utilization, "kv_cache_tokens": cache_tokens},
                   logits=max_num_seqs * config["vocab_size"] * 4 if profile else 0)
    return est


# -- suggestions


MAX_GPUS = 1024  # the largest world a plan takes (--gpus), and the most GPUs --suggest goes to is SUGGEST_GPUS
SUGGEST_GPUS = 64


def flags_text(flags: dict[str, Any], gpus: int | None = None) -> str:
    text = " ".join(k if v is True else f"{k} {v}" for k, v in flags.items())
    return text + (f" on {gpus} GPUs" if gpus is not None else "")


def suggest_training(stage: str, config: dict, work: Work, hw: Hardware, train: Any, *, max_gpus: int = SUGGEST_GPUS,
                     **kw) -> dict[str, Any] | None:
    """What makes a step fit, in two child processes at most. First the least memory this search reaches (one
    micro-batch row, gradient checkpointing, LoRA rank 64 for a full fine-tune, on the most GPUs the step's rows
    allow, up to `max_gpus`): when even that does not fit, nothing does, and the answer says so (`nothing`:
    True, with those flags and that peak). Otherwise the first of these that fits: smaller micro-batches; the
    same with gradient checkpointing; + LoRA rank 64 (full fine-tuning only); then 2, 4, ... times the GPUs.
    -> {"flags", "gpus", "peak_gib", "nothing"}."""
    from rlkit.training.lora import LoraOptions

    most = hw.gpus
    while most * 2 <= min(max_gpus, work.rows):
        most *= 2
    least_flags = {"--micro-batch-size": 1, "--gradient-checkpointing": True}
    least = replace(train, gradient_checkpointing=True, micro_batch_size=1, micro_batch_tokens=None)
    if train.lora is None:
        least_flags["--lora-rank"] = 64
        least = replace(least, lora=LoraOptions(rank=64))
    floor = plan_trainings(stage, config, work, [(least, replace(hw, gpus=most))], **kw)[0]
    if not floor.fits:
        return {"flags": least_flags, "peak_gib": round(floor.peak / GIB, 2), "gpus": most, "nothing": True}
    per_rank = max(1, work.rows // hw.gpus)
    sizes = [s for s in (8, 4, 2, 1) if s <= per_rank and (train.micro_batch_size is None or s < train.micro_batch_size)]
    candidates: list[tuple[dict, Any, Hardware]] = []
    for gc in ([False, True] if not train.gradient_checkpointing else [True]):
        for s in sizes or [1]:
            t = replace(train, gradient_checkpointing=gc, micro_batch_size=s, micro_batch_tokens=None)
            candidates.append(({"--micro-batch-size": s, **({"--gradient-checkpointing": True} if gc else {})}, t, hw))
    if train.lora is None:
        candidates.append((least_flags, replace(least, lora=LoraOptions(rank=64)), hw))
    g = hw.gpus * 2
    while g <= most:
        t = replace(train, gradient_checkpointing=True, micro_batch_size=1, micro_batch_tokens=None)
        candidates.append(({"--micro-batch-size": 1, "--gradient-checkpointing": True}, t, replace(hw, gpus=g)))
        g *= 2
    ests = plan_trainings(stage, config, work, [(t, h) for _, t, h in candidates], **kw)
    for (flags, _, h), est in zip(candidates, ests, strict=True):
        if est.fits:
            return {"flags": flags, "peak_gib": round(est.peak / GIB, 2), "gpus": h.gpus, "nothing": False}
    return {"flags": least_flags, "peak_gib": round(floor.peak / GIB, 2), "gpus": most, "nothing": False}


# -- the check each stage runs when it starts on a GPU


def refuse(est: Estimate, stage: str, free: bool = False) -> None:
    """Raise the out-of-memory refusal (exit 71) when `est` does not fit (`free`: its memory is what the GPU has
    free, not its size), naming the plan's peak, the GPU's memory and what makes it fit (`est.suggestion`)."""
    if est.fits:
        return
    from rlkit.devices import OutOfMemory

    fix = ""
    if est.suggestion:
        sug = est.suggestion
        flags = flags_text(sug["flags"], sug["gpus"] if sug.get("gpus", est.gpus) != est.gpus else None)
        peak = sug.get("peak_gib")
        if sug.get("nothing"):
            fix = f"; nothing fits, even with {flags} (peak {peak:.1f} GiB)"
        else:
            fix = f"; it fits with {flags} (peak {peak:.1f} GiB)" if peak is not None else f"; lower it with {flags}"
    raise OutOfMemory(f"{stage}: this run needs about {est.peak / GIB:.1f} GiB per GPU (the memory plan's peak), more "
                      f"than the GPU's {est.gpu_memory / GIB:.1f} GiB{' free' if free else ''}{fix}; `rlkit plan "
                      f"{stage} ...` shows the parts; --no-plan skips this check; nothing was written")


def preflight(stage: str, model: str | Path | dict, work: Work, train: Any, device, *, flag: str = "--policy",
              **kw) -> Estimate | None:
    """The check a training stage runs when it starts on a GPU, from its model's config before any weight is
    read: the plan of its step on this GPU (the torchrun world's GPUs); a plan that does not fit is refused
    (`refuse`: exit 71, naming the flags that make it fit). Elsewhere (the CPU): nothing, None."""
    if getattr(device, "type", None) != "cuda":
        return None
    config = model if isinstance(model, dict) else model_config(model, flag)
    hw = Hardware(max(1, int(os.environ.get("WORLD_SIZE", "1"))), gpu_memory_gib(device))

    est = plan_training(stage, config, work, hw, train, **kw)
    if not est.fits:
        est.suggestion = suggest_training(stage, config, work, hw, train, **kw)
        refuse(est, stage)
    return est


def preflight_scoring(ref: Path | None, rms: list[Path], dtype: str, batch_tokens: int, packing: bool, device,
                      free: int | None = None) -> Estimate | None:
    """score-ref's check when its models load on a GPU: the reference's and reward models' weights plus one forward
    batch of --batch-tokens, against the memory the GPU has free (rollout's vLLM may hold the rest)."""
    if getattr(device, "type", None) != "cuda":
        return None
    if free is None:
        import torch

        free = torch.cuda.mem_get_info(device)[0]
    half = max(1, batch_tokens // 2)
    config = model_config(ref, "--ref") if ref is not None else None
    rm_configs = [model_config(d, "--rm") for d in rms]
    if config is None and not rm_configs:
        return None
    if config is None:
        config, rm_configs = rm_configs[0], rm_configs[1:]  # plan the first reward model as the scorer in front
    est = plan_score_ref(config, Work(half, batch_tokens - half, 1), Hardware(1, free / GIB), dtype, batch_tokens,
                         packing, rm_configs)
    if not est.fits:
        est.suggestion = {"flags": {"--batch-tokens": max(16, batch_tokens // 4)}, "peak_gib": None, "gpus": 1}
        refuse(est, "score-ref", free=True)
    return est


def preflight_vllm(weights: Path, dtype: str, utilization: float, total: int, tp: int = 1,
                   max_model_len: int | None = None) -> Estimate | None:
    """rollout's check before vLLM starts (`rlkit.engines.memory.preflight_vllm`, which rollout calls), as an
    Estimate: refused (exit 71) when vLLM's share cannot hold the weights and one sequence's KV cache."""
    from rlkit.engines import memory

    if memory.preflight_vllm(weights, dtype, utilization, total, tp, max_model_len) is None:
        return None
    config = model_config(weights, "--policy")
    seq = max_model_len or int(config.get("max_position_embeddings") or 4096)
    return plan_vllm(config, Work(seq, 0, 1), Hardware(tp, total / GIB), dtype=dtype, utilization=utilization,
                     profile=False)


def gpu_memory_gib(device) -> float:
    import torch

    return torch.cuda.get_device_properties(device).total_memory / GIB

