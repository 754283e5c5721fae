#!/usr/bin/env bash
# Makes this machine able to run docker-compose.yml without a container registry, as
# tests/tests/compose_up.rs needs (Debian bookworm, run as root):
#
#   deploy/ci-images/setup.sh BIN_DIR
#
#  1. Debian's docker.io, docker-compose and debootstrap, when missing.
#  2. /etc/docker/daemon.json's `default-ulimits` (nofile, nproc) at this machine's hard
#     limits: a container asking for more fails in runc's setrlimit where the machine
#     lacks CAP_SYS_RESOURCE (a VM like CI's). Other settings in the file are kept.
#  3. dockerd, started in the background when no daemon answers.
#  4. The base image the Dockerfile names (debian:bookworm-slim) from
#     `debootstrap --variant=minbase bookworm` + `docker import`, and stand-ins for the
#     service images compose names (nats, redis, postgres, jaeger), built from Debian's
#     packages with the tags compose uses. Built once; rebuilt only when a file here
#     changes (each image carries the hash of this folder as a label).
#  5. toolfleet:dev from deploy/Dockerfile's runtime stage over the binaries in BIN_DIR
#     (toolfleet, toolfleet-coordinator, toolfleet-worker, toolfleet-gateway, stripped
#     on the way in), instead of the Dockerfile's own Rust build stages; rebuilt only
#     when the binaries or that stage change.
#
# Prints `ready` and exits 0 when all of this is in place. One run at a time on a machine
# (flock); every wait is bounded.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin_dir="${1:?usage: setup.sh BIN_DIR}"
cache="${TOOLFLEET_CI_CACHE:-/var/tmp/toolfleet-ci}"
docker=/usr/bin/docker   # Debian's client: its built-in BuildKit needs no buildx plugin
mkdir -p "$cache"

exec 9>"$cache/setup.lock"
flock -w 1800 9 || { echo "setup.sh: another set-up held the lock for 30 minutes" >&2; exit 1; }

# 1. Packages.
missing=()
[ -x /usr/sbin/dockerd ] && [ -x /usr/bin/docker ] || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
command -v strip >/dev/null 2>&1 || missing+=(binutils)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing ${missing[*]}"
    timeout 600 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 900 \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. default-ulimits no higher than this machine's hard limits.
mkdir -p /etc/docker
python3 - "$(ulimit -Hn)" "$(ulimit -Hu)" <<'PY'
import json, os, sys
path = "/etc/docker/daemon.json"
def limit(value):
    return 1 << 20 if value == "unlimited" else int(value)
nofile, nproc = limit(sys.argv[1]), limit(sys.argv[2])
config = {}
if os.path.exists(path):
    with open(path) as f:
        config = json.load(f)
wanted = {
    "nofile": {"Name": "nofile", "Hard": nofile, "Soft": nofile},
    "nproc": {"Name": "nproc", "Hard": nproc, "Soft": nproc},
}
if config.get("default-ulimits") != wanted:
    config["default-ulimits"] = wanted
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print("wrote", path)
PY

# 3. A daemon.
if ! timeout 20 "$docker" info >/dev/null 2>&1; then
    echo "starting dockerd (log: /var/log/toolfleet-dockerd.log)"
    # The daemon must not keep the set-up lock (fd 9) open for its whole life.
    setsid /usr/sbin/dockerd >>/var/log/toolfleet-dockerd.log 2>&1 </dev/null 9>&- &
    for _ in $(seq 120); do
        timeout 5 "$docker" info >/dev/null 2>&1 && break
        sleep 0.5
    done
    timeout 20 "$docker" info >/dev/null 2>&1 \
        || { echo "dockerd did not answer within 60 s:" >&2; tail -20 /var/log/toolfleet-dockerd.log >&2; exit 1; }
fi

# 4. The base image and the service stand-ins.
image_exists() { timeout 60 "$docker" image inspect "$1" >/dev/null 2>&1; }
label_of() {
    timeout 60 "$docker" image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true
}
base=debian:bookworm-slim
grep -q "^FROM $base AS runtime" "$repo/deploy/Dockerfile" \
    || { echo "setup.sh: deploy/Dockerfile's runtime stage is no longer FROM $base" >&2; exit 1; }
