"""How much of one GPU's memory `rollout`'s vLLM engine may take (`--gpu-memory-utilization`) when other stages
of the pipe run their models on the same GPU at the same time.

vLLM takes the fraction it is given of the GPU's total memory for its weights, activations and KV cache, and
fills whatever its weights and activations leave with KV cache: it never gives memory back while it runs. In
`rollout | score-ref | update` on one GPU, score-ref holds its reference (and reward models) for the whole run,
so rollout's fraction must leave room for them. `--colocate DIR` names each of those models; their sizes come
from the safetensors headers (no tensor is read). The arithmetic is `vllm_memory_share`'s docstring; docs/gpu.md
has it for 0.5B and 7B models on 24 and 80 GiB.

It is rlkit's one model of vLLM's memory. The share (`vllm_memory_share`) sizes vLLM beside other models from
weights alone; inside the share, vLLM's own accounting (`vllm_accounting`: the weights in the sampling dtype, the
profiling run's activations, the KV cache in what is left, which must hold one whole sequence) says how many
tokens its cache holds. `rlkit plan rollout` (rlkit.planner) prints that accounting, and rollout's check before
vLLM starts (`preflight_vllm`) refuses a share that cannot hold one sequence.

Pure arithmetic plus header reads: no torch, no vLLM (torch is not imported by this module).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlkit.errors import RlkitError

GiB = 2**30
ACTIVATION_FACTOR = 1.25  # a model in inference: its weights and a quarter more for activations
RESERVE_BYTES = 2 * GiB  # CUDA contexts, cuBLAS workspaces and allocator slack of the other processes (~1 GiB each)
MIN_KV_BYTES = 1 * GiB  # the least KV cache worth starting vLLM for
CAP = 0.9  # vLLM's own default fraction: never more
DEFAULT_SHARE = 0.5  # on a GPU without --colocate: half, so score-ref's models have the other half
CPU_DEFAULT = 0.3  # vLLM's CPU backend (sizes its KV cache from VLLM_CPU_KVCACHE_SPACE; this is what it checks)

# bytes per parameter of vLLM's --dtype names (and rlkit's short ones)
_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2}


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def policy_need(policy_bytes: int) -> int:
    """The least vLLM needs on the GPU for a policy of `policy_bytes` of weights (per GPU: weights / --tp): the
    weights x ACTIVATION_FACTOR plus MIN_KV_BYTES of KV cache."""
    return math.ceil(policy_bytes * ACTIVATION_FACTOR) + MIN_KV_BYTES


def colocated_need(colocated_bytes: list[int], reserve_bytes: int = RESERVE_BYTES) -> int:
    """What the other processes on the GPU hold: each model's weights x ACTIVATION_FACTOR, plus `reserve_bytes`."""
    return sum(math.ceil(b * ACTIVATION_FACTOR) for b in colocated_bytes) + reserve_bytes


def vllm_memory_share(total_bytes: int, policy_bytes: int, colocated_bytes: list[int],
                      reserve_bytes: int = RESERVE_BYTES) -> float:
    """vLLM's `gpu_memory_utilization` on a GPU of `total_bytes` shared with models of `colocated_bytes` (weights,
    as loaded) that other processes run there at the same time:

        others = sum(colocated_bytes[i] x 1.25) + reserve_bytes      # activations; CUDA contexts (2 GiB)
        share  = min(0.9, floor(100 x (total_bytes - others) / total_bytes) / 100)
        need   = policy_bytes x 1.25 + 1 GiB                         # the policy's weights, activations, KV cache

    and RlkitError (one line) when share x total_bytes < need: the policy does not fit beside them. Whatever
    vLLM's share leaves above `need` is its KV cache. `policy_bytes` is what one GPU holds of the policy (its
    weights / --tp). Rounded down to a hundredth, so vLLM never takes more than the arithmetic leaves it.
    """
    if total_bytes <= 0 or policy_bytes < 0 or any(b < 0 for b in colocated_bytes):
        raise ValueError("sizes must be positive")
    others = colocated_need(colocated_bytes, reserve_bytes)
    share = min(CAP, math.floor(100 * (total_bytes - others) / total_bytes) / 100)
    need = policy_need(policy_bytes)
    if share * total_bytes < need:
        raise RlkitError(f"the policy does not fit on this GPU beside --colocate's models: vLLM needs about "
                         f"{gib(need)} (the policy's {gib(policy_bytes)} of weights x {ACTIVATION_FACTOR} and "
                         f"{gib(MIN_KV_BYTES)} of KV cache) but {gib(total_bytes)} less {gib(others)} for the "
                         f"{len(colocated_bytes)} colocated model(s) and CUDA contexts leaves "
                         f"{gib(max(share, 0) * total_bytes)}; run score-ref on another GPU (CUDA_VISIBLE_DEVICES per "
                         "process), sample in bf16 (--dtype bf16) if the policy runs in fp32, or use more GPUs (--tp)")
    return share


