"""The frontend's side of docs/PROTOCOL.md section 8, over nats-py.

A turn's events are core NATS messages: a publish lost while a server restarts is not
sent again, but every event of an accepted turn is stored. So a stream, like the Rust
client's `TurnStream`:

- publishes the same request again after a silence until the turn is accepted (its
  first event with a `seq` arrives), waiting 1 s, then 2 s, then 4 s (8.1 step 4);
- after acceptance hands events out in `seq` order, drops those it has, holds those
  after a gap and attaches (8.4) from the last `seq` it holds, after a gap or after a
  silence; past the turn's deadline (the `ack`'s `deadline_ms`) it attaches every
  second of silence, since the `final` is due;
- waits out a retryable `overloaded` refusal for its `retry_after_ms` before it asks
  again, and asks again after an `unavailable` one; either is handed out only when the
  caller's wait ends with nothing else;
- ends an attach to a turn it saw accepted and that the coordinators no longer know
  with `turn_state_lost`.

Never touches Redis or JetStream, and holds no turn state: the coordinators do.
"""

import asyncio
import enum
import json
import re
import uuid

import nats
import nats.errors

# Silence after which a stream asks again; doubled up to PROBE_MAX while nothing
# arrives, and kept at PROBE_START once an accepted turn is past its deadline.
PROBE_START = 1.0
PROBE_MAX = 4.0
# The coordinators' default deadline (TOOLFLEET_DEFAULT_DEADLINE_MS), assumed until the
# request or the turn's `ack` names one.
ASSUMED_DEADLINE_MS = 15000
# Added to the turn's deadline for the default wait of one event.
EVENT_GRACE = 10.0
# Wait before asking again after an `overloaded` refusal without `retry_after_ms`.
DEFAULT_RETRY_AFTER_MS = 1000
# One cancel request's wait for its answer, and the pause before it is sent again.
CANCEL_TRY = 2.0
CANCEL_RETRY = 0.2
# Room kept in a message for its headers when checking a request against max_payload.
HEADER_ROOM = 4096

TURN_HEADER = "Fleet-Turn-Id"
_TURN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EVENT_TYPES = frozenset({"ack", "tool_state", "narration", "final", "error"})
_LAST = frozenset({"final", "error"})
_NO_RESPONDERS = "503"


class ClientErrorKind(str, enum.Enum):
    """What went wrong in a client operation; match on it, never on the message."""

    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    TIMEOUT = "timeout"
    NO_RESPONDERS = "no_responders"
    CLOSED = "closed"
    DECODE = "decode"
    TURN_FAILED = "turn_failed"


class ClientError(Exception):
    """A failed client operation, with its `kind`."""

    def __init__(self, kind, message):
        super().__init__(f"{kind.value}: {message}")
        self.kind = kind
        self.message = message


class TurnFailed(ClientError):
    """The turn ended with an `error` event (PROTOCOL 4.2): its `code`, `retryable` and
    `retry_after_ms`, and the `event` itself."""

    def __init__(self, event):
        error = event.get("error") or {}
        super().__init__(ClientErrorKind.TURN_FAILED,
                         f"{error.get('code')}: {error.get('message')}")
        self.event = event
        self.turn_id = event.get("turn_id")
        self.code = error.get("code", "")
        self.retryable = bool(error.get("retryable", False))
        self.retry_after_ms = error.get("retry_after_ms")


def _check_turn_id(turn_id):
    if not isinstance(turn_id, str) or not _TURN_ID.fullmatch(turn_id):
        raise ClientError(ClientErrorKind.INVALID_REQUEST,
                          f"turn id {turn_id!r} must be 1-64 characters of [A-Za-z0-9_-]")


async def _quiet(_error):
    """nats-py's error callback: a stream asks again by itself, nothing to log."""