if ! image_exists "$base"; then
    mirror="$(sed -n 's/^URIs: *\([^ ]*debian\)\/*$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    echo "building $base with debootstrap from $mirror"
    rootfs="$cache/rootfs"
    rm -rf "$rootfs"
    timeout 900 debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
        || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    # As the slim image: no package lists or downloaded archives; apt accepts the
    # mirror's Release files as this machine's apt does.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    for conf in /etc/apt/apt.conf.d/*; do
        grep -q 'Check-Valid-Until' "$conf" 2>/dev/null && cp "$conf" "$rootfs/etc/apt/apt.conf.d/"
    done
    tar -C "$rootfs" -c . | timeout 300 "$docker" import \
        --change 'CMD ["bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$base" >/dev/null
    rm -rf "$rootfs"
fi

hash="$(cd "$here" && cat nats.Dockerfile redis.Dockerfile postgres.Dockerfile postgres-entrypoint.sh \
    jaeger.Dockerfile otlp_standin.py | sha256sum | cut -c1-16)"
hash="$hash-$(timeout 60 "$docker" image inspect -f '{{.Id}}' "$base" | cut -c8-19)"
# The service images compose names, each with the stand-in of its repository.
for image in $(sed -n 's/^ *image: *\([^ ]*\) *$/\1/p' "$repo/docker-compose.yml" | sort -u); do
    case "${image%%:*}" in
        nats) file=nats.Dockerfile ;;
        redis) file=redis.Dockerfile ;;
        postgres) file=postgres.Dockerfile ;;
        jaegertracing/all-in-one) file=jaeger.Dockerfile ;;
        toolfleet) continue ;;
        *) echo "setup.sh: no stand-in for $image (docker-compose.yml)" >&2; exit 1 ;;
    esac
    [ "$(label_of "$image" org.toolfleet.ci-images)" = "$hash" ] && continue
    echo "building $image from deploy/ci-images/$file"
    DOCKER_BUILDKIT=0 timeout 900 "$docker" build -q --label "org.toolfleet.ci-images=$hash" \
        -t "$image" -f "$here/$file" "$here" >/dev/null
done

# 5. toolfleet:dev over the given binaries.
context="$cache/toolfleet-context"
rm -rf "$context"
mkdir -p "$context/out" "$context/deploy"
for b in toolfleet toolfleet-coordinator toolfleet-worker toolfleet-gateway; do
    [ -x "$bin_dir/$b" ] || { echo "setup.sh: $bin_dir/$b is not built" >&2; exit 1; }
    strip -o "$context/out/$b" "$bin_dir/$b"
done
cp "$repo/deploy/probe.sh" "$context/deploy/probe.sh"
cp -r "$repo/examples" "$context/examples"
rm -rf "$context/examples/tool-crate/target"
# The runtime stage as the Dockerfile has it, its one COPY from the build stage taking
# the binaries from the context instead.
awk '/^FROM .* AS runtime/ {on = 1} on' "$repo/deploy/Dockerfile" \
    | sed 's|^COPY --from=builder /out/ /usr/local/bin/$|COPY out/ /usr/local/bin/|' > "$context/Dockerfile"
grep -q '^COPY out/ /usr/local/bin/$' "$context/Dockerfile" \
    || { echo "setup.sh: the runtime stage no longer copies /out/ from the builder" >&2; exit 1; }
! grep -q -- '--from=' "$context/Dockerfile" \
    || { echo "setup.sh: the runtime stage copies from another stage too" >&2; exit 1; }
dev_hash="$(cd "$context" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
dev_hash="$dev_hash-$(timeout 60 "$docker" image inspect -f '{{.Id}}' "$base" | cut -c8-19)"
if [ "$(label_of toolfleet:dev org.toolfleet.ci-binaries)" != "$dev_hash" ]; then
    echo "building toolfleet:dev from deploy/Dockerfile's runtime stage"
    # BuildKit for COPY --chmod; the base image is local, never pulled.
    DOCKER_BUILDKIT=1 timeout 900 "$docker" build -q --label "org.toolfleet.ci-binaries=$dev_hash" \
        -t toolfleet:dev "$context" >/dev/null
fi
rm -rf "$context"
echo ready