def default_share(total_bytes: int, policy_bytes: int) -> float:
    """DEFAULT_SHARE (a GPU without --colocate), or RlkitError when the policy (`policy_need`) does not fit in it."""
    need = policy_need(policy_bytes)
    if DEFAULT_SHARE * total_bytes < need:
        raise RlkitError(f"the policy does not fit in vLLM's default share of this GPU without --colocate "
                         f"({DEFAULT_SHARE} of {gib(total_bytes)}): it needs about {gib(need)} (its {gib(policy_bytes)} "
                         f"of weights x {ACTIVATION_FACTOR} and {gib(MIN_KV_BYTES)} of KV cache); pass "
                         f"--gpu-memory-utilization {CAP} when rollout has the GPU to itself, or --colocate DIR for "
                         "each model score-ref runs beside it (--ref, --rm) to size it")
    return DEFAULT_SHARE


def _weight_dirs(d: Path, flag: str) -> list[Path]:
    """`d`, and before it the base of a LoRA checkpoint (which holds only its adapter)."""
    from rlkit.io.checkpoints import load_manifest, weight_files

    if not d.is_dir() or not weight_files(d):
        raise RlkitError(f"{flag} {d}: no *.safetensors there (a model directory, e.g. score-ref's --ref or --rm)")
    dirs = [d]
    acfg = d / "adapter_config.json"
    if acfg.is_file():  # a LoRA checkpoint (rlkit.training.lora): its base's weights are loaded too
        try:
            base = (((load_manifest(d) or {}).get("lora") or {}).get("base")
                    or json.loads(acfg.read_text()).get("base_model_name_or_path"))
        except (OSError, ValueError) as e:
            raise RlkitError(f"{acfg} is unreadable ({e})") from None
        if not base or not Path(base).is_dir() or not weight_files(Path(base)):
            raise RlkitError(f"{flag} {d}: its LoRA base model {base} is missing")
        dirs.insert(0, Path(base))
    return dirs


def model_bytes(d: Path, flag: str = "--colocate", dtype: str = "bf16") -> int:
    """Bytes of weights score-ref holds on a GPU for model directory `d`, from its safetensors headers (a LoRA
    checkpoint's base counted in), as score-ref's --dtype `dtype` loads it: bf16 (`--dtype auto` on a GPU with
    bf16 kernels) 2 bytes a parameter for every model; stored (auto on an older GPU) a frozen reference (rlkit.json
    kind 'reference') at the dtypes it is stored in and any other model (a reward model) in fp32; fp32 4 bytes."""
    from rlkit.io.checkpoints import load_manifest, safetensors_summary

    dirs = _weight_dirs(Path(d), flag)
    params = sum(safetensors_summary(x)["parameters"] for x in dirs)
    if dtype in ("bf16", "fp16"):
        return 2 * params
    if dtype == "stored" and (load_manifest(Path(d)) or {}).get("kind") == "reference":
        return sum(safetensors_summary(x)["bytes"] for x in dirs)
    return 4 * params


def weights_bytes(d: Path, dtype: str, flag: str = "--policy") -> int:
    """Bytes of weights vLLM holds for checkpoint `d` run in `dtype` (a vLLM dtype name; an unknown one, e.g.
    'auto': the stored dtypes); a LoRA checkpoint's base counted in."""
    from rlkit.io.checkpoints import safetensors_summary

    per = _DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
    total = 0
    for x in _weight_dirs(Path(d), flag):
        s = safetensors_summary(x)
        total += s["parameters"] * per if per else s["bytes"]
    return total