class FleetClient:
    """A frontend of the fleet over one NATS connection (`nc`), cheap to share between
    turns. `frontend` is the NATS user it connects as, if any: its turns then go to that
    user's own subjects and its inboxes start `_INBOX_<frontend>` (PROTOCOL 2.1)."""

    def __init__(self, nc, prefix="fleet", frontend=None):
        self.nc = nc
        self.prefix = prefix
        tail = f".{frontend}" if frontend else ""
        self.submit_subject = f"{prefix}.turns.submit{tail}"
        self.attach_subject = f"{prefix}.turns.attach{tail}"
        self.cancel_subject = f"{prefix}.turns.cancel{tail}"
        self.catalog_subject = f"{prefix}.catalog{tail}"

    @classmethod
    async def connect(cls, servers="nats://127.0.0.1:4222", prefix="fleet", user=None,
                      password=None, **options):
        """Connects to NATS (`servers`: a URL, comma-separated URLs or a list) and keeps
        reconnecting for as long as the client lives. `options` go to `nats.connect`."""
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]
        options.setdefault("name", "toolfleet-client-py")
        options.setdefault("max_reconnect_attempts", -1)
        options.setdefault("reconnect_time_wait", 0.25)
        options.setdefault("connect_timeout", 2)
        options.setdefault("error_cb", _quiet)
        if user:
            options.setdefault("inbox_prefix", f"_INBOX_{user}")
            options["user"] = user
            options["password"] = password
        nc = await nats.connect(servers, **options)
        return cls(nc, prefix, frontend=user)

    async def close(self):
        """Drains and closes the NATS connection."""
        if not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *_exc):
        await self.close()

    async def submit(self, decision, tenant_id, *, turn_id=None, session_id=None,
                     user_message=None, deadline_ms=None, options=None, context=None,
                     headers=None):
        """Submits a turn (PROTOCOL 3.1) and returns the stream of its events. A turn id
        is generated when none is given; submitting the same id again with the same
        request follows the same turn and never runs its calls twice."""
        turn_id = uuid.uuid4().hex if turn_id is None else turn_id
        _check_turn_id(turn_id)
        if deadline_ms is not None and (isinstance(deadline_ms, bool)
                                        or not isinstance(deadline_ms, int)
                                        or deadline_ms < 1):
            raise ClientError(ClientErrorKind.INVALID_REQUEST,
                              "deadline_ms must be a positive integer; leave it out for "
                              "the default")
        request = {"turn_id": turn_id, "tenant_id": tenant_id, "decision": decision}
        for name, value in (("session_id", session_id), ("user_message", user_message),
                            ("deadline_ms", deadline_ms), ("options", options),
                            ("context", context)):
            if value is not None:
                request[name] = value
        try:
            payload = json.dumps(request, separators=(",", ":")).encode()
        except (TypeError, ValueError) as e:
            raise ClientError(ClientErrorKind.INVALID_REQUEST, str(e)) from None
        limit = self.nc.max_payload
        if limit and len(payload) + HEADER_ROOM > limit:
            raise ClientError(ClientErrorKind.PAYLOAD_TOO_LARGE,
                              f"turn request is {len(payload)} bytes, server max_payload "
                              f"is {limit}")
        stream = await self._stream(turn_id, None, 0)
        stream._submission = (self.submit_subject, payload,
                              {**(headers or {}), TURN_HEADER: turn_id})
        if deadline_ms is not None:
            stream._deadline_ms = deadline_ms
        await stream._ask()
        return stream

    async def attach(self, turn_id, after_seq=0, tenant_id=None):
        """Follows turn `turn_id`, submitted earlier by this frontend, from the event
        after `after_seq` (PROTOCOL 8.4): its stored events, then its later ones, until
        `final`. An id this frontend never submitted, or one past its retention, ends
        with an `error` whose code is `unknown_turn`."""
        _check_turn_id(turn_id)
        if isinstance(after_seq, bool) or not isinstance(after_seq, int) or after_seq < 0:
            raise ClientError(ClientErrorKind.INVALID_REQUEST,
                              "after_seq must be a non-negative integer")
        stream = await self._stream(turn_id, tenant_id, after_seq)
        await stream._ask()
        return stream

    async def run_turn(self, decision, tenant_id, **kwargs):
        """Submits a turn and returns its `final` event; raises `TurnFailed` when the turn
        ends with an `error` event."""
        stream = await self.submit(decision, tenant_id, **kwargs)
        return await stream.final()

    async def cancel(self, turn_id, tenant_id=None, timeout=10.0):
        """Cancels turn `turn_id` (PROTOCOL 8.4a) and returns the coordinator's answer,
        `{"turn_id", "outcome", "ended"?}`. Asked again while no coordinator answers or
        the turn store is unavailable, until `timeout` seconds have passed."""
        _check_turn_id(turn_id)
        body = {"turn_id": turn_id}
        if tenant_id is not None:
            body["tenant_id"] = tenant_id
        data = json.dumps(body).encode()
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while True:
            left = until - loop.time()
            try:
                reply = await self.nc.request(self.cancel_subject, data,
                                              timeout=max(0.01, min(left, CANCEL_TRY)))
                try:
                    answer = json.loads(reply.data)
                except ValueError:
                    raise ClientError(ClientErrorKind.DECODE, "an undecodable cancel answer") \
                        from None
                if answer.get("outcome") != "unavailable":
                    return answer
                failure = ClientError(ClientErrorKind.TURN_FAILED,
                                      "the turn store is unavailable")
            except nats.errors.NoRespondersError:
                failure = ClientError(ClientErrorKind.NO_RESPONDERS, "no coordinator listens")
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                failure = ClientError(ClientErrorKind.TIMEOUT, "no cancel answer in time")
            except nats.errors.ConnectionClosedError:
                raise ClientError(ClientErrorKind.CLOSED, "the connection is closed") from None
            except (nats.errors.Error, OSError) as e:
                failure = ClientError(ClientErrorKind.TIMEOUT, str(e))
            if loop.time() + CANCEL_RETRY >= until:
                raise failure
            await asyncio.sleep(CANCEL_RETRY)

    async def catalog(self, fmt="openai", tenant_id=None, timeout=5.0):
        """The tool catalog (PROTOCOL 3.9) in `fmt` (`openai`, `anthropic`, `mcp`,
        `native`), optionally only the tools `tenant_id` may call."""
        body = {"format": fmt}
        if tenant_id is not None:
            body["tenant_id"] = tenant_id
        try:
            reply = await self.nc.request(self.catalog_subject, json.dumps(body).encode(),
                                          timeout=timeout)
        except nats.errors.NoRespondersError:
            raise ClientError(ClientErrorKind.NO_RESPONDERS, "no coordinator listens") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise ClientError(ClientErrorKind.TIMEOUT, "no catalog answer in time") from None
        try:
            answer = json.loads(reply.data)
        except ValueError:
            raise ClientError(ClientErrorKind.DECODE, "an undecodable catalog") from None
        if answer.get("error"):
            error = answer["error"]
            raise ClientError(ClientErrorKind.INVALID_REQUEST,
                              f"{error.get('code')}: {error.get('message')}")
        return answer.get("tools", [])

    async def _stream(self, turn_id, tenant_id, after_seq):
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        return TurnStream(self, turn_id, sub, inbox, tenant_id, after_seq)


