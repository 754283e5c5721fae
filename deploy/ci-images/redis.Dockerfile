# Stand-in for redis:7.2-alpine: Debian's redis-server and redis-cli, run from /data as the
# official image does (compose runs `sh /etc/redis/start.sh ...`).
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
