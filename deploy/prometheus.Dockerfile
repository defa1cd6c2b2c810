# Prometheus for compose.yml's `monitoring` profile, from Debian's `prometheus` package on the same base image as
# nesa-node (no image registry needed). Its build installs the package, so it needs Debian's mirror:
#
#   docker build --network host -f deploy/prometheus.Dockerfile -t nesa-node-prometheus:bookworm deploy
#
# The scrape configuration is deploy/prometheus.yml, mounted by compose.yml.
ARG BASE_IMAGE=nesa-node-base:bookworm
FROM ${BASE_IMAGE}
# moment-timezone's data folder (about 200 MB of JSON, one copy per tz release) is not used: the web UI loads the
# library's bundled build (moment-timezone-with-data.min.js)
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /usr/share/doc/* \
        /usr/share/javascript/moment-timezone/data
USER prometheus
VOLUME ["/var/lib/prometheus"]
EXPOSE 9090
# promtool of Debian 12 has no `check healthy`; the base image's Python asks /-/healthy (the listen address of
# compose.yml)
HEALTHCHECK --interval=10s --timeout=5s --retries=3 CMD ["python3.11", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/-/healthy', timeout=4)"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2"]
