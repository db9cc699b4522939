# Sandbox image for build pipelines with registry access. CI and air-gapped hosts
# build the equivalent image offline with `python -m sandbox.image build` (a
# debootstrap rootfs plus the same agent layer); point the workers at this one with
# the sandbox config's `image` field.
# The container runs the stdlib-only agent package (sandbox/agent/); the pool runs it
# as root with four capabilities so each session gets its own uid; the pool
# starts it with network_mode=none, a read-only root, tmpfs /work, cap_drop=ALL and
# no-new-privileges, so nothing here needs privileges.
# Build from the repository root:
#   docker build -f deploy/docker/sandbox.Dockerfile -t rollout-farm/sandbox:registry .
FROM debian:bookworm-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /work /run/agent
COPY sandbox/agent /opt/agent/agent
USER 65534:65534
WORKDIR /work
CMD ["python3", "-I", "-S", "/opt/agent/agent", "--socket-dir", "/run/agent", "--work-dir", "/work"]
