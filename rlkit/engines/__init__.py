"""Rollout engines as plug-ins: every engine implements the `Engine` protocol (start on a checkpoint, `sample`
token ids with the log-prob of each sampled token, `reload` another checkpoint's weights in place, `close`, and
`sleep` / `wake_up` where it can release its GPU memory between batches) and declares its `Capabilities` as a
class attribute; `@register("name")` puts the class under its `--engine` name in `ENGINES`. Stages look engines
up by name (`create`, `choose` for `--engine auto`) and ask `capabilities(name)` what one can do; none names an
engine class. This module imports neither torch nor vLLM, so `update` can ask
`capabilities(manifest["engine"]).logprobs_match_trainer` of a name recorded by `rollout` without either, and an
unknown name gets conservative answers (all False). Built in: `hf` (`hf.py`) and `vllm` (`vllm.py`); another
engine (SGLang: `sglang.py`) is one module with one decorated class, imported at the bottom of this file.
`memory.py` sizes vLLM's share of a GPU that other stages' models share. The protocol, the records and the
registry live in `base.py`, a leaf module the engine modules take their names from (not from this package, which
imports them to register them: no import circle); this package re-exports its names.
"""

# the built-in engines register themselves on import (neither module imports torch or vLLM at the top)
from rlkit.engines import hf, vllm  # noqa: F401
from rlkit.engines.base import (
    AUTO,
    CONSERVATIVE,
    ENGINES,
    FALLBACK,
    BatchStream,
    Capabilities,
    Engine,
    EngineOptions,
    Generated,
    Stream,
    capabilities,
    check,
    choose,
    create,
    get,
    names,
    register,
    stream,
)

__all__ = ["AUTO", "CONSERVATIVE", "ENGINES", "FALLBACK", "BatchStream", "Capabilities", "Engine", "EngineOptions",
           "Generated", "Stream", "capabilities", "check", "choose", "create", "get", "names", "register", "stream"]
