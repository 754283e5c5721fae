#!/usr/bin/env bash
# Instructions per message round of the NATS client alone, counted by valgrind's
# callgrind: the yardstick of vendor/async-nats/PATCH.md.
#
#   scripts/nats-client-instructions.sh [ASYNC_NATS_DIR]
#
# ASYNC_NATS_DIR is a copy of the client to measure (default vendor/async-nats; a
# worktree's copy of an older commit compares builds). The script builds a small program
# against it in a temporary crate of its own and starts its own nats-server -js on a free
# loopback port. One round publishes a 200-byte payload with a fleet job's six headers on
# core NATS and receives it back (HPUB written, HMSG parsed), then publishes it to a
# memory-storage JetStream stream and awaits the ack. The program runs under callgrind at
# 500 and 1,500 rounds; the difference over 1,000 is printed, start-up falling out.
# CARGO_TARGET_DIR, when set, keeps the build between runs.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
client="$(cd "${1:-$root/vendor/async-nats}" && pwd)"
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install -y valgrind" >&2; exit 2; }
command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || { echo "nats-server not found: apt-get install -y nats-server" >&2; exit 2; }
nats_server="$(command -v nats-server || echo /usr/sbin/nats-server)"

work="$(mktemp -d)"
server=""
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/crate/src" "$work/js"
cat >"$work/crate/Cargo.toml" <<EOF
[package]
name = "nats-client-instructions"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
async-nats = { package = "toolfleet-async-nats", path = "$client", default-features = false, features = ["ring", "jetstream"] }
bytes = "1"
futures = "0.3"
tokio = { version = "1", features = ["rt", "macros", "time"] }

[profile.release]
debug = "line-tables-only"

[workspace]
EOF
cat >"$work/crate/src/main.rs" <<'EOF'
use async_nats::HeaderMap;
use futures::StreamExt;

fn job_headers(i: usize) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    h.insert("Nats-Msg-Id", format!("turn-1234567890abcdef:call_{i}").as_str());
    h.insert("Toolfleet-Turn-Id", "turn-1234567890abcdef");
    h.insert("Toolfleet-Call-Id", format!("call_{i}").as_str());
    h.insert("Toolfleet-Tenant", "demo");
    h.insert("Toolfleet-Deadline", "1790000000000");
    h
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect("a NATS URL");
    let rounds: usize = args.next().and_then(|n| n.parse().ok()).expect("a round count");
    let client = async_nats::connect(url).await.expect("connect");
    let payload = bytes::Bytes::from(vec![b'x'; 200]);
    let mut sub = client.subscribe("bench.core").await.expect("subscribe");
    for i in 0..rounds {
        client
            .publish_with_headers("bench.core", job_headers(i), payload.clone())
            .await
            .expect("publish");
        let message = sub.next().await.expect("a message");
        assert!(message.headers.is_some_and(|h| h.get("Toolfleet-Tenant").is_some()));
    }
    let js = async_nats::jetstream::new(client.clone());
    let _ = js.delete_stream("BENCH").await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "BENCH".into(),
        subjects: vec!["bench.js".into()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("stream");
    for i in 0..rounds {
        let ack = js
            .publish_with_headers("bench.js", job_headers(i), payload.clone())
            .await
            .expect("publish");
        ack.await.expect("ack");
    }
    let _ = js.delete_stream("BENCH").await;
}
EOF

echo "building against $client" >&2
target="${CARGO_TARGET_DIR:-$work/target}"
(cd "$work/crate" && CARGO_TARGET_DIR="$target" cargo build --release -q)
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$nats_server" -js -a 127.0.0.1 -p "$port" -sd "$work/js" >"$work/nats.log" 2>&1 &
server=$!
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done

count() {
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$1" \
    "$target/release/nats-client-instructions" "nats://127.0.0.1:$port" "$1" >/dev/null 2>"$work/cg.$1.log"
  awk '/^(summary|totals):/ {print $2; exit}' "$work/cg.$1"
}
short="$(count 500)"
long="$(count 1500)"
echo "instructions per round: $(( (long - short) / 1000 )) (500 rounds: $short, 1500 rounds: $long)"
