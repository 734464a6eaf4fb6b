"""The `vllm` engine: `vllm.LLM` on the checkpoint directory (GPUs; vLLM's CPU backend for tests), prompts in as
token ids, samples out with the log-prob of each sampled token under the temperature-scaled distribution
(vLLM's ``processed_logprobs``, which also renormalises over the nucleus when top_p < 1). Runs LoRA checkpoints
on vLLM's LoRA support, reloads weights in place, and is what `--engine auto` picks when vLLM imports and a GPU
is present. vLLM is imported only when an engine starts.

vLLM picks its own device: the first visible GPU (its CPU backend where torch sees none), so `--device` is checked,
not obeyed (`vllm_device`). On a GPU its memory share defaults to what `--colocate`'s models leave
(`rlkit.engines.memory`), and with `EngineOptions.sleep` it is built with vLLM's sleep mode, so `sleep` can hand
its GPU memory back between `rollout --follow --max-lag 0` batches. Nothing here initialises CUDA in this
process before vLLM starts its engine process (vLLM would then have to spawn it instead of forking).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from rlkit.engines import memory
from rlkit.engines.base import Capabilities, EngineOptions, Generated, register
from rlkit.errors import RlkitError


def vllm_import_error() -> str | None:
    """Why `import vllm` fails here, or None when it imports."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # any failure (missing, broken torchvision, ABI) means: no vLLM here
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


