"""The protocol of docs/PROTOCOL.md section 7 for a set of tools: streams, consumers kept
in line with the definitions (7.1), registry and heartbeat, pulls bounded by free slots
(7.2), deadline skips, call_interrupted, started notices, keep-alives at the bound
consumer's ack wait, time budgets, retry NAKs below the bound consumer's max_deliver,
+TERM for undecodable jobs, publishing results before acking, draining on shutdown,
the coordinators' refusals of a definition or a result read back from the registry
(2.6) and logged at ERROR once each, and turns cancelled by their callers (9.6): the
running calls' `ctx.cancelled` is set, their results dropped, later jobs skipped.
It never contains tools nor reads the environment."""

import asyncio
import json
import sys
import time
import traceback
import urllib.parse

import nats
import redis.asyncio as aioredis
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import (AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType,
                         StreamConfig)
from nats.js.errors import NotFoundError

from toolfleet_worker import Context, ToolError, now_ms, rfc3339, _ops, _tracing

PUBLISH_ATTEMPTS = 3
RETRY_DELAY = 0.1
# How long a cancelled turn is remembered (past the longest turn deadline), seconds.
CANCEL_MEMORY = 600


def _failure(base, state, code, message, retryable):
    return {**base, "ok": False, "state": state, "result": None,
            "error": {"code": code, "message": message, "retryable": retryable}}


def _root(prefix, partition):
    """2.1: the root of a stream partition's JetStream subjects."""
    return prefix if partition == 0 else f"{prefix}.p{partition}"


def _stream(prefix, kind, partition):
    """2.1: a stream partition's jobs or results stream."""
    name = f"{prefix.upper()}_{kind}"
    return name if partition == 0 else f"{name}_P{partition}"


class _Served:
    """One tool with its names and the delivery settings of its bound consumers (one per
    stream partition, each with the same settings)."""

    def __init__(self, tool, prefix, partitions):
        self.tool, self.definition = tool, tool.definition
        name = self.definition["name"]
        self.idempotent = self.definition["retry"]["idempotent"]
        # (jobs stream, job subject) of each stream partition.
        self.partitions = [(_stream(prefix, "JOBS", k), f"{_root(prefix, k)}.jobs.{name}")
                           for k in range(partitions)]
        self.durable = "tool_" + "".join("_" if c in ".*>" or c.isspace() else c for c in name)
        self.workers_key = f"{prefix}:{{registry}}:workers:{name}"
        self.max_deliver, self.ack_wait, self.subs = 1, 1.0, []


