#!/usr/bin/env bash
# Where one turn's time goes, hop by hop, read off the spans the fleet exports.
#
#   scripts/timeline.sh [--phase overhead|parallel] [--keep DIR] [BINARY]
#
# BINARY is a release build of the developer tools (default
# target/release/toolfleet-dev). The script
# starts its own nats-server -js (with its monitoring port, for message counts) and
# redis-server on free loopback ports, a coordinator and a worker (test pack) exporting
# every span over OTLP/HTTP to a sink of its own that decodes them, and drives them with
# `toolfleet-dev bench --attach --phases overhead` (its 4,000 turns of three test.noop calls
# at concurrency 1, after its warm-up); `--phase parallel` drives the parallel phase
# instead (turns of three 50 ms test.behave calls, each followed by three test.noop
# calls after 50 ms idle). It then groups the spans by trace and prints, per tool and
# step of a turn, the median over the turns of that step's duration, with the messages
# nats-server handled per turn. All timestamps come from
# one host's clock (both processes run here). `--keep DIR` keeps the decoded spans
# (`spans.jsonl`, one span per line) and the bench's report. Everything it starts is
# stopped when it exits; it takes 15-30 s.
set -euo pipefail

keep=""
phase=overhead
binary=""
while [ $# -gt 0 ]; do
  case "$1" in
    --keep) keep="$2"; shift 2 ;;
    --phase) phase="$2"; shift 2 ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    *) binary="$1"; shift ;;
  esac
done
cd "$(dirname "$0")/.."
binary="${binary:-${CARGO_TARGET_DIR:-target}/release/toolfleet-dev}"
case "$phase" in overhead|parallel) ;; *) echo "--phase takes overhead or parallel" >&2; exit 2 ;; esac
[ -x "$binary" ] || { echo "no executable at $binary (cargo build --release -p toolfleet-dev)" >&2; exit 2; }
for tool in nats-server redis-server python3; do
  command -v "$tool" >/dev/null || { echo "$tool is needed (apt-get install -y nats-server redis-server python3)" >&2; exit 2; }
done

work="$(mktemp -d -t toolfleet-timeline-XXXXXX)"
pids=()
cleanup() {
  for pid in ${pids[@]+"${pids[@]}"}; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    alive=0
    for pid in ${pids[@]+"${pids[@]}"}; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for pid in ${pids[@]+"${pids[@]}"}; do kill -9 "$pid" 2>/dev/null || true; done
  if [ -n "$keep" ]; then
    mkdir -p "$keep" && cp "$work"/spans.jsonl "$work"/bench.json "$keep"/ 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# shellcheck source=scripts/ports.sh
. scripts/ports.sh

nats_port="$(free_port)"; monitor_port="$(free_port)"; redis_port="$(free_port)"; sink_port="$(free_port)"
nats-server -a 127.0.0.1 -p "$nats_port" -m "$monitor_port" -js -sd "$work/js" >"$work/nats.log" 2>&1 &
pids+=($!); disown
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!); disown

# An OTLP/HTTP sink that decodes each trace export into spans.jsonl.
python3 scripts/otlp_sink.py "$sink_port" "$work/spans.jsonl" >"$work/sink.log" 2>&1 &
pids+=($!); disown
wait_port "$nats_port"; wait_port "$redis_port"; wait_port "$sink_port"; wait_port "$monitor_port"
nats="nats://127.0.0.1:$nats_port"; redis="redis://127.0.0.1:$redis_port/"

prefix="tft$$"
# Only this script's sink and service names: no exporter, sampler or name settings of
# the caller's reach the processes.
for name in $(env | sed -n 's/^\(OTEL_[A-Z0-9_]*\)=.*/\1/p'); do unset "$name"; done
export TOOLFLEET_HTTP_ADDR=off TOOLFLEET_RETENTION_MS=60000 RUST_LOG=warn
export OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$sink_port" OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf
"$binary" --nats "$nats" --redis "$redis" --prefix "$prefix" coordinator >"$work/coordinator.log" 2>&1 &
coordinator=$!; pids+=($coordinator); disown
TOOLFLEET_WORKER_ID="$prefix-worker" "$binary" --nats "$nats" --redis "$redis" --prefix "$prefix" \
  worker --packs test >"$work/worker.log" 2>&1 &
worker=$!; pids+=($worker); disown
unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_EXPORTER_OTLP_PROTOCOL

