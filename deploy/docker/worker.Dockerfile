# Rollout worker image (also runs the CPU policy server and `farm`).
# CPU only: torch comes from the PyTorch CPU wheel index so no CUDA wheels are pulled.
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t rollout-farm/worker .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# The Docker CLI is not needed (workers use the Docker SDK over the socket);
# bubblewrap is the sandbox fallback where no engine is reachable.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap ca-certificates \
 && rm -rf /var/lib/apt/lists/*

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
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch \
 && pip install ".[train,sandbox]"

RUN useradd --create-home --uid 10001 farm
USER farm
EXPOSE 9101
ENTRYPOINT ["python", "-m", "workers"]
CMD ["--help"]