class Worker:
    def __init__(self, tools, settings):
        if not tools:
            raise ValueError("no tools to serve")
        self.s = settings
        self.served = [_Served(t, settings.prefix, settings.stream_partitions) for t in tools]
        user = urllib.parse.urlsplit(settings.redis_url.split(",")[0].strip()).username
        self.registered_by = f"{user or 'default'}/{settings.worker_id}"
        self.rejected_keys = {what: f"{settings.prefix}:{{registry}}:rejected:{what}s"
                              for what in ("definition", "result")}
        # (what, tool) -> the coordinators' refusal as last read (2.6).
        self.refusals = {}
        # 9.6: turn id -> when its cancel is forgotten (monotonic s); turn id -> the
        # `cancelled` events of its calls running here.
        self.cancelled_turns, self.running = {}, {}
        self.ops = _ops.Ops(settings.concurrency)

    def log(self, message):
        print(f"[{self.s.worker_id}] {message}", file=sys.stderr, flush=True)

    async def _ensure_stream(self, name, subject):
        try:
            await self.js.stream_info(name)
        except NotFoundError:
            # 2.3: the settings every coordinator and worker creates the streams with.
            await self.js.add_stream(StreamConfig(
                name=name, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType(self.s.stream_storage), num_replicas=self.s.stream_replicas,
                duplicate_window=120, max_age=3600, max_bytes=256 * 1024 * 1024,
                max_msg_size=8 * 1024 * 1024, discard=DiscardPolicy.NEW))

    async def _bind(self, t):
        """7.1 step 2, in every stream partition."""
        for jobs_stream, subject in t.partitions:
            t.subs.append(await self._bind_in(t, jobs_stream, subject))

    async def _bind_in(self, t, jobs_stream, subject):
        """7.1 step 2: create the consumer, or update one whose settings drifted; in
        `bind` mode wait for the coordinator to create it, never creating one."""
        wanted = ConsumerConfig(
            durable_name=t.durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.s.ack_wait, max_ack_pending=10000,
            max_deliver=t.definition["retry"]["max_attempts"] if t.idempotent else 2)
        if self.s.consumers == "bind":
            deadline, last, polls = time.monotonic() + 30, "it does not exist", 0
            while True:
                if polls % 5 == 0:
                    # Announced again every second: a coordinator that started after
                    # the first announcement learns the tool from a later one.
                    name = t.definition["name"]
                    await self.nc.publish(f"{self.s.prefix}.registry.changed.{name}", b"")
                    await self.nc.publish(f"{self.s.prefix}.registry.changed", b"")
                polls += 1
                try:
                    info = await self.js.consumer_info(jobs_stream, t.durable)
                    c = info.config
                    if c.filter_subject == subject and c.max_deliver == wanted.max_deliver:
                        break
                    last = f"it serves {c.filter_subject} with max_deliver {c.max_deliver}"
                except NotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"consumer {t.durable}: no consumer with the definition's "
                                       f"settings after 30 s (TOOLFLEET_WORKER_CONSUMERS=bind): {last}")
                await asyncio.sleep(0.2)
            t.max_deliver, t.ack_wait = info.config.max_deliver, info.config.ack_wait
            return await self.js.pull_subscribe_bind(t.durable, jobs_stream)
        try:
            info = await self.js.consumer_info(jobs_stream, t.durable)
            c = info.config
            if c.filter_subject != subject:
                raise RuntimeError(f"consumer {t.durable} serves {c.filter_subject}, not {subject}")
            drift = [f"{k} is {have} on the consumer, {want} in the definition"
                     for k, have, want in (("max_deliver", c.max_deliver, wanted.max_deliver),
                                           ("ack_wait", c.ack_wait, wanted.ack_wait),
                                           ("backoff", c.backoff or [], []))
                     if have != want]
            if drift:
                self.log(f"updating consumer {t.durable}: {'; '.join(drift)}")
                info = await self.js.add_consumer(jobs_stream, wanted)
        except NotFoundError:
            info = await self.js.add_consumer(jobs_stream, wanted)
        if info.config.max_deliver != wanted.max_deliver:
            raise RuntimeError(f"consumer {t.durable}: max_deliver is {info.config.max_deliver}, "
                               f"the definition needs {wanted.max_deliver}")
        t.max_deliver, t.ack_wait = info.config.max_deliver, info.config.ack_wait
        return await self.js.pull_subscribe_bind(t.durable, jobs_stream)

    def _write_definition(self, p, served):
        name = served.definition["name"]
        p.hset(f"{self.s.prefix}:{{registry}}:tool:{name}",
               mapping={"definition": json.dumps(served.definition), "by": self.registered_by})

    async def _beat(self):
        t = now_ms()
        async with self.redis.pipeline(transaction=False) as p:
            for served in self.served:
                self._write_definition(p, served)
                p.zadd(served.workers_key, {self.s.worker_id: t + int(3 * self.s.heartbeat * 1000)})
                p.zremrangebyscore(served.workers_key, "-inf", t)
            await p.execute()
        await self._announce()

    async def _announce(self):
        # Each tool on its own subject: a coordinator adds a name it does not know yet
        # once it finds the definition (2.6).
        for served in self.served:
            await self.nc.publish(f"{self.s.prefix}.registry.changed.{served.definition['name']}", b"")

    async def _read_refusals(self):
        """2.6: what coordinators refused of these tools; each new refusal logged once."""
        async with self.redis.pipeline(transaction=False) as p:
            for served in self.served:
                for key in self.rejected_keys.values():
                    p.hget(key, served.definition["name"])
            read = iter(await p.execute())
        for served in self.served:
            name = served.definition["name"]
            for what in self.rejected_keys:
                raw = next(read)
                refusal = json.loads(raw) if raw else None
                if refusal and self.refusals.get((what, name)) != refusal:
                    self.log(f"ERROR coordinators refused a {what} of {name}: {refusal.get('reason')}")
                if refusal or what == "definition":
                    self.refusals[(what, name)] = refusal

    async def _publish(self, msg, job, result, trace_headers=None):
        """7.8: publish through JetStream, wait for its ack, then ack the job."""
        body = json.dumps(result).encode()
        if len(body) > self.s.max_result_bytes:
            keep = ("tool_call_id", "name", "started_at", "ended_at", "duration_ms",
                    "attempts", "worker_id", "parent_id")
            base = {k: result[k] for k in keep if result.get(k) is not None}
            body = json.dumps(_failure(base, "error", "result_too_large",
                                       f"result is {len(body)} bytes, the limit is "
                                       f"{self.s.max_result_bytes}", False)).encode()
        call_id = job["call"]["id"]
        headers = {"Nats-Msg-Id": f"{job['turn_id']}.{call_id}",
                   "Fleet-Turn-Id": job["turn_id"], "Fleet-Call-Id": call_id,
                   **(trace_headers or {})}
        # The per-tool result subject (a worker user may publish only its own tools'), in
        # the stream partition the job came from: the job subject's root.
        name = job["call"]["name"]
        root = msg.subject[:-len(f".jobs.{name}")] if msg.subject.endswith(f".jobs.{name}") else self.s.prefix
        subject = f"{root}.results.{job['turn_id']}.{name}"
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await self.js.publish(subject, body, headers=headers)
                await msg.ack()
                return
            except Exception as e:  # noqa: BLE001 - any publish failure is retried
                self.log(f"publishing the result failed (attempt {attempt}): {e}")
                await asyncio.sleep(0.1 * attempt)
        await msg.nak(delay=0.5)

    def _on_cancelled(self, msg):
        """9.6: a coordinator ended a turn its caller cancelled."""
        turn_id = msg.subject.rsplit(".", 1)[-1]
        now = time.monotonic()
        if len(self.cancelled_turns) >= 1024:
            self.cancelled_turns = {k: v for k, v in self.cancelled_turns.items() if v > now}
        self.cancelled_turns[turn_id] = now + CANCEL_MEMORY
        for event in self.running.get(turn_id, ()):
            event.set()

    async def _on_cancelled_cb(self, msg):
        self._on_cancelled(msg)

    def _is_cancelled(self, turn_id):
        return self.cancelled_turns.get(turn_id, 0) > time.monotonic()

    async def _execute(self, t, job, attempt, base, cancelled, process_span=None):
        """7.7: the handler under its budget; a result, or None when the job is retried."""
        call, deadline = job["call"], int(job["deadline_unix_ms"])
        tool_budget = max(min(int(job["timeout_ms"]), t.definition["timeout_ms"]), 1)
        turn_budget = deadline - now_ms()
        budget = max(min(tool_budget, turn_budget), 1)
        ctx = Context(job.get("tenant_id"), job["turn_id"], call["id"], job.get("session_id"),
                      deadline, attempt, job.get("context") or {}, cancelled)
        name = t.definition["name"]
        with _tracing.execute(name, call["id"], job) as span:
            result = await self._outcome(t, call, ctx, attempt, base, budget, tool_budget,
                                         turn_budget, deadline)
            if result is not None and result["error"]:
                _tracing.failed([span, process_span], result["error"]["code"],
                                result["error"]["message"])
            return result

    async def _outcome(self, t, call, ctx, attempt, base, budget, tool_budget, turn_budget,
                       deadline):
        try:
            out = await asyncio.wait_for(t.tool.invoke(call.get("arguments") or {}, ctx),
                                         budget / 1000)
            result = {**base, "ok": True, "state": "done", "result": out.value, "error": None}
            if out.summary:
                result["summary"] = out.summary
            return result
        except asyncio.TimeoutError:
            code = "tool_timeout" if tool_budget <= turn_budget else "deadline_exceeded"
            return _failure(base, "timeout", code, f"no result within {budget} ms", True)
        except ToolError as e:
            if (e.retryable and t.idempotent and attempt < t.max_deliver
                    and now_ms() + 2 * RETRY_DELAY * 1000 < deadline):
                return None
            result = _failure(base, "error", e.code, e.message, e.retryable)
            if e.user_message:
                result["error"]["user_message"] = e.user_message
            return result
        except Exception as e:  # noqa: BLE001 - a crash of the tool is tool_panicked
            # The traceback goes to the log (never into the result, which the model sees).
            self.log(f"ERROR tool {call['name']} raised on call {call['id']} of turn "
                     f"{ctx.turn_id}:\n{traceback.format_exc().rstrip()}")
            return _failure(base, "error", "tool_panicked", f"the tool raised: {e!r}", False)

    async def _handle(self, t, msg):
        try:
            job = json.loads(msg.data)
            call, deadline = job["call"], int(job["deadline_unix_ms"])
        except (ValueError, KeyError, TypeError):
            self.log("undecodable job; terminating it")
            await msg.term()
            return
        attempt = msg.metadata.num_delivered or 1
        if now_ms() >= deadline:  # 7.3
            await msg.ack()
            return
        base = {"tool_call_id": call["id"], "name": call["name"], "attempts": attempt,
                "worker_id": self.s.worker_id, "duration_ms": 0}
        if call.get("parent_id"):
            base["parent_id"] = call["parent_id"]
        if attempt > 1 and not t.idempotent:  # 7.4
            result = _failure(base, "error", "call_interrupted",
                              "the call's worker stopped mid-call and the tool is not "
                              "idempotent, so it was not run again", False)
            result["ended_at"] = rfc3339()
            await self._publish(msg, job, result)
            return
        turn_id = job["turn_id"]
        if self._is_cancelled(turn_id):  # 9.6: the turn already ended
            await msg.ack()
            return
        cancelled = asyncio.Event()
        self.running.setdefault(turn_id, set()).add(cancelled)
        try:
            await self._run(t, msg, job, attempt, base, cancelled)
        finally:
            calls = self.running.get(turn_id, set())
            calls.discard(cancelled)
            if not calls:
                self.running.pop(turn_id, None)

    async def _run(self, t, msg, job, attempt, base, cancelled):
        call = job["call"]

        started_unix_ms = int(time.time() * 1000)

        async def announce(delay):  # 7.5, best effort, once the call has run `delay`
            if delay > 0:
                await asyncio.sleep(delay)
            notice = {"kind": "started", "tool_call_id": call["id"], "name": call["name"],
                      "attempt": attempt, "worker_id": self.s.worker_id,
                      "started_unix_ms": started_unix_ms}
            try:
                await self.nc.publish(f"{self.s.prefix}.progress.{job['turn_id']}.{call['name']}",
                                      json.dumps(notice).encode())
            except Exception as e:  # noqa: BLE001
                self.log(f"started notice not sent: {e}")

        announcer = None
        if self.s.running_after > 0:
            announcer = asyncio.create_task(announce(self.s.running_after))
        else:
            await announce(0)

        async def keepalive():  # 7.6: every ack_wait / 3, never more often than 50 ms
            while True:
                await asyncio.sleep(max(t.ack_wait / 3, 0.05))
                await msg.in_progress()

        ka = asyncio.create_task(keepalive())
        started, start = time.time(), time.monotonic()
        name = t.definition["name"]
        self.ops.started(name)
        result = None
        with _tracing.process(msg.subject, job, attempt, self.s.worker_id, msg.headers) as span:
            try:
                result = await self._execute(t, job, attempt, base, cancelled, span)
            finally:
                ka.cancel()
                if announcer is not None:
                    announcer.cancel()
                outcome = result["state"] if result is not None else "retry"
                self.ops.finished(name, outcome, time.monotonic() - start)
            if cancelled.is_set():  # the turn's final is out; nobody waits for this result
                await msg.ack()
                return
            if result is None:
                await msg.nak(delay=RETRY_DELAY)
                return
            result.update(started_at=rfc3339(started), ended_at=rfc3339(),
                          duration_ms=int((time.monotonic() - start) * 1000))
            await self._publish(msg, job, result, _tracing.result_headers(span, msg.headers))

    async def _pull(self, t, sub, concurrency, stop, in_flight):
        """7.2: fetch no more jobs than free slots, from one stream partition's consumer."""
        slots = asyncio.Semaphore(concurrency)

        async def one(m):
            try:
                await self._handle(t, m)
            finally:
                slots.release()

        while not stop.is_set():
            await slots.acquire()
            free = 1
            while free < concurrency and not slots.locked():
                await slots.acquire()
                free += 1
            try:
                msgs = await sub.fetch(free, timeout=1)
            except (NatsTimeoutError, asyncio.TimeoutError):
                msgs = []
            except Exception as e:  # noqa: BLE001 - a failed pull is retried
                self.log(f"pull failed: {e}")
                msgs = []
                await asyncio.sleep(0.2)
            for m in msgs:
                task = asyncio.create_task(one(m))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            for _ in range(free - len(msgs)):
                slots.release()

    async def run(self, stop):
        provider = _tracing.setup()
        # The port is bound before anything is announced: a second worker on a taken
        # port fails before it is registered.
        await self.ops.start(self.s.http_addr)
        try:
            await self._serve(stop)
        finally:
            await self.ops.close()
            if provider is not None:
                provider.shutdown()

    async def _serve(self, stop):
        options = {"servers": [u.strip() for u in self.s.nats_url.split(",") if u.strip()],
                   "name": f"toolfleet-python-worker {self.s.worker_id}"}
        if self.s.nats_user:
            options.update(user=self.s.nats_user, password=self.s.nats_password)
        inbox = self.s.nats_inbox_prefix or (f"_INBOX_{self.s.nats_user}" if self.s.nats_user else None)
        if inbox:
            options["inbox_prefix"] = inbox
        tls = self.s.nats_tls()
        if tls:
            options["tls"] = tls
        self.nc = await nats.connect(**options)
        self.js = (self.nc.jetstream(prefix=self.s.nats_js_api_prefix)
                   if self.s.nats_js_api_prefix else self.nc.jetstream())
        await self.nc.subscribe(f"{self.s.prefix}.cancelled.*", cb=self._on_cancelled_cb)
        for k in range(self.s.stream_partitions):
            root = _root(self.s.prefix, k)
            await self._ensure_stream(_stream(self.s.prefix, "JOBS", k), f"{root}.jobs.>")
            await self._ensure_stream(_stream(self.s.prefix, "RESULTS", k), f"{root}.results.>")
        self.redis = aioredis.from_url(self.s.redis_url, **self.s.redis_tls())
        if self.s.consumers == "bind":
            # The coordinator creates each consumer from the definition it reads.
            async with self.redis.pipeline(transaction=False) as p:
                for served in self.served:
                    self._write_definition(p, served)
                await p.execute()
            await self._announce()
            await self.nc.publish(f"{self.s.prefix}.registry.changed", b"")
        for t in self.served:
            await self._bind(t)
        await self._beat()
        await self.nc.publish(f"{self.s.prefix}.registry.changed", b"")
        await self.nc.flush()
        self.log(f"serving {', '.join(t.definition['name'] for t in self.served)}")

        async def heartbeat():
            while True:
                await asyncio.sleep(self.s.heartbeat)
                try:
                    await self._beat()
                    await self._read_refusals()
                except Exception as e:  # noqa: BLE001
                    self.log(f"heartbeat failed: {e}")

        beats = asyncio.create_task(heartbeat())
        in_flight = set()
        # A tool's concurrency is split between its partitions' pulls, at least 1 each.
        each = max(-(-self.s.concurrency // self.s.stream_partitions), 1)
        self.ops.pulls = [asyncio.create_task(self._pull(t, sub, each, stop, in_flight))
                          for t in self.served for sub in t.subs]
        self.ops.ready = True
        await stop.wait()
        self.ops.ready = False
        await asyncio.gather(*self.ops.pulls, return_exceptions=True)
        await self._shut_down(beats, in_flight)

    async def _shut_down(self, beats, in_flight):
        """7.9: let in-flight calls finish, withdraw, announce, flush."""
        if in_flight:
            await asyncio.wait(in_flight, timeout=self.s.shutdown_grace)
        beats.cancel()
        try:
            for t in self.served:
                await self.redis.zrem(t.workers_key, self.s.worker_id)
        except Exception as e:  # noqa: BLE001
            self.log(f"could not withdraw from the registry: {e}")
        await self.nc.publish(f"{self.s.prefix}.registry.changed", b"")
        await self.nc.flush(timeout=2)
        await self.nc.close()
        await self.redis.aclose()
        self.log("stopped")
