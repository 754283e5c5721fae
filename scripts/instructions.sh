#!/usr/bin/env bash
# Instructions per turn of the coordinator, the worker and the client, counted by
# valgrind's callgrind: a yardstick that does not move with the machine's load.
#
#   scripts/instructions.sh [--tracing on|off] [--redis] [--out FILE] [--keep DIR] [BINARY]
#
# BINARY is a release build of the developer tools (default
# target/release/toolfleet-dev). The script
# starts its own nats-server -js and redis-server on free loopback ports, runs a
# coordinator and a worker (test pack) under callgrind, and drives them twice with
# `toolfleet-dev bench --attach --phases overhead` (turns of three test.noop calls at
# concurrency 1), itself under callgrind: a short run and a long one. Each process's
# count is fitted as fixed + per_turn × turns over the two runs, so start-up, the
# catalog wait and the report fall out of the per-turn figure. With `--tracing on` the
# coordinator and the worker export every span over OTLP/HTTP to a sink the script runs.
# `--keep DIR` keeps the callgrind files there (`callgrind_annotate` reads them; the
# long run's window of each server process is its `.out.2` dump). Everything it starts
# is stopped when it exits; it takes a minute or two. `--redis` runs redis-server under
# callgrind too and reports its instructions per turn apart (`redis`, not in `all`): the
# join's scripts, read on a stable number (Redis's own timer, ten times a second, adds a
# little in proportion to the run's length). It slows every Redis round trip many times,
# so the other processes' figures of such a run are not compared with a run without it.
set -euo pipefail

tracing=off
out=""
keep=""
binary=""
redis_counted=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tracing) tracing="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    --redis) redis_counted=1; shift ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    *) binary="$1"; shift ;;
  esac
done
cd "$(dirname "$0")/.."
binary="${binary:-${CARGO_TARGET_DIR:-target}/release/toolfleet-dev}"
[ -x "$binary" ] || { echo "no executable at $binary (cargo build --release -p toolfleet-dev)" >&2; exit 2; }
case "$tracing" in on|off) ;; *) echo "--tracing takes on or off" >&2; exit 2 ;; esac
for tool in valgrind callgrind_control nats-server redis-server python3; do
  command -v "$tool" >/dev/null || { echo "$tool is needed (apt-get install -y valgrind nats-server redis-server python3)" >&2; exit 2; }
done

