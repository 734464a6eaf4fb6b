"""The `vllm` engine: `vllm.LLM` on the checkpoint directory (GPUs; vLLM's CPU backend for tests), prompts in as
token ids, samples out with the log-prob of each sampled token under the temperature-scaled distribution
(vLLM's ``processed_logprobs``, which also renormalises over the nucleus when top_p < 1). Runs LoRA checkpoints
on vLLM's LoRA support, reloads weights in place, and is what `--engine auto` picks when vLLM imports and a GPU
is present. vLLM is imported only when an engine starts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from rlkit.engines import Capabilities, EngineOptions, Generated, register
from rlkit.errors import RlkitError


def vllm_import_error() -> str | None:
    """Why `import vllm` fails here, or None when it imports."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # any failure (missing, broken torchvision, ABI) means: no vLLM here
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def checkpoint_dtype(policy: Path, asked: str) -> str:
    """`--dtype auto` means the dtype the checkpoint was saved in (vLLM's own 'auto' would run an fp32
    checkpoint in bf16, and the log-probs it logs would no longer be the trainer's)."""
    if asked != "auto":
        return asked
    import json

    cfg = json.loads((Path(policy) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")


def _prompt_seed(seed: int, i: int) -> int:
    """A well-spread 31-bit seed per prompt; vLLM seeds the n samples of a prompt seed+0 .. seed+n-1."""
    h = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (2**31 - 2**16)


@register("vllm")
class VLLMEngine:
    """`vllm.LLM` over the checkpoint directory; prompts go in as token ids, samples come back as
    token ids with the log-prob of each sampled token (`logprobs=0`: the sampled token only).

    A LoRA checkpoint (`rlkit.training.lora`) runs on vLLM's LoRA support (the CPU backend's too): the engine loads
    the hash-verified base and sends the adapter as a `LoRARequest` with every generate call; a reload to
    another adapter on the same base swaps the request (no weights move). With `EngineOptions.lora` "merge",
    an adapter above vLLM's largest rank (512), or an adapter on another base than the weights the engine
    holds, the merged weights are written to a temporary directory and loaded from there instead."""

    # sleep mode: not implemented here (and vLLM has it on CUDA, ROCm and XPU only, not its CPU backend)
    capabilities = Capabilities(logprobs_match_trainer=False, supports_lora=True, supports_sleep=False)
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
        pass  # every EngineOptions knob is vLLM's

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
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout may carry our table
        if not on_gpu:
            # vLLM's CPU backend sizes its KV cache from this (GiB); its default asks for more memory than a
            # small shared machine has free
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        util = opts.gpu_memory_utilization or (0.9 if on_gpu else 0.3)
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.policy = Path(policy).absolute()  # the checkpoint whose weights the engine holds now (see `reload`)
        self.trust_remote_code = opts.trust_remote_code
        self.lora_request = None  # the adapter sent with every generate call (a LoRA checkpoint on vLLM's LoRA)
        self._lora_ids, self._tmp = 0, None  # LoRARequest ids used; the temporary merged weights held now
        self.weights, lora_kw = self.policy, {}  # the plain weights (directory) loaded into the engine
        from rlkit.training import lora

        if lora.is_adapter_dir(self.policy):
            base, _ = lora.verify_base(self.policy)
            max_rank = lora.vllm_rank(lora.adapter_rank(self.policy))
            if opts.lora == "adapter" and max_rank is not None:
                self.weights, lora_kw = base, {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
            else:
                self.weights = self._tmp = self._merge(self.policy)
        self.max_lora_rank = lora_kw.get("max_lora_rank", 0)
        w = self.weights
        self.llm = LLM(model=str(w), tokenizer=str(w), dtype=checkpoint_dtype(w, opts.dtype), tensor_parallel_size=opts.tp,
                       gpu_memory_utilization=util, max_model_len=opts.max_model_len, enforce_eager=opts.enforce_eager,
                       seed=opts.seed, logprobs_mode="processed_logprobs", trust_remote_code=opts.trust_remote_code,
                       worker_extension_cls=f"{__name__}.VLLMWorkerExtension", **lora_kw)
        if lora_kw:
            self._use_adapter(self.policy)

    def _merge(self, d: Path) -> Path:
        """LoRA checkpoint `d` merged into its base, in a fresh temporary directory (removed once replaced)."""
        import tempfile

        from rlkit.training import lora

        out = Path(tempfile.mkdtemp(prefix="rlkit-lora-merged-"))
        try:
            lora.write_merged(d, out, self.trust_remote_code)
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

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed) -> Generated:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                 seed=_prompt_seed(seed, i), logprobs=0, detokenize=False)
                  for i in range(len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        ids, fins, lps = [], [], []
        for o in outs:
            for c in sorted(o.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise RlkitError("vLLM returned no log-prob for some sampled tokens; cannot log pi_old")
                ids.append(toks)
                lps.append([float(d[t].logprob) for d, t in zip(c.logprobs, toks, strict=True)])
                fins.append("eos" if toks and toks[-1] == self.eos else "length")
        return Generated(ids, fins, lps)

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

        from rlkit.training import lora

        model_dir = Path(model_dir).absolute()  # vLLM takes a path it cannot find for a Hugging Face Hub id
        if not model_dir.is_dir() or not any(model_dir.glob("*.safetensors")):
            raise RlkitError(f"cannot reload the vLLM engine from {model_dir}: no *.safetensors there")
        t0 = time.perf_counter()
        weights = model_dir
        if lora.is_adapter_dir(model_dir):
            base, _ = lora.verify_base(model_dir)
            if base == self.weights and lora.adapter_rank(model_dir) <= self.max_lora_rank:
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
