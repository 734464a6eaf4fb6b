# rlkit for GPU machines: CUDA PyTorch from vLLM's image, rlkit with the vllm extra, entrypoint `rlkit`.
#   docker build -t rlkit:0.1.0 .
#   docker run --gpus all --rm -v "$PWD/runs:/runs" rlkit:0.1.0 rollout --policy /runs/sft --n 8 --out /runs/r.arrow
#   docker run --gpus all --rm --ipc=host -v "$PWD/runs:/runs" --entrypoint torchrun rlkit:0.1.0 \
#     --nproc-per-node 8 -m rlkit update --policy /runs/sft --in /runs/scored.arrow --out /runs/round-1
# Hub ids (`--model Qwen/Qwen2.5-0.5B-Instruct`) download into the container's Hugging Face cache; mount one
# to keep them (-v "$HOME/.cache/huggingface:/home/rlkit/.cache/huggingface"), and add -e HF_HUB_OFFLINE=1
# to run from that cache alone on a machine without network.
# The base image brings CUDA, a CUDA build of torch and vLLM that match each other; rlkit adds its own
# dependencies on top (pip keeps the image's torch and vllm when they satisfy rlkit's ranges).
FROM vllm/vllm-openai:v0.11.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bubblewrap: the sandbox the code task runs model-written programs in (docs/sandbox.md); a container needs
# namespace syscalls allowed to use it, e.g. `docker run --security-opt seccomp=unconfined ...` (docs/install.md)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/rlkit
COPY pyproject.toml README.md ./
COPY rlkit ./rlkit
COPY stages ./stages
# rlkit itself, from this checkout: its dependency ranges are in pyproject.toml (DL3013 wants a pin for a name)
# hadolint ignore=DL3013
RUN python3 -m pip install ".[vllm,track]" \
    && rlkit --version

RUN useradd --create-home --uid 1000 rlkit
USER 1000
WORKDIR /runs
ENTRYPOINT ["rlkit"]
CMD ["--help"]
