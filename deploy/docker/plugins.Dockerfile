# The user's own packages on top of a farm image (`farm images build --with PATH`, farm/plugins.py):
# the offline worker image, or a learner image given with --learner-image. No registry, no index:
# the build context is a wheelhouse the host filled, the plug-ins' wheels and those of their
# dependencies the base image lacks, with plugins.txt naming the plug-ins.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# the base image's user, to return to after installing as root
ARG RUN_AS=root
USER root
COPY . /tmp/plugins
RUN python -m pip install --quiet --no-cache-dir --root-user-action=ignore --no-index \
      --find-links /tmp/plugins \
      -r /tmp/plugins/plugins.txt \
 && rm -rf /tmp/plugins
USER ${RUN_AS}
