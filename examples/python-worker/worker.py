"""A toolfleet worker in Python serving one tool, `text.stats`.

Written against docs/PROTOCOL.md (section 7, worker obligations) only. It uses nats-py
for JetStream and redis-py (asyncio) for the tool registry.

Settings (environment, same names as the Rust worker):
  TOOLFLEET_NATS_URL            nats://127.0.0.1:4222
  TOOLFLEET_NATS_USER / _PASSWORD  optional credentials
  TOOLFLEET_REDIS_URL           redis://127.0.0.1:6379/
  TOOLFLEET_PREFIX              fleet
  TOOLFLEET_WORKER_ID           py-<hostname>-<pid>-<6 hex>
  TOOLFLEET_WORKER_CONCURRENCY  8
  TOOLFLEET_HEARTBEAT_MS        2000
  TOOLFLEET_ACK_WAIT_MS         5000
  TOOLFLEET_MAX_RESULT_BYTES    524288
  TOOLFLEET_SHUTDOWN_GRACE_MS   10000

Run: pip install -r requirements.txt && python3 worker.py   (SIGTERM or Ctrl-C stops it)
"""

import asyncio
import json
import os
import re
import signal
import socket
import sys
import time
import uuid
from datetime import datetime, timezone

import nats
import redis.asyncio as aioredis
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError


class ToolError(Exception):
    """A tool failure with a stable code (PROTOCOL.md 3.5)."""

    def __init__(self, code, message, retryable=False):
        super().__init__(message)
        self.code, self.message, self.retryable = code, message, retryable


# ----- the tool -------------------------------------------------------------------------

DEFINITION = {
    "name": "text.stats",
    "description": "Counts the words, sentences and characters of a text",
    "input_schema": {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "The text to count."}},
        "required": ["text"],
        "additionalProperties": False,
    },
    "output_schema": {
        "type": "object",
        "properties": {
            "words": {"type": "integer"},
            "sentences": {"type": "integer"},
            "characters": {"type": "integer"},
        },
        "required": ["words", "sentences", "characters"],
    },
    "waiting_hint": "counting the words",
    "timeout_ms": 2000,
    "retry": {"idempotent": True, "max_attempts": 3},
    "tenant_scoped": False,
}


async def text_stats(job):
    """Returns (result, summary) for one call."""
    text = job["call"].get("arguments", {}).get("text")
    if not isinstance(text, str):
        raise ToolError("bad_arguments", "arguments: `text` must be a string")
    words = len(text.split())
    sentences = len([s for s in re.split(r"[.!?]+", text) if s.strip()])
    result = {"words": words, "sentences": sentences, "characters": len(text)}
    noun = "word" if words == 1 else "words"
    return result, f"That text has {words} {noun}."


# ----- protocol -------------------------------------------------------------------------


def env_int(name, default):
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        sys.exit(f"{name}={value!r} is not an integer")


NATS_URL = os.environ.get("TOOLFLEET_NATS_URL", "").strip() or "nats://127.0.0.1:4222"
NATS_USER = os.environ.get("TOOLFLEET_NATS_USER", "").strip() or None
NATS_PASSWORD = os.environ.get("TOOLFLEET_NATS_PASSWORD", "").strip() or None
REDIS_URL = os.environ.get("TOOLFLEET_REDIS_URL", "").strip() or "redis://127.0.0.1:6379/"
PREFIX = os.environ.get("TOOLFLEET_PREFIX", "").strip() or "fleet"
WORKER_ID = os.environ.get("TOOLFLEET_WORKER_ID", "").strip() or (
    f"py-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
)
CONCURRENCY = max(env_int("TOOLFLEET_WORKER_CONCURRENCY", 8), 1)
HEARTBEAT = env_int("TOOLFLEET_HEARTBEAT_MS", 2000) / 1000
ACK_WAIT = env_int("TOOLFLEET_ACK_WAIT_MS", 5000) / 1000
MAX_RESULT_BYTES = env_int("TOOLFLEET_MAX_RESULT_BYTES", 512 * 1024)
SHUTDOWN_GRACE = env_int("TOOLFLEET_SHUTDOWN_GRACE_MS", 10000) / 1000
PUBLISH_ATTEMPTS = 3
RETRY_DELAY = 0.1