_LONG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def checkpoint_dtype(policy: Path) -> str:
    """The dtype checkpoint `policy` was saved in, vLLM's name (its config.json; 'auto' when it says none)."""
    import json

    cfg = json.loads((Path(policy) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")


def sampling_dtype(stored: str, asked: str, device_type: str, bf16: bool = True) -> str:
    """vLLM's name of the dtype to sample in, for `--dtype asked` on a checkpoint saved in `stored` (vLLM's name)
    when vLLM runs on `device_type` ('cuda': a GPU, `bf16` whether it has bf16 kernels; 'cpu': vLLM's CPU backend).
    `--dtype auto` is bf16 on a GPU with bf16 kernels (as verl samples: half the weights and KV cache of the fp32
    checkpoints rlkit writes, and vLLM's FlashAttention, which has no fp32); elsewhere the checkpoint's own dtype,
    so vLLM's CPU backend samples in fp32 what it always has. fp32/bf16/fp16 are rlkit's names."""
    if asked != "auto":
        return _LONG_DTYPES.get(asked, asked)
    if device_type == "cuda" and bf16:
        return "bfloat16"
    return stored


_SHORT_DTYPES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def vllm_device(spec: str):
    """The torch.device vLLM runs on for `--device spec`, or one line saying what to do instead. vLLM takes no device
    argument: it runs on the first visible GPU (cuda:0; --tp K: cuda:0..K-1), or on its CPU backend where torch sees
    no GPU. So with CUDA, `cpu` and `cuda:N` (N > 0) are refused (CUDA_VISIBLE_DEVICES moves vLLM); without it,
    `auto`/`cpu` are the CPU and `cuda` is `devices.resolve`'s error. Initialises no CUDA context."""
    import torch

    from rlkit import devices

    kind, index = devices.parse(spec)
    if not torch.cuda.is_available():
        return devices.resolve(spec)  # vLLM's CPU backend: auto, cpu -> cpu; cuda -> "CUDA is not available here"
    if kind == "cpu":
        raise RlkitError(f"--device {spec}: --engine vllm runs on the GPU here (vLLM's CPU backend is another build); "
                         "sample on the CPU with --engine hf --device cpu, or drop --device")
    if index is None:  # auto, cuda: what devices.resolve gives (cuda:LOCAL_RANK under a launcher), without CUDA
        index = devices.launcher_local_rank() or 0
    if index >= torch.cuda.device_count():
        return devices.resolve(spec)  # "this machine has N GPUs"
    if index != 0:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        gpu = visible[index] if index < len(visible) else str(index)
        raise RlkitError(f"--device {spec}: vLLM runs on the first visible GPU (cuda:0) and takes no device argument; "
                         f"to run it on that GPU start rollout with CUDA_VISIBLE_DEVICES={gpu} (and --device auto)")
    return torch.device("cuda", 0)


WAKE_TAGS = ("weights", "kv_cache")  # what vLLM's sleep mode releases and `LLM.wake_up(tags)` takes back
# the ranks vLLM's LoRA kernels take (vllm.config.lora.MaxLoRARanks); an adapter's rank is rounded up
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_rank(rank: int) -> int | None:
    """The smallest max_lora_rank vLLM accepts for an adapter of `rank`; None above its largest."""
    return next((r for r in VLLM_RANKS if r >= rank), None)


def _prompt_seed(seed: int, i: int) -> int:
    """A well-spread 31-bit seed per prompt; vLLM seeds the n samples of a prompt seed+0 .. seed+n-1."""
    h = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (2**31 - 2**16)


def finish_reason(vllm_reason: str | None, stop_reason: int | str | None, toks: list[int], eos: int) -> str:
    """rlkit's finish reason of a vLLM completion: "stop" when a stop string ended it (vLLM's `stop_reason` is the
    string), "eos" when it ends with the tokenizer's eos or one of the model's own (generation_config's eos ids,
    which vLLM stops on and names as `stop_reason`), else "length"."""
    if isinstance(stop_reason, str):
        return "stop"
    if (toks and toks[-1] == eos) or (vllm_reason == "stop" and isinstance(stop_reason, int)):
        return "eos"
    return "length"


@register("vllm")
class VLLMEngine:
    """`vllm.LLM` over the checkpoint directory; prompts go in as token ids, samples come back as
    token ids with the log-prob of each sampled token (`logprobs=0`: the sampled token only).

    A LoRA checkpoint (`rlkit.io.adapters`) runs on vLLM's LoRA support (the CPU backend's too): the engine loads
    the hash-verified base and sends the adapter as a `LoRARequest` with every generate call; a reload to
    another adapter on the same base swaps the request (no weights move). With `EngineOptions.lora` "merge",
    an adapter above vLLM's largest rank (512), or an adapter on another base than the weights the engine
    holds, the merged weights are written to a temporary directory and loaded from there instead."""

    # sleep mode: vLLM has it on CUDA (also ROCm and XPU), not on its CPU backend, where `sleep` returns False
    capabilities = Capabilities(logprobs_match_trainer=False, supports_lora=True, supports_sleep=True,
                                continuous_batching=True)
    auto_rank = 10
    auto_reason = "vLLM imports and a GPU is present"

    @classmethod
    def unavailable(cls) -> str | None:
        import importlib.util

        import torch

        if not torch.cuda.is_available():
            return "no GPU here; vLLM on a CPU is for tests, not speed"
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed (pip install 'rlkit[vllm]')"
        err = vllm_import_error()
        return f"vLLM does not import ({err})" if err else None

    @classmethod
    def check_options(cls, opts: EngineOptions) -> None:
        vllm_device(opts.device)  # every other EngineOptions knob is vLLM's

    @classmethod
    def start(cls, policy: Path, opts: EngineOptions) -> VLLMEngine:
        from rlkit.io import checkpoints

        return cls(policy, checkpoints.load_tokenizer(policy, opts.trust_remote_code), opts)

    def __init__(self, policy: Path, tokenizer, opts: EngineOptions) -> None:
        err = vllm_import_error()
        if err:
            raise RlkitError(f"--engine vllm: vLLM does not import here ({err}); on a GPU: pip install 'rlkit[vllm]', "
                             "on a CPU see docs/install.md, 'vLLM on a CPU'")
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        self.device = vllm_device(opts.device)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout may carry our table
        if not on_gpu:
            # vLLM's CPU backend sizes its KV cache from this (GiB); its default asks for more memory than a
            # small shared machine has free
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.policy = Path(policy).absolute()  # the checkpoint whose weights the engine holds now (see `reload`)
        self.trust_remote_code = opts.trust_remote_code
        self.lora_request = None  # the adapter sent with every generate call (a LoRA checkpoint on vLLM's LoRA)
        self._lora_ids, self._tmp = 0, None  # LoRARequest ids used; the temporary merged weights held now
        self.weights, lora_kw = self.policy, {}  # the plain weights (directory) loaded into the engine
        from rlkit.io import adapters

        if adapters.is_adapter_dir(self.policy):
            base, _ = adapters.verify_base(self.policy)
            max_rank = vllm_rank(adapters.adapter_rank(self.policy))
            if opts.lora == "adapter" and max_rank is not None:
                self.weights, lora_kw = base, {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
            else:
                self.weights = self._tmp = self._merge(self.policy)
        self.max_lora_rank = lora_kw.get("max_lora_rank", 0)
        w = self.weights
        dtype = sampling_dtype(checkpoint_dtype(w), opts.dtype, "cuda" if on_gpu else "cpu",
                               bf16=on_gpu and _gpu_has_bf16())
        self.dtype = _SHORT_DTYPES.get(dtype, dtype)
        util = opts.gpu_memory_utilization or (_gpu_share(self.policy, dtype, opts) if on_gpu else memory.CPU_DEFAULT)
        # sleep mode exists on CUDA only (vLLM refuses it on its CPU backend): asked for and on a GPU
        # `asleep`: False, or the set of WAKE_TAGS still asleep
        self.sleep_mode, self.asleep = bool(opts.sleep and on_gpu), False
        if on_gpu and opts.plan:  # before vLLM's own start-up finds out (rlkit.engines.memory)
            from vllm.platforms import current_platform

            try:
                memory.preflight_vllm(w, dtype, util, int(current_platform.get_device_total_memory(0)), opts.tp,
                                      opts.max_model_len)
            except BaseException:
                self._drop_tmp()
                raise
        try:
            self.llm = LLM(model=str(w), tokenizer=str(w), dtype=dtype, tensor_parallel_size=opts.tp,
                           gpu_memory_utilization=util, max_model_len=opts.max_model_len,
                           enforce_eager=opts.enforce_eager, seed=opts.seed, logprobs_mode="processed_logprobs",
                           trust_remote_code=opts.trust_remote_code,
                           worker_extension_cls=f"{__name__}.VLLMWorkerExtension", **lora_kw,
                           **({"enable_sleep_mode": True} if self.sleep_mode else {}),
                           # the CPU backend cannot rewind a seeded request's generator, which a prefill chunked
                           # over steps needs (multi-turn prefixes outgrow a step's token budget): whole prefills
                           **({} if on_gpu else {"enable_chunked_prefill": False}))
        except Exception as e:
            self._drop_tmp()
            oom = _start_failure(e, util, w, dtype, opts) if on_gpu else start_out_of_memory(e, util)
            if oom is not None:
                raise oom from e
            raise
        if lora_kw:
            self._use_adapter(self.policy)

    def _merge(self, d: Path) -> Path:
        """LoRA checkpoint `d` merged into its base, in a fresh temporary directory (removed once replaced)."""
        import tempfile

        from rlkit.io import adapters

        out = Path(tempfile.mkdtemp(prefix="rlkit-lora-merged-"))
        try:
            adapters.write_merged(d, out, self.trust_remote_code)
        except BaseException:
            import shutil

            shutil.rmtree(out, ignore_errors=True)
            raise
        return out

    def _drop_tmp(self, keep: Path | None = None) -> None:
        import shutil

        if self._tmp is not None and self._tmp != keep:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = keep

    def _use_adapter(self, d: Path) -> None:
        """Send adapter `d` with every generate call from now on; vLLM loads it here (an error surfaces now)."""
        from vllm.lora.request import LoRARequest

        engine = self.llm.llm_engine
        if self.lora_request is not None:
            engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None
        self._lora_ids += 1
        req = LoRARequest(f"rlkit-{self._lora_ids}", self._lora_ids, str(d))
        engine.add_lora(req)
        self.lora_request = req

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed, stop=()) -> Generated:
        """Token ids in (`TokensPrompt`: a multi-turn prefix is sent as the very tokens the trajectory holds, never
        re-tokenised), token ids and their log-probs out. Temperature 0 is vLLM's greedy decoding. `stop`: strings
        that end a completion once its text holds one (vLLM's own check, on the detokenised text, which it then
        needs: without `stop` nothing is detokenised); the completion keeps the tokens up to and including the one
        that completed the string (finish reason "stop")."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        stops = {"stop": list(stop), "include_stop_str_in_output": True} if stop else {"detokenize": False}
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                 seed=_prompt_seed(seed, i), logprobs=0, **stops)
                  for i in range(len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        ids, fins, lps = [], [], []
        for o in outs:
            for c in sorted(o.outputs, key=lambda c: c.index):
                toks, lp, fin = _completion(c, self.eos)
                ids.append(toks)
                lps.append(lp)
                fins.append(fin)
        return Generated(ids, fins, lps)

    def stream(self, *, temperature: float, top_p: float, max_new_tokens: int, stop=()) -> VLLMStream:
        """Requests one at a time into the running engine (continuous batching; `rlkit.engines.base.Stream`)."""
        self.wake_up()
        return VLLMStream(self, temperature, top_p, max_new_tokens, stop)

    @property
    def context(self) -> int | None:
        """The longest sequence the engine takes (prompt + completion): vLLM's max_model_len (--max-model-len, by
        default the model's context)."""
        n = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "max_model_len", None)
        return n if isinstance(n, int) and n > 0 else None

    def reload(self, model_dir: Path) -> float:
        """Load the weights of checkpoint `model_dir` (same architecture and tokenizer, a Hugging Face directory
        with *.safetensors) into the running engine in place; reset the prefix cache; return the seconds it took.

        vLLM's own in-place reload (the worker's `reload_weights`) reloads and re-processes every layer that the
        checkpoint has weights for. A tied lm_head has none of its own (its weight is the embedding's), so on
        vLLM's CPU backend it would keep computing logits with the GEMM packed from the old weights: the
        workers re-pack it afterwards. The prefix cache holds KV computed with the old weights: dropped.

        A LoRA checkpoint whose base is the weights the engine holds, with vLLM's LoRA on: its adapter replaces
        the LoRARequest and no weights move. Any other LoRA checkpoint: its merged weights, written to a
        temporary directory, are reloaded as above.

        A directory without *.safetensors is refused before the engine is touched (it stays usable). A reload
        that fails inside vLLM leaves the engine half loaded: RlkitError, and the engine is of no further use."""
        import time

        from rlkit.io import adapters

        model_dir = Path(model_dir).absolute()  # vLLM takes a path it cannot find for a Hugging Face Hub id
        if not model_dir.is_dir() or not any(model_dir.glob("*.safetensors")):
            raise RlkitError(f"cannot reload the vLLM engine from {model_dir}: no *.safetensors there")
        self.wake_up(("weights",))  # a sleeping engine's weights are in host memory: back first, no KV cache yet
        t0 = time.perf_counter()
        weights = model_dir
        if adapters.is_adapter_dir(model_dir):
            base, _ = adapters.verify_base(model_dir)
            if base == self.weights and adapters.adapter_rank(model_dir) <= self.max_lora_rank:
                try:
                    self._use_adapter(model_dir)
                except Exception as e:
                    raise RlkitError(f"vLLM failed to load the LoRA adapter of {model_dir} "
                                     f"({(str(e).splitlines() or [type(e).__name__])[0]})") from e
                self.llm.reset_prefix_cache()  # KV of the old adapter is keyed by its id: memory only
                self.policy = model_dir
                return time.perf_counter() - t0
            weights = self._merge(model_dir)
        try:
            if self.lora_request is not None:
                self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
                self.lora_request = None
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights)})
            self.llm.collective_rpc("rlkit_repack_cpu_gemms")
        except Exception as e:
            raise RlkitError(f"vLLM failed to reload the weights of {model_dir} ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                             "the engine is no longer usable") from e
        finally:
            if weights != model_dir:
                self._drop_tmp(keep=weights)
        if not self.llm.reset_prefix_cache():
            raise RlkitError("vLLM did not reset its prefix cache after the weight reload (requests still running?)")
        if weights == model_dir:
            self._drop_tmp()
        self.policy, self.weights = model_dir, weights
        return time.perf_counter() - t0

    def sleep(self) -> bool:
        """Sleep mode level 1 (`LLM.sleep(level=1)`): the weights go to host memory, the KV cache (and the prefix cache)
        is dropped, and the GPU memory they held is free until `wake_up`. False, doing nothing, unless the engine
        was started with `EngineOptions.sleep` on a GPU (vLLM's CPU backend has no sleep mode)."""
        if not self.sleep_mode:
            return False
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = set(WAKE_TAGS)
        return True

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """`LLM.wake_up(tags)`: take back the GPU memory of `tags` ("weights": the weights from host memory;
        "kv_cache": a fresh KV cache), all of it by default; a no-op for what is awake. `reload` wakes the weights
        alone, so the KV cache is not allocated while the new weights load; `sample` wakes everything."""
        if not self.asleep:
            return
        want = [t for t in WAKE_TAGS if t in self.asleep and (tags is None or t in tags)]
        if want:  # everything at once: vLLM's own wake_up() (no tags)
            self.llm.wake_up(tags=None if len(want) == len(WAKE_TAGS) else want)
            self.asleep -= set(want)
        if not self.asleep:
            self.asleep = False

    def close(self) -> None:
        """Shut the engine's worker processes down now rather than at interpreter exit."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and hasattr(llm, "llm_engine") and hasattr(llm.llm_engine, "engine_core"):
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # shutting down is best effort: the processes die with us anyway
                pass
        if getattr(self, "_tmp", None) is not None:
            self._drop_tmp()


def _completion(c, eos: int) -> tuple[list[int], list[float], str]:
    """A vLLM completion output's token ids, their log-probs and rlkit's finish reason."""
    toks = list(c.token_ids)
    if c.logprobs is None or len(c.logprobs) != len(toks):
        raise RlkitError("vLLM returned no log-prob for some sampled tokens; cannot log pi_old")
    lps = [float(d[t].logprob) for d, t in zip(c.logprobs, toks, strict=True)]
    return toks, lps, finish_reason(getattr(c, "finish_reason", None), getattr(c, "stop_reason", None), toks, eos)


class VLLMStream:
    """Continuous batching on the running engine (`rlkit.engines.base.Stream`): each `submit` adds one request (token
    ids in, its own seed) to vLLM's scheduler at once, next to those already decoding; `poll` runs one engine step and
    returns the requests that finished in it. The sampling is `sample`'s: the same log-probs, stop strings, LoRA."""

    def __init__(self, engine: VLLMEngine, temperature: float, top_p: float, max_new_tokens: int, stop=()) -> None:
        self.engine = engine
        stops = {"stop": list(stop), "include_stop_str_in_output": True} if stop else {"detokenize": False}
        self.kw = dict(n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0, **stops)
        self.keys: dict[str, tuple] = {}  # vLLM's request id as it reports it -> (our key, its id as enqueued)

    @property
    def pending(self) -> int:
        return len(self.keys)

    def submit(self, key, prompt_ids: list[int], seed: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        (rid,) = self.engine.llm.enqueue(TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                         SamplingParams(seed=seed, **self.kw), use_tqdm=False,
                                         lora_request=self.engine.lora_request)
        # enqueue returns the engine's internal id, "ID-xxxxxxxx"; outputs carry ID, the request's own
        self.keys[rid.rsplit("-", 1)[0]] = (key, rid)

    def poll(self) -> list[tuple]:
        engine, out = self.engine.llm.llm_engine, []
        if self.keys and not engine.has_unfinished_requests():  # step() would wait for ever
            raise RlkitError(f"vLLM lost {len(self.keys)} request(s) of the rollout's trajectories")
        for o in engine.step():
            if not o.finished or o.request_id not in self.keys:
                continue
            key, _ = self.keys.pop(o.request_id)
            (c,) = o.outputs
            out.append((key, *_completion(c, self.engine.eos)))
        return out

    def abort(self) -> None:
        if self.keys:
            self.engine.llm.llm_engine.abort_request([rid for _, rid in self.keys.values()], internal=True)
        self.keys.clear()


# what vLLM 0.32 raises when it cannot start for memory: vllm/v1/core/kv_cache_utils.py (no room for a KV cache; a
# KV cache too small for --max-model-len), vllm/v1/worker/utils.py (other processes hold the GPU), torch's CUDA
# allocator while the weights load
START_OOM_TEXTS = ("No available memory for the cache blocks", "larger than the available KV cache memory",
                   "is less than desired GPU memory utilization", "CUDA out of memory")
# what vLLM V1 raises in this process when its engine-core process died starting up (vllm/v1/engine/utils.py); the
# cause is only logged, by that process
ENGINE_CORE_FAILED = "Engine core initialization failed"


def start_out_of_memory(e: BaseException, util: float, *, total: int | None = None, free: int | None = None,
                        policy_bytes: int | None = None):
    """`devices.OutOfMemory` (one line, exit 71) when vLLM's start-up failure `e` is for memory, else None.
    For memory: one of vLLM's own texts (`START_OOM_TEXTS`, an engine in this process), or, for the engine-core
    process's death (`ENGINE_CORE_FAILED`, whose cause this process never sees), the figures measured after it:
    less `free` GPU memory than the share `util` x `total` asks for (another process holds it), or a share too
    small for the policy's weights `policy_bytes` with the least KV cache (`memory.policy_need`). Without those
    figures (vLLM's CPU backend) an engine-core death stays what it is."""
    from rlkit import devices

    text = str(e)
    said = type(e).__name__ == "OutOfMemoryError" or any(t in text for t in START_OOM_TEXTS)
    share = util * total if total else None
    short_free = share is not None and free is not None and free < share
    need = memory.policy_need(policy_bytes) if policy_bytes is not None else None
    short_share = share is not None and need is not None and need > share
    if not (said or (ENGINE_CORE_FAILED in text and (short_free or short_share))):
        return None
    figures = []
    if share is not None:
        figures.append(f"--gpu-memory-utilization {util:g} of the GPU's {memory.gib(total)} is {memory.gib(share)}")
    if short_free:
        figures.append(f"{memory.gib(free)} of it is free (other processes hold the rest)")
    if short_share:
        figures.append(f"the policy's {memory.gib(policy_bytes)} of weights need about {memory.gib(need)} with "
                       "the least KV cache")
    if not figures:
        figures.append(text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__)
    return devices.OutOfMemory(
        f"rollout: vLLM ran out of memory starting up ({'; '.join(figures)}); size its share with "
        "--gpu-memory-utilization (lower when other processes hold the GPU, higher when the policy does not fit), "
        "or name each model score-ref runs beside it with --colocate DIR so rollout sizes it (docs/gpu.md); "
        "nothing was written")


def _start_failure(e: BaseException, util: float, weights: Path, dtype: str, opts: EngineOptions):
    """`start_out_of_memory` on a GPU, with the figures measured now that vLLM's processes are gone: the GPU's free
    and total memory, the policy's weights in `dtype` per GPU."""
    free = total = pol = None
    try:
        import torch

        free, total = torch.cuda.mem_get_info(0)  # vLLM has failed: a CUDA context here harms nothing now
    except Exception:  # no figures: vLLM's own texts alone decide
        pass
    try:
        pol = memory.weights_bytes(weights, dtype) // max(opts.tp, 1)
    except Exception:
        pass
    return start_out_of_memory(e, util, total=total, free=free, policy_bytes=pol)


def _gpu_has_bf16() -> bool:
    """Whether vLLM's GPU (cuda:0) has bf16 kernels (compute capability 8.0 and later), asked through NVML as vLLM
    asks it: no CUDA context in this process."""
    from vllm.platforms import current_platform

    return bool(current_platform.has_device_capability(80))


def _gpu_share(policy: Path, dtype: str, opts: EngineOptions, total: int | None = None) -> float:
    """vLLM's memory share on a GPU without --gpu-memory-utilization: what `--colocate`'s models leave
    (`memory.vllm_memory_share`), or `memory.DEFAULT_SHARE` without them; said in one line on stderr. `total`: the
    GPU's bytes, by default from vLLM's platform (NVML: no CUDA context here)."""
    from rlkit import console

    if total is None:
        from vllm.platforms import current_platform

        total = int(current_platform.get_device_total_memory(0))
    per_gpu = memory.weights_bytes(policy, dtype) // max(opts.tp, 1)
    if not opts.colocate:
        share = memory.default_share(total, per_gpu)
        console.info(f"rollout: vLLM takes {share} of the GPU's {memory.gib(total)} (the default without --colocate); "
                     "name each model score-ref runs beside it with --colocate DIR (--ref, --rm) to size its share, or "
                     f"pass --gpu-memory-utilization ({memory.CAP} when rollout has the GPU to itself); see docs/gpu.md")
        return share
    sizes = [memory.model_bytes(d, dtype="bf16" if _gpu_has_bf16() else "stored") for d in opts.colocate]
    share = memory.vllm_memory_share(total, per_gpu, sizes)
    console.info(f"rollout: vLLM takes {share} of the GPU's {memory.gib(total)} ({memory.gib(share * total)} for the "
                 f"policy's {memory.gib(per_gpu)} and its KV cache), leaving {memory.gib(memory.colocated_need(sizes))} "
                 f"for --colocate's {len(sizes)} model(s) ({memory.gib(sum(sizes))} of weights) and CUDA contexts")
    return share


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`), so that `LLM.collective_rpc` reaches these
    methods by name: no pickled functions cross vLLM's process boundary."""

    def rlkit_repack_cpu_gemms(self) -> int:
        """Re-pack every CPU GEMM (`cpu_linear`: oneDNN / SGL packed weights) built from a weight its layer
        still holds (embeddings and the lm_head; the linear layers give theirs up once packed, and the
        in-place reload re-packs those itself). Returns how many were re-packed; none off vLLM's CPU backend."""
        import torch

        n = 0
        for m in self.get_model().modules():
            w, qm = getattr(m, "weight", None), getattr(m, "quant_method", None)
            if (hasattr(m, "cpu_linear") and qm is not None and isinstance(w, torch.Tensor) and w.ndim == 2
                    and w.numel() > 0):
                qm.process_weights_after_loading(m)
                n += 1
        return n
