"""The engine protocol and registry, a leaf module: the `Engine` protocol, what an engine returns (`Generated`),
what it can do (`Capabilities`), what `rollout` passes it (`EngineOptions`), and the registry (`register`, `ENGINES`,
`names`, `get`, `capabilities`, `check`, `choose`, `create`), and `Stream`, how an engine takes requests one at a time
(`stream`: the engine's own, or `BatchStream` over its `sample`). The engine modules (`hf.py`, `vllm.py`, `generation.py`)
import from here, never from the package `rlkit.engines`, which imports them to register them (so no import
circle). Imports neither torch nor vLLM. Callers use `rlkit.engines`, which re-exports every name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from rlkit.errors import RlkitError


@dataclass
class Generated:
    """Completions in prompt-major order: row i*n + j is sample j of prompt i."""

    completion_ids: list[list[int]]  # ends with eos when finish_reason == "eos", with the stop string's tokens on "stop"
    finish_reasons: list[str]  # "eos" | "stop" (a stop string ended it) | "length" (max_new_tokens or the context)
    logprobs: list[list[float]] | None  # log pi(token) under the sampling distribution
    # 1 on tokens the policy sampled, 0 on tokens an environment appended (`rlkit.sampling`'s multi-turn rows);
    # None: every token was sampled (what an engine's `sample` returns)
    loss_mask: list[list[int]] | None = None


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, known from its name alone. Every default is the conservative answer."""

    # its logged log-probs are the trainer's own (fp32 forward pass, same kernels): `update --old-logprobs
    # auto` may keep them instead of recomputing pi_old
    logprobs_match_trainer: bool = False
    # runs a LoRA checkpoint as its base plus the adapter (a reload to another adapter on that base moves no
    # weights); otherwise the engine runs the merged weights
    supports_lora: bool = False
    # can release its accelerator memory between batches and take it back (`sleep`, `wake_up`: vLLM's sleep mode,
    # on CUDA only); `rollout --follow --max-lag 0` puts it to sleep while update trains
    supports_sleep: bool = False
    # its `sample` takes `ticker=`, a progress bar it advances batch by batch (the driver advances one that does not
    # once the call returns)
    streams_tickers: bool = False
    # its `sample` takes `logprobs=False` and then keeps none (greedy evaluation reads none)
    optional_logprobs: bool = False
    # its own `stream` takes requests as they become ready and runs them together (vLLM's continuous batching):
    # `--env-schedule auto` is `ready` on it, `turns` elsewhere
    continuous_batching: bool = False


CONSERVATIVE = Capabilities()


@dataclass(frozen=True)
class EngineOptions:
    """What `rlkit rollout` passes to the engine it starts; an engine ignores the knobs it has no use for,
    and refuses in `check_options` those it cannot honour."""

    seed: int = 0  # the engine's global seed (each `sample` call gets its own too)
    trust_remote_code: bool = False
    batch_tokens: int = 16384  # token budget per generation batch (hf)
    tp: int = 1  # tensor-parallel size
    # None: the engine's default (vllm: sized by `colocate` on a GPU, else memory.DEFAULT_SHARE; 0.3 on its CPU backend)
    gpu_memory_utilization: float | None = None
    dtype: str = "auto"  # auto: the checkpoint's dtype
    max_model_len: int | None = None  # None: the model's context length
    enforce_eager: bool = False  # skip CUDA graph capture (faster start, slower steps)
    # a LoRA checkpoint on an engine with `supports_lora`: "adapter" runs base + adapter, "merge" the merged
    # weights (written to a temporary directory)
    lora: str = "adapter"
    device: str = "auto"  # --device (rlkit.devices): where the model runs; vllm takes its own GPU and checks this
    # model directories other processes run on the same GPU meanwhile (score-ref's --ref and --rm): vllm leaves
    # them room (rlkit.engines.memory)
    colocate: tuple[Path, ...] = ()
    plan: bool = True  # vllm on a GPU: refuse (exit 71) a share that cannot hold the weights and one sequence's KV cache
    sleep: bool = False  # an engine with supports_sleep is built able to `sleep` (vllm: sleep mode, on CUDA only)