NAME = DEFINITION["name"]
IDEMPOTENT = DEFINITION["retry"]["idempotent"]
MAX_ATTEMPTS = max(DEFINITION["retry"]["max_attempts"], 1)
JOBS_STREAM, RESULTS_STREAM = f"{PREFIX.upper()}_JOBS", f"{PREFIX.upper()}_RESULTS"
JOB_SUBJECT = f"{PREFIX}.jobs.{NAME}"
DURABLE = "tool_" + "".join("_" if c in ".*>" or c.isspace() else c for c in NAME)
TOOLS_KEY = f"{PREFIX}:{{registry}}:tools"
WORKERS_KEY = f"{PREFIX}:{{registry}}:workers:{NAME}"


def now_ms():
    return int(time.time() * 1000)


def rfc3339():
    now = datetime.now(timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log(message):
    print(f"[{WORKER_ID}] {message}", file=sys.stderr, flush=True)


async def ensure_stream(js, name, subject):
    """Section 7.1 step 1: create the stream only if it is missing."""
    try:
        await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[subject],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=120,
                max_age=3600,
            )
        )


async def beat(r):
    """Section 7.1 step 3: definition, liveness, pruning; one pipeline."""
    t = now_ms()
    async with r.pipeline(transaction=False) as p:
        p.hset(TOOLS_KEY, NAME, json.dumps(DEFINITION))
        p.zadd(WORKERS_KEY, {WORKER_ID: t + int(3 * HEARTBEAT * 1000)})
        p.zremrangebyscore(WORKERS_KEY, "-inf", t)
        await p.execute()


def failure(base, state, code, message, retryable):
    return {**base, "ok": False, "state": state, "result": None,
            "error": {"code": code, "message": message, "retryable": retryable}}


async def publish_result(js, msg, job, result):
    """Section 7.8: publish through JetStream, wait for the ack, then ack the job."""
    body = json.dumps(result).encode()
    if len(body) > MAX_RESULT_BYTES:
        small = failure(
            {k: result.get(k) for k in ("tool_call_id", "name", "started_at", "ended_at",
                                        "duration_ms", "attempts", "worker_id", "parent_id")
             if result.get(k) is not None},
            "error", "result_too_large",
            f"result is {len(body)} bytes, the limit is {MAX_RESULT_BYTES}", False)
        small.setdefault("duration_ms", 0)
        small.setdefault("attempts", result.get("attempts", 0))
        body = json.dumps(small).encode()
    call_id = job["call"]["id"]
    headers = {"Nats-Msg-Id": f"{job['turn_id']}.{call_id}",
               "Fleet-Turn-Id": job["turn_id"], "Fleet-Call-Id": call_id}
    for attempt in range(1, PUBLISH_ATTEMPTS + 1):
        try:
            await js.publish(f"{PREFIX}.results.{job['turn_id']}", body, headers=headers)
            await msg.ack()
            return
        except Exception as e:  # noqa: BLE001 - any publish failure is retried
            log(f"publishing the result failed (attempt {attempt}): {e}")
            await asyncio.sleep(0.1 * attempt)
    await msg.nak(delay=0.5)


