# Python environment of the compose stack's CPU image, built offline by `farm images build`:
# the debootstrap base of the sandbox image (Debian's python3, no registry pull) plus a
# virtual environment holding exactly what locks/cpu.txt pins for the project's runtime extras
# (farm/images.py: a wheelhouse that the build downloads on the host under the lock's pins;
# torch is the 2.13.0 CPU wheel). Build context: the wheelhouse directory, holding the wheels
# and requirements.txt, the lock's lines for them, hashes included: pip installs nothing else
# (--no-deps) and refuses a file whose hash is not the lock's.
# The wheels are copied in a first stage only, so the final image does not carry them.
ARG BASE
FROM ${BASE} AS install
COPY . /tmp/wheels
RUN python3 -m venv --without-pip /opt/venv \
 && /opt/venv/bin/python "$(ls /tmp/wheels/pip-*.whl)/pip" install --quiet --no-index \
      --find-links /tmp/wheels pip \
 && /opt/venv/bin/pip install --quiet --no-index --find-links /tmp/wheels \
      --require-hashes --no-deps -r /tmp/wheels/requirements.txt

FROM ${BASE}
COPY --from=install /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
