# Rollout worker image of the compose stack (also runs the CPU policy server, the CPU
# learner, `farm` and the tiny-model writer). Built offline by `farm images build`, on top
# of the Python environment of python.Dockerfile (PYTHON_IMAGE, tagged by content), so a
# change in the project's source rebuilds only this thin layer.
# Build context: the project files listed in farm/images.py (SOURCES).
ARG PYTHON_IMAGE
FROM ${PYTHON_IMAGE}

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
COPY examples ./examples
# The dependencies are in the base already; the project installs without a network.
RUN pip install --quiet --no-deps --no-index --no-build-isolation . \
 && useradd --create-home --uid 10001 farm \
 && install -d -o farm -g farm /weights /checkpoints /archive
# Empty named volumes mounted on /weights, /checkpoints and /archive take this ownership.
USER farm
EXPOSE 9101
ENTRYPOINT ["python", "-m", "workers"]
CMD ["--help"]
