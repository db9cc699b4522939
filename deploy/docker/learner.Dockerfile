# Learner image: CUDA, torch and vLLM from the vLLM OpenAI server image, plus the
# project. The same image serves `vllm serve` (compose service `vllm`) so that the
# learner and the inference servers agree on the vLLM and torch versions that the
# weight-sync routes (VLLM_SERVER_DEV_MODE=1) depend on.
# Build from the repository root:
#   docker build -f deploy/docker/learner.Dockerfile -t rollout-farm/learner .
# vLLM 0.33.x: the RL routes, weight_versions and the NCCL trainer API the farm uses (docs/inference.md).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/farm
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY workers ./workers
COPY envs ./envs
COPY sandbox ./sandbox
COPY inference ./inference
COPY learner ./learner
COPY farm ./farm
COPY bench ./bench
COPY launch ./launch
# torch is already in the base image with its CUDA build; installing the project
# without dependencies' upgrades keeps it (pip leaves satisfied requirements alone);
# `tracking` brings wandb and tensorboard for --tracker.
RUN pip install ".[train,tracking,data]"

EXPOSE 9102
ENTRYPOINT ["python", "-m", "learner"]
CMD ["--help"]