# -- vLLM's own accounting inside its share (from the model's config.json)


def dtype_bytes(name: str) -> int:
    """Bytes a parameter (or a KV-cache element) in dtype `name` (vLLM's or rlkit's names; unknown: 2)."""
    return _DTYPE_BYTES.get(str(name).removeprefix("torch."), 2)


def parameters(cfg: dict) -> int:
    """Parameters of a Llama-family decoder from its config.json (q, k, v, o with qkv bias; gated MLP; norms)."""
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg.get("num_attention_heads", 1)
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    inter = cfg.get("intermediate_size", 4 * h)
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads * hd + 2 * kv * hd)
    per_layer = attn + 3 * h * inter + 2 * h
    head = 0 if cfg.get("tie_word_embeddings", False) else v * h
    return v * h + layers * per_layer + h + head


def kv_bytes_per_token(cfg: dict, dtype: str, tp: int = 1) -> int:
    """KV-cache bytes of one token on one GPU: K and V of every layer's KV heads, over --tp GPUs."""
    heads = cfg.get("num_attention_heads", 1)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * hd * dtype_bytes(dtype) // max(1, tp)


def vllm_accounting(cfg: dict, total_bytes: int, utilization: float, seq: int, *, dtype: str = "bf16", tp: int = 1,
                    max_num_seqs: int = 256, max_batched_tokens: int | None = None, profile: bool = True) -> dict:
    """vLLM's documented accounting on one GPU of `total_bytes`: it takes `utilization` of it (its share); the
    weights in `dtype` (over `tp` GPUs) and its profiling run's activation peak come off the share, and the KV
    cache is the rest. The profiling run (`profile`): one batch of `max_batched_tokens` (default max(8192, seq))
    through a layer (hidden states and the MLP) plus the sampler's fp32 logits for `max_num_seqs` rows.
    -> share, weights, activations, kv_cache (bytes), per_token, kv_cache_tokens, and `starts`: whether the cache
    holds one `seq`-token sequence (vLLM refuses to start otherwise)."""
    share = int(utilization * total_bytes)
    b = dtype_bytes(dtype)
    weights = parameters(cfg) * b // max(1, tp)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    tokens = max_batched_tokens or max(8192, seq)
    inter = cfg.get("intermediate_size", 4 * h)
    activations = (tokens * (4 * h + 2 * inter) * b // max(1, tp) + max_num_seqs * v * 4) if profile else 0
    per_token = kv_bytes_per_token(cfg, dtype, tp)
    kv = max(0, share - weights - activations)
    cache_tokens = kv // max(1, per_token)
    return {"share": share, "weights": weights, "activations": activations, "kv_cache": kv, "per_token": per_token,
            "kv_cache_tokens": cache_tokens, "starts": cache_tokens >= seq}


def preflight_vllm(weights: Path, dtype: str, utilization: float, total: int, tp: int = 1,
                   max_model_len: int | None = None) -> dict | None:
    """rollout's check before vLLM starts on a GPU: vLLM starts only if its share of the GPU holds the weights and
    a KV cache for one sequence of its context length (max_model_len, else the config's max_position_embeddings);
    refused (OutOfMemory, exit 71) when it cannot, before vLLM's own start-up (minutes on a 7B) finds out.
    Activations are left out: the check refuses only what vLLM would certainly refuse. A config that is not a
    decoder-only transformer's (nothing to count): None, vLLM decides. -> the accounting."""
    try:
        cfg = json.loads((Path(weights) / "config.json").read_text())
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    seq = max_model_len or int(cfg.get("max_position_embeddings") or 4096)
    acc = vllm_accounting(cfg, total, utilization, seq, dtype=dtype, tp=tp, profile=False)
    if not acc["starts"]:
        from rlkit.devices import OutOfMemory

        raise OutOfMemory(f"rollout: vLLM's share of the GPU (--gpu-memory-utilization {utilization:g} of "
                          f"{gib(total)}) holds the weights ({gib(acc['weights'])} in {dtype}) but not the KV cache of "
                          f"one {seq:,}-token sequence; raise --gpu-memory-utilization, lower --max-model-len, or "
                          "spread the model with --tp; --no-plan skips this check; nothing was written")
    return acc