class Engine(Protocol):
    """An engine class registered with `@register(name)`. Instances come from `start` (via `create`)."""

    name: ClassVar[str]  # its --engine name (set by `register`)
    capabilities: ClassVar[Capabilities]
    # --engine auto: 0 never picks it (the fallback `hf` is picked when nothing else is); among engines with a
    # positive rank, the highest whose `unavailable()` is None wins, and `auto_reason` says why
    auto_rank: ClassVar[int]
    auto_reason: ClassVar[str]
    tokenizer: Any  # the checkpoint's tokenizer: the rollout stage decodes completions with it
    # said on stderr and recorded in the manifest by rollout (which resolves --device for an engine without them):
    device: Any  # the torch.device the model runs on (the first GPU of a tensor-parallel engine)
    dtype: str  # what it computes in: fp32, bf16, fp16

    @classmethod
    def unavailable(cls) -> str | None:
        """Why `--engine auto` should not pick this engine here (None: it may); heavy imports allowed."""
        ...

    @classmethod
    def check_options(cls, opts: EngineOptions) -> None:
        """Raise RlkitError for options this engine cannot honour, before anything starts (--engine NAME)."""
        ...

    @classmethod
    def start(cls, policy: Path, opts: EngineOptions) -> Engine:
        """The engine running checkpoint directory `policy` (plain or LoRA)."""
        ...

    def sample(self, prompt_ids: Sequence[list[int]], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int, seed: int, stop: Sequence[str] = ()) -> Generated:
        """Row i*n + j of the result is sample j of prompt i; logprobs are always filled, under the
        temperature-scaled distribution; the same seed gives the same samples. Temperature 0 is greedy decoding.
        `stop`: strings that end a completion once its text contains one (finish reason "stop"; the completion
        keeps the tokens that wrote it: a tool call ends with its closing tag)."""
        ...

    def reload(self, model_dir: Path) -> float:
        """Load checkpoint `model_dir`'s weights into the live engine (`rollout --follow`); the seconds it took."""
        ...

    # Optional: `stream(temperature=, top_p=, max_new_tokens=, stop=)` -> a `Stream` taking requests one at a time as
    # they become ready (vLLM: continuous batching). An engine without it runs the driver's `--env-schedule ready`
    # through `BatchStream` over its `sample`.

    def close(self) -> None:
        """Release the engine (worker processes, accelerator memory) now; safe to call twice."""
        ...

    def sleep(self) -> bool:
        """Release the accelerator memory the engine holds (weights kept in host memory, KV cache dropped) until
        `wake_up`; False, doing nothing, when it cannot (not started with `EngineOptions.sleep`, or no GPU). Rollout
        calls it only on an engine whose `capabilities.supports_sleep`; these defaults are what one without does."""
        return False

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take the memory back after `sleep` (a no-op when awake): all of it, or only that of `tags` ("weights",
        "kv_cache": vLLM's names); `sample` wakes the engine too, and `reload` wakes what the load needs."""
        return None


class Stream(Protocol):
    """Requests that come and go one at a time (`rlkit.sampling`'s `--env-schedule ready`): `submit` a prompt with
    its own seed, `poll` for those that finished (blocking for some progress: one engine step, or one batch)."""

    pending: int  # submitted and not yet returned by poll

    def submit(self, key: Any, prompt_ids: list[int], seed: int) -> None: ...

    def poll(self) -> list[tuple[Any, list[int], list[float] | None, str]]:
        """(key, completion ids, their log-probs, finish reason) of each request that finished."""
        ...

    def abort(self) -> None:
        """Drop every pending request (the stage is failing)."""
        ...


class BatchStream:
    """A `Stream` over an engine's `sample`: `poll` samples every request submitted since the last one in one call
    (in key order), seeded by its requests' own seeds (so the same requests together give the same samples)."""

    def __init__(self, engine, *, temperature: float, top_p: float, max_new_tokens: int, stop: Sequence[str] = ()):
        self.engine, self.waiting = engine, []
        self.kw = dict(n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                       **({"stop": tuple(stop)} if stop else {}))

    @property
    def pending(self) -> int:
        return len(self.waiting)

    def submit(self, key, prompt_ids: list[int], seed: int) -> None:
        self.waiting.append((key, list(prompt_ids), seed))

    def poll(self) -> list[tuple[Any, list[int], list[float] | None, str]]:
        import hashlib

        batch, self.waiting = sorted(self.waiting, key=lambda r: r[0]), []
        if not batch:
            return []
        h = hashlib.blake2b(",".join(str(s) for _, _, s in batch).encode(), digest_size=4).digest()
        gen = self.engine.sample([p for _, p, _ in batch], seed=int.from_bytes(h, "little") >> 1, **self.kw)
        lps = gen.logprobs or [None] * len(batch)
        return [(k, ids, lp, fin) for (k, _, _), ids, lp, fin in zip(batch, gen.completion_ids, lps,
                                                                     gen.finish_reasons, strict=True)]

    def abort(self) -> None:
        self.waiting = []


def stream(engine, *, temperature: float, top_p: float, max_new_tokens: int, stop: Sequence[str] = ()) -> Stream:
    """The engine's own `stream` (vLLM), else a `BatchStream` over its `sample` (hf)."""
    own = getattr(engine, "stream", None)
    make = own if callable(own) else lambda **kw: BatchStream(engine, **kw)
    return make(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop=tuple(stop))


AUTO = "auto"
FALLBACK = "hf"  # what --engine auto runs when no engine with a positive auto_rank is available
ENGINES: dict[str, type[Engine]] = {}

E = TypeVar("E")


def register(name: str) -> Callable[[E], E]:
    """Class decorator: put an Engine class under `--engine name` (its `name` attribute is set to it)."""

    def deco(cls: E) -> E:
        if name == AUTO or name in ENGINES:
            raise ValueError(f"engine name {name!r} is taken")
        cls.name = name  # type: ignore[attr-defined]
        ENGINES[name] = cls  # type: ignore[assignment]
        return cls

    return deco


def names() -> tuple[str, ...]:
    """Every value `--engine` takes: auto, then the registered engines in registration order."""
    return (AUTO, *ENGINES)


def get(name: str) -> type[Engine]:
    """The engine class registered as `name`; RlkitError naming the choices otherwise."""
    if name not in ENGINES:
        raise RlkitError(f"--engine {name!r} is not one of {', '.join(names())}")
    return ENGINES[name]


def capabilities(name: str | None) -> Capabilities:
    """What engine `name` (e.g. a rollouts manifest's `engine`) can do; conservative for an unknown name or None."""
    cls = ENGINES.get(name) if name else None
    return cls.capabilities if cls is not None else CONSERVATIVE


def check(name: str, opts: EngineOptions) -> None:
    """`--engine name` is known and, when named explicitly (not auto), its engine accepts `opts`."""
    if name != AUTO:
        get(name).check_options(opts)
    # auto: nothing to check yet; the options the chosen engine cannot honour are left to it at `start`


def choose(name: str) -> tuple[str, str]:
    """Resolve `--engine` to a registered name, with the reason (said on stderr by the stage)."""
    if name != AUTO:
        get(name)
        return name, "asked for"
    first_why = None
    for cls in sorted((c for c in ENGINES.values() if c.auto_rank > 0), key=lambda c: -c.auto_rank):
        why = cls.unavailable()
        if why is None:
            return cls.name, f"auto: {cls.auto_reason}"
        first_why = first_why or why
    return FALLBACK, f"auto: {first_why or 'no other engine is registered'}"


def create(name: str, policy: Path, opts: EngineOptions | None = None) -> Engine:
    """Start engine `name` (not auto: `choose` first) on checkpoint directory `policy`."""
    return get(name).start(Path(policy), opts or EngineOptions())