async def handle(nc, js, msg):
    try:
        job = json.loads(msg.data)
        call = job["call"]
        deadline = int(job["deadline_unix_ms"])
    except (ValueError, KeyError, TypeError):
        log("undecodable job; terminating it")
        await msg.term()
        return
    attempt = msg.metadata.num_delivered or 1
    if now_ms() >= deadline:  # 7.3
        await msg.ack()
        return
    base = {"tool_call_id": call["id"], "name": call["name"], "attempts": attempt,
            "worker_id": WORKER_ID, "started_at": None, "ended_at": None, "duration_ms": 0}
    if call.get("parent_id"):
        base["parent_id"] = call["parent_id"]
    if attempt > 1 and not IDEMPOTENT:  # 7.4
        result = failure(base, "error", "call_interrupted",
                         "the call's worker stopped mid-call and the tool is not idempotent, "
                         "so it was not run again", False)
        result["ended_at"] = rfc3339()
        await publish_result(js, msg, job, result)
        return

    notice = {"kind": "started", "tool_call_id": call["id"], "name": call["name"],
              "attempt": attempt, "worker_id": WORKER_ID}
    try:  # 7.5, best effort
        await nc.publish(f"{PREFIX}.progress.{job['turn_id']}", json.dumps(notice).encode())
    except Exception as e:  # noqa: BLE001
        log(f"started notice not sent: {e}")

    async def keepalive():  # 7.6
        while True:
            await asyncio.sleep(max(ACK_WAIT / 3, 0.05))
            await msg.in_progress()

    ka = asyncio.create_task(keepalive())
    started_at, start = rfc3339(), time.monotonic()
    tool_budget = max(min(int(job["timeout_ms"]), DEFINITION["timeout_ms"]), 1)
    turn_budget = deadline - now_ms()
    budget = min(tool_budget, turn_budget)
    try:  # 7.7
        value, summary = await asyncio.wait_for(text_stats(job), max(budget, 1) / 1000)
        result = {**base, "ok": True, "state": "done", "result": value, "error": None}
        if summary:
            result["summary"] = summary
    except asyncio.TimeoutError:
        code = "tool_timeout" if tool_budget <= turn_budget else "deadline_exceeded"
        result = failure(base, "timeout", code, f"no result within {budget} ms", True)
    except ToolError as e:
        if (e.retryable and IDEMPOTENT and attempt < MAX_ATTEMPTS
                and now_ms() + 2 * RETRY_DELAY * 1000 < deadline):
            ka.cancel()
            await msg.nak(delay=RETRY_DELAY)
            return
        result = failure(base, "error", e.code, e.message, e.retryable)
    except Exception as e:  # noqa: BLE001 - a crash of the tool is tool_panicked
        result = failure(base, "error", "tool_panicked", f"the tool raised: {e!r}", False)
    finally:
        ka.cancel()
    result.update(started_at=started_at, ended_at=rfc3339(),
                  duration_ms=int((time.monotonic() - start) * 1000))
    await publish_result(js, msg, job, result)


async def main():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    options = {"servers": [u.strip() for u in NATS_URL.split(",") if u.strip()],
               "name": f"toolfleet-python-worker {WORKER_ID}"}
    if NATS_USER:
        options.update(user=NATS_USER, password=NATS_PASSWORD)
    nc = await nats.connect(**options)
    js = nc.jetstream()
    await ensure_stream(js, JOBS_STREAM, f"{PREFIX}.jobs.>")
    await ensure_stream(js, RESULTS_STREAM, f"{PREFIX}.results.>")
    sub = await js.pull_subscribe(
        JOB_SUBJECT, durable=DURABLE, stream=JOBS_STREAM,
        config=ConsumerConfig(
            durable_name=DURABLE, filter_subject=JOB_SUBJECT, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT, max_ack_pending=10000,
            max_deliver=MAX_ATTEMPTS if IDEMPOTENT else 2))
    r = aioredis.from_url(REDIS_URL)
    await beat(r)
    await nc.publish(f"{PREFIX}.registry.changed", b"")  # 7.1 step 4
    await nc.flush()
    log(f"serving {NAME}")
    print("ready", flush=True)

    async def heartbeat():  # 7.1 step 5
        while True:
            await asyncio.sleep(HEARTBEAT)
            try:
                await beat(r)
            except Exception as e:  # noqa: BLE001
                log(f"heartbeat failed: {e}")

    beats = asyncio.create_task(heartbeat())
    slots = asyncio.Semaphore(CONCURRENCY)
    in_flight = set()

    async def run(m):
        try:
            await handle(nc, js, m)
        finally:
            slots.release()

    while not stop.is_set():  # 7.2
        await slots.acquire()
        free = 1
        while free < CONCURRENCY and not slots.locked():
            await slots.acquire()
            free += 1
        try:
            msgs = await sub.fetch(free, timeout=1)
        except (NatsTimeoutError, asyncio.TimeoutError):
            msgs = []
        except Exception as e:  # noqa: BLE001 - a failed pull is retried
            log(f"pull failed: {e}")
            msgs = []
            await asyncio.sleep(0.2)
        for m in msgs:
            task = asyncio.create_task(run(m))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        for _ in range(free - len(msgs)):
            slots.release()

    # 7.9: stop fetching, let in-flight calls finish, withdraw, announce, flush.
    if in_flight:
        await asyncio.wait(in_flight, timeout=SHUTDOWN_GRACE)
    beats.cancel()
    try:
        await r.zrem(WORKERS_KEY, WORKER_ID)
    except Exception as e:  # noqa: BLE001
        log(f"could not withdraw from the registry: {e}")
    await nc.publish(f"{PREFIX}.registry.changed", b"")
    await nc.flush(timeout=2)
    await nc.close()
    await r.aclose()
    log("stopped")


if __name__ == "__main__":
    asyncio.run(main())