varz() { python3 -c "
import json, sys, urllib.request
v = json.load(urllib.request.urlopen('http://127.0.0.1:$monitor_port/varz'))
print(v['in_msgs'], v['out_msgs'])"; }
before="$(varz)"
"$binary" --nats "$nats" --redis "$redis" --prefix "$prefix" bench --attach --given-servers \
  --phases "$phase" --out "$work/bench.json" >"$work/bench.log" 2>&1 \
  || { cat "$work/bench.log" >&2; exit 1; }
after="$(varz)"
# The batch span processors export at least every few seconds: wait for the last batch.
sleep 6
kill "$coordinator" "$worker" 2>/dev/null || true
for _ in $(seq 1 50); do
  kill -0 "$coordinator" 2>/dev/null || kill -0 "$worker" 2>/dev/null || break
  sleep 0.1
done

python3 - "$work/spans.jsonl" "$work/bench.json" "$before" "$after" <<'EOF'
import collections, json, statistics, sys

spans_file, bench_file, before, after = sys.argv[1:5]
traces = collections.defaultdict(list)
for line in open(spans_file):
    s = json.loads(line)
    traces[s.get("trace")].append(s)

def starting(spans, prefix, service=None):
    return sorted((s for s in spans if s.get("name", "").startswith(prefix)
                   and (service is None or s["service"] == service)), key=lambda s: s["start"])

steps = collections.defaultdict(list)
whole = 0
closed_ahead = 0
for spans in traces.values():
    turn = starting(spans, "turn")
    create = starting(spans, "EVALSHA CREATE")
    jobs = starting(spans, "publish ", "toolfleet-coordinator")
    delivered = starting(spans, "process ", "toolfleet-worker")
    executed = starting(spans, "execute_tool ")
    received = starting(spans, "process ", "toolfleet-coordinator")
    recorded = starting(spans, "EVALSHA RECORD")
    join = starting(spans, "join")
    narrate = starting(spans, "narrate")
    if not (turn and create and join and narrate) or len(jobs) != 3 or len(delivered) != 3 \
            or len(executed) != 3 or len(received) != 3 or len(recorded) != 3:
        continue
    whole += 1
    first_exec = min(executed, key=lambda s: s["end"])
    first_result = received[0]
    last_record_end = max(s["end"] for s in recorded)
    ms = lambda a, b: (b - a) / 1e6
    tool = executed[0]["name"].split()[-1]
    add = lambda name, a, b: steps[(tool, name)].append(ms(a, b))
    t = turn[0]
    add("1 take the request (decode, validate, plan) until CREATE", t["start"], create[0]["start"])
    add("2 CREATE round trip to Redis", create[0]["start"], create[0]["end"])
    add("3 ack sent and the first job published after CREATE", create[0]["end"], jobs[0]["start"])
    add("4 first job: publish until its stream ack", jobs[0]["start"], jobs[0]["end"])
    add("5 first job: publish until the worker takes it (JetStream)", jobs[0]["start"], delivered[0]["start"])
    add("6 worker: first job taken until its tool runs", delivered[0]["start"], executed[0]["start"])
    add("7 tool", first_exec["start"], first_exec["end"])
    add("8 first result: tool end until the coordinator takes it (JetStream)", first_exec["end"], first_result["start"])
    add("9 first result: RECORD round trip to Redis", recorded[0]["start"], recorded[0]["end"])
    add("10 worker: first to third job taken", delivered[0]["start"], delivered[2]["start"])
    add("11 coordinator: first to third result taken", received[0]["start"], received[2]["start"])
    last_record = max(recorded, key=lambda s: s["end"])
    # Closed ahead: the narration ran under the completing result's span, not under join.
    ahead = not any(n.get("parent") == join[0]["id"] for n in narrate)
    closed_ahead += ahead
    add("12 last RECORD round trip to Redis", last_record["start"], last_record["end"])
    add("13 narration (template narrator)", narrate[0]["start"], narrate[0]["end"])
    add("14 last RECORD answered until the join ends (STORE_FINAL unless closed ahead, events, mark sent)",
        last_record_end, join[0]["end"])
    add("turn span, first to last instant", t["start"], t["end"])

(in0, out0), (in1, out1) = (map(int, x.split()) for x in (before, after))
print(f"turns of three calls, tracing on: {whole} with every span, {closed_ahead} of them closed ahead "
      "(closing events stored by the last RECORD)")
overhead = json.load(open(bench_file))["modes"][0].get("overhead")
if overhead:
    print(f"client p50 ms: ack {overhead['ack']['p50_ms']:.3f}, first done "
          f"{overhead['first_done']['p50_ms']:.3f}, last done {overhead['last_done']['p50_ms']:.3f}, "
          f"final {overhead['turn']['p50_ms']:.3f}")
turns = sum(1 for spans in traces.values() if starting(spans, "turn")) or 1
print(f"nats-server messages per turn: {(in1 - in0) / turns:.1f} in, {(out1 - out0) / turns:.1f} out")
print()
def order(key):
    tool, name = key
    head = name.split()[0]
    return (tool, not head.isdigit(), int(head) if head.isdigit() else 0)
print("| tool | step | p50 ms | p90 ms |")
print("|---|---|---|---|")
for key in sorted(steps, key=order):
    v = sorted(steps[key])
    print(f"| {key[0]} | {key[1]} | {statistics.median(v):.3f} | {v[int(len(v) * 0.9)]:.3f} |")
EOF
