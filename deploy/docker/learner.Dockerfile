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
COPY locks ./locks
COPY broker ./broker
COPY workers ./workers
COPY envs ./envs
COPY sandbox ./sandbox
COPY inference ./inference
COPY learner ./learner
COPY farm ./farm
COPY bench ./bench
COPY launch ./launch
COPY examples ./examples
# Everything from locks/gpu.txt (farm/lock.py), hashes checked, except what the base image
# brings and keeps (--keep-stack: its torch, CUDA libraries and vLLM, which the farm's vLLM
# routes are tested against); what the base has at the lock's version stays as it is. Then the
# project, built with the locked setuptools, and the lock check printed into the build log:
# the kept packages whose version is not the lock's, and anything else that differs.
RUN python3 -m farm.lock requirements --lock gpu --keep-stack > /tmp/locked.txt \
 && pip install --require-hashes --no-deps -r /tmp/locked.txt \
 && pip install --no-deps --no-build-isolation . \
 && python3 -m farm.lock check --lock gpu --keep-stack --report \
 && rm /tmp/locked.txt

EXPOSE 9102
ENTRYPOINT ["python", "-m", "learner"]
CMD ["--help"]