class TurnStream:
    """The events of one turn, in `seq` order: iterate it (`async for event in stream`)
    until its `final` or `error`, or call `next_event`. Events are the JSON objects of
    PROTOCOL 3.2, as dicts."""

    def __init__(self, client, turn_id, sub, inbox, tenant_id, after_seq):
        self._client = client
        self.turn_id = turn_id
        self._sub = sub
        self._inbox = inbox
        self._tenant_id = tenant_id
        # The request as published, kept until the turn is accepted.
        self._submission = None
        self._next_seq = after_seq + 1
        self._resumed_from = after_seq
        # Events that arrived after a gap, by seq.
        self._early = {}
        self._probe = PROBE_START
        # The last retryable refusal, handed out only if the caller's wait ends first.
        self._refusal = None
        # Until when an `overloaded` refusal is waited out (loop time), if one is.
        self._retry_at = None
        self._finished = False
        self._started = asyncio.get_running_loop().time()
        self._deadline_ms = ASSUMED_DEADLINE_MS
        #: Requests published: the submission and each time it was sent again, or each
        #: attach.
        self.asks = 0
        #: Asks NATS answered with "no responders" (no coordinator listened).
        self.no_responders = 0
        #: Retryable refusals (`overloaded`, `unavailable`) waited out, and the last one.
        self.refusals = 0
        self.last_refusal = None
        #: Asks that could not be published (the connection was down); asked again.
        self.failed_asks = 0

    @property
    def accepted(self):
        """Whether the turn was accepted: an event stored with it was handed out."""
        return self._next_seq > self._resumed_from + 1

    @property
    def last_seq(self):
        """The `seq` of the last event handed out (0 before any)."""
        return self._next_seq - 1

    @property
    def deadline_ms(self):
        """The turn's budget as the stream knows it: its `ack`'s `deadline_ms` once that
        was handed out, else the request's, else the coordinators' default."""
        return self._deadline_ms

    @property
    def finished(self):
        """Whether the last event (`final` or `error`) was handed out."""
        return self._finished

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._finished:
            raise StopAsyncIteration
        return await self.next_event()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *_exc):
        await self.close()

    async def next_event(self, timeout=None):
        """The next event in `seq` order, waiting at most `timeout` seconds (default: the
        turn's deadline plus 10 s). Raises `ClientError` of kind `TIMEOUT` when nothing
        came, `CLOSED` after the last event."""
        if self._finished:
            raise ClientError(ClientErrorKind.CLOSED, "the turn already ended")
        if timeout is None:
            timeout = self._deadline_ms / 1000 + EVENT_GRACE
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while True:
            early = self._early.pop(self._next_seq, None)
            if early is not None:
                self._next_seq += 1
                return await self._hand_out(early)
            now = loop.time()
            if now >= until:
                if self._refusal is not None:
                    refusal, self._refusal = self._refusal, None
                    return await self._hand_out(refusal)
                raise ClientError(ClientErrorKind.TIMEOUT,
                                  f"no event for turn {self.turn_id} within {timeout:.1f} s")
            wait = min(self._probe, until - now)
            if self._retry_at is not None:
                wait = min(wait, self._retry_at - now)
            try:
                message = await self._sub.next_msg(timeout=max(wait, 0.001))
            except nats.errors.TimeoutError:
                if loop.time() < until:
                    await self._on_silence()
                continue
            except nats.errors.ConnectionClosedError:
                raise ClientError(ClientErrorKind.CLOSED, "the connection is closed") from None
            event = await self._receive(message)
            if event is not None:
                return event

    async def final(self, timeout=None):
        """Reads the stream to its end and returns the `final` event; raises `TurnFailed`
        when the turn ends with an `error`. `timeout` bounds the wait for each event."""
        while True:
            event = await self.next_event(timeout)
            if event["type"] == "final":
                return event
            if event["type"] == "error":
                raise TurnFailed(event)

    async def cancel(self, timeout=10.0):
        """Cancels the turn (`FleetClient.cancel`); its `final` still comes on this
        stream, the calls without a result `cancelled`."""
        return await self._client.cancel(self.turn_id, self._tenant_id, timeout)

    async def close(self):
        """Stops listening; the turn runs on (attach to it later by id)."""
        if not self._finished:
            self._finished = True
            await self._unsubscribe()

    def _overdue(self):
        loop = asyncio.get_running_loop()
        return self.accepted and loop.time() - self._started >= self._deadline_ms / 1000

    async def _on_silence(self):
        """A silent stream asks again: at once when an `overloaded` wait is over, then
        after a doubling silence, or every PROBE_START once the `final` is due."""
        if self._retry_at is not None:
            if asyncio.get_running_loop().time() < self._retry_at:
                return
            self._retry_at = None
            self._probe = PROBE_START
            await self._ask()
            return
        await self._ask()
        self._probe = PROBE_START if self._overdue() else min(self._probe * 2, PROBE_MAX)

    async def _receive(self, message):
        """Takes in one message of the inbox: the event to hand out now, if any."""
        headers = message.headers or {}
        if headers.get("Status"):
            # NATS answered for the coordinators: none listened. The next probe asks again.
            if headers.get("Status") == _NO_RESPONDERS:
                self.no_responders += 1
            return None
        try:
            event = json.loads(message.data)
        except ValueError:
            return None
        if not isinstance(event, dict) or event.get("type") not in _EVENT_TYPES:
            return None
        self._probe = PROBE_START
        seq = event.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int):
            return await self._unstored(event)
        if seq < self._next_seq:
            # A turn ends once: its `final` or `error` is new to a stream that has not
            # ended, whatever its seq (a Redis that lost acknowledged writes when it
            # died numbers later events again from below the seq held here).
            if event["type"] in ("final", "error"):
                return await self._hand_out(event)
            return None
        # Accepted: from now on the stream attaches instead of submitting again.
        self._submission = None
        self._retry_at = None
        if seq == self._next_seq:
            self._next_seq += 1
            return await self._hand_out(event)
        self._early[seq] = event
        await self._ask()
        return None

    async def _unstored(self, event):
        """An event without `seq`: a refusal of the request or of an attach."""
        error = event.get("error") if event["type"] == "error" else None
        if not isinstance(error, dict):
            return await self._hand_out(event)
        code = error.get("code")
        if error.get("retryable") and code in ("overloaded", "unavailable"):
            self.refusals += 1
            self._refusal = self.last_refusal = event
            if code == "overloaded":
                wait_ms = error.get("retry_after_ms")
                if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) \
                        or wait_ms < 0:
                    wait_ms = DEFAULT_RETRY_AFTER_MS
                self._retry_at = asyncio.get_running_loop().time() + wait_ms / 1000
            return None
        if code == "unknown_turn" and self.accepted:
            event = {**event, "error": {
                "code": "turn_state_lost",
                "message": f"turn {self.turn_id} was accepted but its stored state is gone",
                "retryable": False,
            }}
        return await self._hand_out(event)

    async def _hand_out(self, event):
        if event["type"] == "ack":
            deadline_ms = event.get("deadline_ms")
            if isinstance(deadline_ms, int) and not isinstance(deadline_ms, bool) \
                    and deadline_ms > 0:
                self._deadline_ms = deadline_ms
        if event["type"] in _LAST:
            self._finished = True
            await self._unsubscribe()
        return event

    async def _unsubscribe(self):
        try:
            await self._sub.unsubscribe()
        except (nats.errors.Error, OSError):
            pass

    async def _ask(self):
        """Publishes the request again while the turn is not accepted, else an attach
        from the last `seq` handed out. A publish that fails (the connection is down) is
        counted; the next silence asks again."""
        self.asks += 1
        nc = self._client.nc
        try:
            if self._submission is not None:
                subject, payload, headers = self._submission
                await nc.publish(subject, payload, reply=self._inbox, headers=headers)
            else:
                body = {"turn_id": self.turn_id, "after_seq": self.last_seq}
                if self._tenant_id is not None:
                    body["tenant_id"] = self._tenant_id
                await nc.publish(self._client.attach_subject, json.dumps(body).encode(),
                                 reply=self._inbox)
        except nats.errors.ConnectionClosedError:
            raise ClientError(ClientErrorKind.CLOSED, "the connection is closed") from None
        except (nats.errors.Error, OSError):
            self.failed_asks += 1
