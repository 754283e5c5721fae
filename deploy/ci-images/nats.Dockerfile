# Stand-in for nats:2.10-alpine (no registry here): Debian's nats-server, with wget for
# the compose health check. The compose command (`-c FILE`) is nats-server's arguments.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends nats-server wget \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 4222 6222 8222
ENTRYPOINT ["/usr/sbin/nats-server"]
CMD ["-c", "/etc/nats/nats-server.conf"]
