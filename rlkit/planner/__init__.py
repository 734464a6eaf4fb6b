"""The memory planner: what one GPU holds for a stage's work, and whether it fits, before any weight is read.

`rlkit plan STAGE [the stage's own options]` and every stage's start on a GPU ask it the same question.
For the training stages and score-ref the answer is measured: the stage's own step traced on fake tensors
at the model's real shapes (`rlkit.planner.trace`: the real Trainer / engine step, the log-prob path,
backward, AdamW, FSDP2 over a fake process group for N GPUs). vLLM's KV cache cannot be traced; for
`rollout --engine vllm` the planner uses vLLM's own accounting (its share of the GPU, the weights in the
sampling dtype, the KV cache in what is left) and says so.

Importable without torch (`rlkit --help` stays light): the traces run in a child process.
"""

from rlkit.planner.plans import (
    CONTEXT_GIB,
    FRAGMENTATION,
    GIB,
    MAX_GPUS,
    MODELS_DIR,
    SUGGEST_GPUS,
    Estimate,
    Hardware,
    Work,
    estimate,
    flags_text,
    gpu_memory_gib,
    model_config,
    on_gpu_hooks,
    parameters,
    plan_score_ref,
    plan_training,
    plan_trainings,
    plan_vllm,
    preflight,
    preflight_scoring,
    preflight_vllm,
    refuse,
    run_traces,
    scoring_dtype,
    settings_of,
    suggest_training,
    train_spec,
)

__all__ = [
    "CONTEXT_GIB",
    "Estimate",
    "FRAGMENTATION",
    "GIB",
    "Hardware",
    "MAX_GPUS",
    "MODELS_DIR",
    "SUGGEST_GPUS",
    "Work",
    "estimate",
    "flags_text",
    "gpu_memory_gib",
    "model_config",
    "on_gpu_hooks",
    "parameters",
    "plan_score_ref",
    "plan_training",
    "plan_trainings",
    "plan_vllm",
    "preflight",
    "preflight_scoring",
    "preflight_vllm",
    "refuse",
    "run_traces",
    "scoring_dtype",
    "settings_of",
    "suggest_training",
    "train_spec",
]
