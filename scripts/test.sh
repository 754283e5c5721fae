#!/usr/bin/env bash
# The test command: installs what the tests need and is missing, then runs every test.
#
#   scripts/test.sh                 # all of them
#   scripts/test.sh -p toolfleet-tests --test hostile_credentials   # cargo test's own arguments
#
# The tests start their own nats-server, redis-server, Prometheus, Chromium, PostgreSQL
# databases (on the machine's PostgreSQL), iptables partitions (as root) and callgrind
# runs; on a Debian machine without them this installs the packages first (as root).
# Python, Node and kubectl packages are not installed here: the tests that need them
# provision their own environments under the target directory and reuse them.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v psql >/dev/null 2>&1 || missing+=(postgresql)
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing+=(prometheus)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
{ command -v valgrind && command -v callgrind_control; } >/dev/null 2>&1 || missing+=(valgrind)
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: ${missing[*]} (run as root, or: sudo apt-get install -y ${missing[*]})" >&2
    exit 1
  fi
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# A PostgreSQL that is installed but stopped is started (the tests create their
# databases on it).
if command -v pg_isready >/dev/null 2>&1 && ! pg_isready -q -h 127.0.0.1 2>/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v pg_ctlcluster >/dev/null 2>&1; then
    version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1)"
    [ -n "$version" ] && pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
fi

# Builds stay warm across runs outside the clone. Every clone path builds its own copy
# of the workspace's crates, so debug info is kept to line tables (backtraces keep file
# and line) and incremental data is not written; a target directory whose disk has less
# than 30 GiB left is started afresh.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/toolfleet-target}"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
mkdir -p "$CARGO_TARGET_DIR"
free_kib="$(df --output=avail -k "$CARGO_TARGET_DIR" | tail -1 | tr -d ' ')"
if [ "${free_kib:-0}" -lt $((30 * 1024 * 1024)) ]; then
  echo "under 30 GiB free beside $CARGO_TARGET_DIR: starting it afresh"
  rm -rf "$CARGO_TARGET_DIR"
  mkdir -p "$CARGO_TARGET_DIR"
fi

# docker-compose (Debian's 1.29) must accept the compose file; tests/tests/manifests.rs
# checks the file's contents and tests/tests/compose_up.rs runs it. Compose refuses to
# start without the passwords; any value validates the file.
TOOLFLEET_NATS_COORDINATOR_PASSWORD=ci TOOLFLEET_NATS_WORKER_PASSWORD=ci \
  TOOLFLEET_NATS_FRONTEND_PASSWORD=ci TOOLFLEET_NATS_FRONTEND2_PASSWORD=ci \
  TOOLFLEET_NATS_GATEWAY_PASSWORD=ci TOOLFLEET_POSTGRES_PASSWORD=ci \
  TOOLFLEET_GATEWAY_DB_PASSWORD=ci TOOLFLEET_GATEWAY_STREAM_TOKEN_PASSWORD=ci \
  TOOLFLEET_REDIS_PASSWORD=ci TOOLFLEET_REDIS_WORKER_PASSWORD=ci \
  TOOLFLEET_REDIS_EXPORTER_PASSWORD=ci TOOLFLEET_REDIS_REPLICATION_PASSWORD=ci \
  TOOLFLEET_REDIS_ADMIN_PASSWORD=ci \
  docker-compose -f docker-compose.yml config -q

# With no arguments, every test of the workspace: the doc tests first, on their own
# (later test binaries build this checkout's command-line binaries into the same target
# directory, tests/src/fleet.rs, which would rewrite libraries rustdoc was about to
# link), then the tests of the libraries, binaries and test targets. That includes
# tests/tests/compose_up.rs, which brings docker-compose.yml up for real: it installs
# docker.io and debootstrap when missing, starts dockerd and builds the images it needs
# (deploy/ci-images/setup.sh, kept between runs): 3 to 5 minutes warm, about 2.5 more
# the first time on a machine.
#
# First of all, the budget (docs/budget.json): instructions per turn of coordinator +
# worker + client and Redis's commands per turn, counted by callgrind on a release build
# with tracing on; more than 2 % over fails the run (docs/BENCHMARKS.md, "The budget").
if [ "$#" -eq 0 ]; then
  cargo build --release --quiet -p toolfleet-dev
  "$CARGO_TARGET_DIR/release/toolfleet-dev" budget --out "$CARGO_TARGET_DIR/bench/budget-report.json"
  cargo test --workspace --doc
  set -- --workspace --lib --bins --tests
fi
exec cargo test "$@"
