"""The `hf` engine: Hugging Face `generate` (`rlkit.engines.generation`) on the policy loaded in this process, fp32, on
`--device` (the CPU or one GPU: `rlkit.devices.resolve`). Its log-probs are the trainer's own forward pass; a LoRA
checkpoint runs merged. `--engine auto`'s fallback. It has no sleep mode: `sleep` does nothing and says so.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlkit.engines.base import Capabilities, EngineOptions, Generated, register
from rlkit.errors import RlkitError


@register("hf")
class HFEngine:
    """Hugging Face `generate`: batched by a token budget, KV cache, left padding, stop at EOS."""

    capabilities = Capabilities(logprobs_match_trainer=True, supports_lora=False, supports_sleep=False,
                                streams_tickers=True, optional_logprobs=True)
    auto_rank = 0  # the fallback: never preferred, always possible
    auto_reason = "the fallback"

    dtype = "fp32"

    def __init__(self, model, tokenizer, batch_tokens: int = 16384) -> None:
        from rlkit import devices

        self.model, self.tokenizer, self.batch_tokens = model, tokenizer, batch_tokens
        self.device = devices.model_device(model)

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    @classmethod
    def check_options(cls, opts: EngineOptions) -> None:
        if opts.tp != 1 or opts.gpu_memory_utilization or opts.max_model_len or opts.enforce_eager or opts.colocate:
            raise RlkitError("--tp, --gpu-memory-utilization, --colocate, --max-model-len and --enforce-eager are vLLM "
                             "options; pass --engine vllm (or auto) with them")

    @classmethod
    def start(cls, policy: Path, opts: EngineOptions) -> HFEngine:
        from rlkit import devices
        from rlkit.io import checkpoints

        if opts.dtype not in ("auto", "fp32"):
            raise RlkitError(f"--dtype {opts.dtype}: the hf engine samples in fp32 (pass --engine vllm for other dtypes)")
        device = devices.resolve(opts.device)  # before the load: a GPU this machine lacks is one line, at once
        model, tokenizer = checkpoints.load_policy(policy, "fp32", opts.trust_remote_code, merged=True)  # LoRA: merged
        return cls(model.to(device), tokenizer, opts.batch_tokens)

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed, stop=(), ticker=None,
               logprobs: bool = True) -> Generated:
        """The protocol's `sample`; `logprobs=False` (greedy evaluation) keeps no logits (`Generated.logprobs` None)."""
        from rlkit.engines.generation import generate

        greedy = temperature == 0
        return generate(self.model, self.tokenizer, prompt_ids, max_new_tokens=max_new_tokens, n=n, greedy=greedy,
                        temperature=1.0 if greedy else temperature, top_p=top_p, seed=seed,
                        batch_tokens=self.batch_tokens, logprobs=logprobs, stop=stop, ticker=ticker)

    @property
    def context(self) -> int | None:
        """The longest sequence the model takes (prompt + completion): its max_position_embeddings."""
        n = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None

    def reload(self, model_dir: Path) -> float:
        """Copy checkpoint `model_dir`'s weights into the live model (a LoRA checkpoint: merged); the seconds."""
        from rlkit.io.checkpoints import load_weights_into

        t0 = time.perf_counter()
        load_weights_into(self.model, model_dir)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Drop the model (its memory goes with the last reference; on a GPU, torch's cache of it goes back to the
        driver, so a stage started after this one ends finds it free)."""
        self.model = None
        if self.device.type == "cuda":
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()

    def sleep(self) -> bool:
        return False  # no sleep mode (supports_sleep=False): the model stays where it is

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        return None