work="$(mktemp -d -t toolfleet-instructions-XXXXXX)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  # Processes under callgrind take a while to stop; at most 10 s, then SIGKILL.
  for _ in $(seq 1 100); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  if [ -n "$keep" ]; then
    mkdir -p "$keep" && cp "$work"/*.out* "$keep"/ 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# shellcheck source=scripts/ports.sh
. scripts/ports.sh

nats_port="$(free_port)"; redis_port="$(free_port)"; sink_port="$(free_port)"
nats-server -a 127.0.0.1 -p "$nats_port" -js -sd "$work/js" >"$work/nats.log" 2>&1 &
pids+=($!); disown
redis_under=()
if [ "$redis_counted" = 1 ]; then
  redis_under=(valgrind --tool=callgrind --callgrind-out-file="$work/redis.%p.out")
fi
${redis_under[@]+"${redis_under[@]}"} redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
  >"$work/redis.log" 2>&1 &
redis_pid=$!; pids+=($redis_pid); disown
wait_port "$nats_port"; wait_port "$redis_port"
nats="nats://127.0.0.1:$nats_port"; redis="redis://127.0.0.1:$redis_port/"

if [ "$tracing" = on ]; then
  # An OTLP/HTTP sink that accepts every export (an empty protobuf response is success).
  python3 scripts/otlp_sink.py "$sink_port" >"$work/sink.log" 2>&1 &
  pids+=($!); disown
  wait_port "$sink_port"
  export OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$sink_port"
  export OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf
else
  unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_EXPORTER_OTLP_TRACES_ENDPOINT OTEL_EXPORTER_OTLP_METRICS_ENDPOINT
fi

prefix="tfi$$"
export TOOLFLEET_HTTP_ADDR=off TOOLFLEET_RETENTION_MS=60000 RUST_LOG=warn
# The command line that runs a program under callgrind with its output named after $1.
callgrind() { echo "valgrind --tool=callgrind --callgrind-out-file=$work/$1.%p.out"; }
$(callgrind coordinator) "$binary" --nats "$nats" --redis "$redis" --prefix "$prefix" coordinator \
  >"$work/coordinator.log" 2>&1 &
coordinator=$!; pids+=($coordinator); disown
TOOLFLEET_WORKER_ID="$prefix-worker" $(callgrind worker) "$binary" --nats "$nats" --redis "$redis" \
  --prefix "$prefix" worker --packs test >"$work/worker.log" 2>&1 &
worker=$!; pids+=($worker); disown
# The OTLP exporters of the processes under test stay out of the client.
unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_EXPORTER_OTLP_PROTOCOL

# Instructions counted by callgrind in process $1 since its counters were last zeroed.
counted() {
  callgrind_control -d "$1" >/dev/null 2>&1
  local dump
  dump="$(ls -t "$work"/*."$1".out.* | head -1)"
  awk '/^summary:/ {print $2}' "$dump"
}

# One client run: its turns, and each process's instructions over it.
run() {
  local name="$1"; shift
  callgrind_control -z "$coordinator" >/dev/null 2>&1
  callgrind_control -z "$worker" >/dev/null 2>&1
  [ "$redis_counted" = 1 ] && callgrind_control -z "$redis_pid" >/dev/null 2>&1
  $(callgrind "client-$name") "$binary" --nats "$nats" --redis "$redis" --prefix "$prefix" \
    bench --attach --given-servers --phases overhead --out "$work/$name.json" "$@" \
    >"$work/$name.log" 2>&1 || { cat "$work/$name.log" >&2; exit 1; }
  local turns
  turns="$(python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
o = d['modes'][0]['overhead']
print(d['plan']['overhead_warmup'] + o['turn']['count'] + o['failed'])" "$work/$name.json")"
  local client
  client="$(awk '/^summary:/ {print $2}' "$work"/client-"$name".*.out)"
  local redis_count=0
  [ "$redis_counted" = 1 ] && redis_count="$(counted "$redis_pid")"
  echo "$name $turns $(counted "$coordinator") $(counted "$worker") $client $redis_count"
}

echo "counting instructions (tracing $tracing); this takes a few minutes" >&2
# Callgrind dumps: every process must be up before the first zeroing.
watched=("$coordinator" "$worker")
[ "$redis_counted" = 1 ] && watched+=("$redis_pid")
for pid in "${watched[@]}"; do
  for _ in $(seq 1 600); do
    callgrind_control "$pid" >/dev/null 2>&1 && break
    sleep 0.1
  done
done
short="$(run short --quick)"
long="$(run long)"

python3 - "$short" "$long" "$tracing" "$binary" "${out}" <<'EOF'
import json, sys, datetime, platform
short, long = (line.split() for line in sys.argv[1:3])
tracing, binary, out = sys.argv[3], sys.argv[4], sys.argv[5]
n1, n2 = int(short[1]), int(long[1])
if n2 <= n1:
    sys.exit(f"the long run had {n2} turns, the short one {n1}: no fit")
report = {"tracing": tracing, "binary": binary, "turns": [n1, n2],
          "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": platform.machine(), "per_turn": {}, "fixed": {}}
for i, role in enumerate(["coordinator", "worker", "client"], start=2):
    a, b = int(short[i]), int(long[i])
    per_turn = (b - a) / (n2 - n1)
    report["per_turn"][role] = round(per_turn)
    report["fixed"][role] = round(a - per_turn * n1)
report["per_turn"]["all"] = sum(report["per_turn"].values())
if int(long[5]) > 0:
    a, b = int(short[5]), int(long[5])
    report["redis"] = {"per_turn": round((b - a) / (n2 - n1)),
                       "fixed": round(a - (b - a) / (n2 - n1) * n1)}
print(f"instructions per turn of three test.noop calls, tracing {tracing} "
      f"(callgrind, runs of {n1} and {n2} turns):")
print("| process | instructions per turn |")
print("|---|---|")
for role, count in report["per_turn"].items():
    print(f"| {role} | {count:,} |")
if "redis" in report:
    print(f"| redis-server (apart) | {report['redis']['per_turn']:,} |")
if out:
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"JSON: {out}")
EOF
