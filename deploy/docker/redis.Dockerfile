# Redis of the compose stack, built offline by `farm images build`: the debootstrap base of
# the sandbox image plus Debian's redis-server from the apt mirror the base names.
ARG BASE
FROM ${BASE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && install -d -o redis -g redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--dir", "/data", "--protected-mode", "no"]
