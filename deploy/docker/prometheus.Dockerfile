# Prometheus of the compose stack, built offline by `farm images build`: the debootstrap base
# of the sandbox image plus Debian's prometheus package (the same 2.42 build as the host's
# promtool, which checks deploy/prometheus in the tests).
ARG BASE
FROM ${BASE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && install -d -o prometheus -g prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
