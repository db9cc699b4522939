# Sandbox image for registries with network access. CI and air-gapped hosts build
# the same image offline with `python -m sandbox.image build` (a debootstrap
# rootfs); this file is the equivalent for a normal build pipeline.
# The container runs the stdlib-only agent as a non-root user; the pool starts it
# with network_mode=none, a read-only root, a tmpfs work dir, cap_drop=ALL and
# no-new-privileges, so nothing here needs privileges.
# Build from the repository root:
#   docker build -f deploy/docker/sandbox.Dockerfile -t rollout-farm/sandbox .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10002 sandbox \
 && mkdir -p /opt/agent /work \
 && chown sandbox:sandbox /work
COPY sandbox /opt/agent/sandbox
USER sandbox
WORKDIR /work
ENTRYPOINT ["python", "-I", "-m", "sandbox.agent"]
