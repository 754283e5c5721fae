"""toolfleet worker SDK for Python: a function becomes a fleet tool.

    from typing import TypedDict
    from toolfleet_worker import Output, tool, serve

    class Text(TypedDict):
        text: str

    @tool
    async def text_stats(args: Text):
        "Counts the words of a text."
        words = len(args["text"].split())
        return Output({"words": words}, summary=f"That text has {words} words.")

    serve(text_stats)

This module owns the public surface (the decorator, the types, settings, `serve`);
`_worker` owns the protocol of docs/PROTOCOL.md section 7. Neither contains tools.
"""

import asyncio
import dataclasses
import inspect
import os
import signal
import socket
import ssl
import sys
import time
import typing
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

from toolfleet_worker._schema import NO_ARGUMENTS, ArgumentsError, arguments_of

__all__ = ["tool", "serve", "run", "Tool", "Output", "ToolError", "Context", "Settings",
           "ArgumentsError"]


class ToolError(Exception):
    """A tool failure with a stable code (PROTOCOL.md 3.5); `retryable` may pass on a retry."""

    def __init__(self, code, message, retryable=False, user_message=None):
        super().__init__(message)
        self.code, self.message, self.retryable = code, message, retryable
        self.user_message = user_message


@dataclass
class Output:
    """A result with the sentence the narrator speaks (never raw JSON)."""

    value: object
    summary: str = None


@dataclass
class Context:
    """What a tool knows about its call: tenant (from the turn), ids, deadline, attempt;
    `cancelled` is set when the caller cancels the turn (PROTOCOL.md 9.6): a tool that can
    stop early should (`await ctx.cancelled.wait()`); a result still returned is dropped."""

    tenant_id: str
    turn_id: str
    call_id: str
    session_id: str
    deadline_unix_ms: int
    attempt: int
    context: dict
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


def _json_value(value):
    """A pydantic model or dataclass as JSON data; anything else as it is."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@dataclass
class Tool:
    """A tool: its definition (PROTOCOL.md 3.1) and its function, with how the function
    takes its arguments (`convert`) and context, whether it is a plain `def` (run on a
    thread) and the summary hook."""

    definition: dict
    handler: object
    convert: object = None
    takes_args: bool = True
    takes_ctx: bool = True
    blocking: bool = False
    summary: object = None

    async def invoke(self, arguments, ctx):
        """Runs the function on the call's `arguments` (checked by the coordinator against
        the input schema) and returns an `Output`. A plain `def` runs on a thread
        (`asyncio.to_thread`), so blocking code never holds up the worker's event loop."""
        params = []
        if self.takes_args and self.convert:
            try:
                arguments = self.convert(arguments)
            except ValueError as e:  # pydantic's ValidationError is one
                raise ToolError("invalid_arguments", f"arguments: {e}") from e
        if self.takes_args:
            params.append(arguments)
        if self.takes_ctx:
            params.append(ctx)
        if self.blocking:
            out = await asyncio.to_thread(self.handler, *params)
        else:
            out = await self.handler(*params)
        if isinstance(out, Output):
            return Output(_json_value(out.value), out.summary)
        summary = self.summary(out) if self.summary else None
        return Output(_json_value(out), summary)


def _is_context(parameter, hints):
    return hints.get(parameter.name) is Context or (
        parameter.name in ("ctx", "context") and parameter.name not in hints)


def _make_tool(handler, name, input_schema, output_schema, description, waiting_hint,
               timeout_ms, idempotent, tenant_scoped, summary, allow_unknown_arguments,
               spoken_name=None):
    if isinstance(handler, Tool):
        return handler
    if not callable(handler):
        raise TypeError(f"@tool goes on a function, not {handler!r}")
    blocking = not inspect.iscoroutinefunction(handler)
    try:
        hints = typing.get_type_hints(handler, include_extras=True)
    except Exception:  # noqa: BLE001 - unresolvable hints are treated as absent
        hints = {}
    positional = [p for p in inspect.signature(handler).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fn_name = getattr(handler, "__name__", "tool")
    if len(positional) > 2:
        raise TypeError(f"tool {fn_name}: takes (args, ctx), (args), (ctx) or nothing")
    if len(positional) == 2:
        takes_args, takes_ctx = True, True
    elif len(positional) == 1:
        takes_ctx = _is_context(positional[0], hints)
        takes_args = not takes_ctx
    else:
        takes_args, takes_ctx = False, False
    convert = None
    if input_schema is None:
        if takes_args:
            input_schema, convert = arguments_of(hints.get(positional[0].name), fn_name,
                                                 allow_unknown_arguments)
        else:
            input_schema = dict(NO_ARGUMENTS)
            if allow_unknown_arguments:
                input_schema.pop("additionalProperties")
    definition = {
        "name": name or fn_name,
        "description": description or " ".join((handler.__doc__ or "").split()),
        "input_schema": input_schema,
        "timeout_ms": int(timeout_ms),
        "retry": {"idempotent": idempotent > 0, "max_attempts": max(int(idempotent), 1)},
        "tenant_scoped": bool(tenant_scoped),
    }
    if output_schema is not None:
        definition["output_schema"] = output_schema
    if waiting_hint:
        definition["waiting_hint"] = waiting_hint
    if spoken_name:
        definition["spoken_name"] = spoken_name
    return Tool(definition, handler, convert, takes_args, takes_ctx, blocking, summary)


def tool(handler=None, name=None, *, input_schema=None, output_schema=None, description=None,
         waiting_hint=None, timeout_ms=30000, idempotent=0, tenant_scoped=False, summary=None,
         allow_unknown_arguments=False, spoken_name=None):
    """Makes a function a Tool: bare (`@tool`) or with settings (`@tool("math.double",
    idempotent=3)`, `@tool(name=...)`).

    The function is `async def` or a plain `def` (run on a thread), and takes
    `(args, ctx)`, `(args)`, `(ctx)` or nothing. The input schema comes from the type of
    `args`: a `TypedDict` or a pydantic model (the function then gets the model), with
    unknown arguments refused unless `allow_unknown_arguments`; `input_schema=` gives
    one by hand (the function then gets the arguments as a dict). The description
    defaults to the docstring; `idempotent=N` allows N deliveries; `summary=` maps a
    plain result to the sentence the narrator speaks; `spoken_name=` is what the tool
    gives as a person hears it ("your order status"), said instead of the tool's name."""
    settings = dict(input_schema=input_schema, output_schema=output_schema,
                    description=description, waiting_hint=waiting_hint,
                    timeout_ms=timeout_ms, idempotent=idempotent,
                    tenant_scoped=tenant_scoped, summary=summary,
                    allow_unknown_arguments=allow_unknown_arguments,
                    spoken_name=spoken_name)
    if isinstance(handler, str):
        handler, name = None, handler
    if handler is not None:
        return _make_tool(handler, name, **settings)
    return lambda fn: _make_tool(fn, name, **settings)


def _env_int(name, default):
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        sys.exit(f"{name}={value!r} is not an integer")


def _env_int_in(name, default, low, high):
    value = _env_int(name, default)
    if not low <= value <= high:
        sys.exit(f"{name}={value} is out of range: allowed {low} to {high}")
    return value


def _env_choice(name, default, choices):
    value = (os.environ.get(name, "").strip() or default).lower()
    if value not in choices:
        sys.exit(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value


def _env_addr(name, default):
    value = os.environ.get(name, "").strip() or default
    if value.lower() == "off":
        return None
    host, sep, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 <= number <= 65535:
        sys.exit(f"{name}={value!r} is not an address (host:port, or off)")
    return host.strip("[]"), number


def _env_file(name):
    value = os.environ.get(name, "").strip()
    if value and not os.path.isfile(value):
        sys.exit(f"{name}={value!r} is not a file")
    return value or None


@dataclass
class Settings:
    """Worker settings from the environment, same names as the Rust worker."""

    nats_url: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_NATS_URL", "").strip() or "nats://127.0.0.1:4222")
    nats_user: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_NATS_USER", "").strip() or None)
    nats_password: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_NATS_PASSWORD", "").strip() or None)
    # Replies on `_INBOX_<user>` when a user is set, as deploy/nats/auth.conf requires;
    # the streams' API under the prefix the worker's account imports it at.
    nats_inbox_prefix: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_NATS_INBOX_PREFIX", "").strip() or None)
    nats_js_api_prefix: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_NATS_JS_API_PREFIX", "").strip() or None)
    redis_url: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_REDIS_URL", "").strip() or "redis://127.0.0.1:6379/")
    prefix: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_PREFIX", "").strip() or "fleet")
    worker_id: str = field(default_factory=lambda: os.environ.get("TOOLFLEET_WORKER_ID", "").strip() or f"py-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    # The Rust worker's ranges (worker/src/config.rs, `ranges`): zero is refused wherever
    # it would stop the worker.
    concurrency: int = field(default_factory=lambda: _env_int_in("TOOLFLEET_WORKER_CONCURRENCY", 8, 1, 65536))
    heartbeat: float = field(default_factory=lambda: _env_int_in("TOOLFLEET_HEARTBEAT_MS", 2000, 100, 60000) / 1000)
    ack_wait: float = field(default_factory=lambda: _env_int_in("TOOLFLEET_ACK_WAIT_MS", 5000, 500, 600000) / 1000)
    max_result_bytes: int = field(default_factory=lambda: _env_int_in("TOOLFLEET_MAX_RESULT_BYTES", 512 * 1024, 1024, 8 * 1024 * 1024))
    shutdown_grace: float = field(default_factory=lambda: _env_int_in("TOOLFLEET_SHUTDOWN_GRACE_MS", 10000, 0, 600000) / 1000)
    # 7.5: a call is announced `started` once it has run this long (0: as it starts); one
    # that ends sooner goes from `pending` to its terminal state.
    running_after: float = field(default_factory=lambda: _env_int_in("TOOLFLEET_RUNNING_AFTER_MS", 2, 0, 60000) / 1000)
    # Storage of the jobs and results streams when this worker creates them: `file`, or
    # `memory` (opt-in: a restarted nats-server loses queued jobs and unrecorded results).
    stream_storage: str = field(default_factory=lambda: _env_choice("TOOLFLEET_STREAM_STORAGE", "file", ("file", "memory")))
    # Replicas of each stream when this worker creates them (1 to 5; 3 on a 3-node
    # JetStream cluster), as every coordinator's.
    stream_replicas: int = field(default_factory=lambda: _env_int_in("TOOLFLEET_STREAM_REPLICAS", 1, 1, 5))
    # Pairs of jobs and results streams the fleet's turns are spread over (1 to 64); the
    # same number as every coordinator's.
    stream_partitions: int = field(default_factory=lambda: _env_int_in("TOOLFLEET_STREAM_PARTITIONS", 1, 1, 64))
    # `create`: make or update the tools' consumers; `bind`: wait for the coordinator's.
    consumers: str = field(default_factory=lambda: _env_choice("TOOLFLEET_WORKER_CONSUMERS", "create", ("create", "bind")))
    # `/healthz`, `/readyz` and `/metrics` (`host:port`, as the Rust worker's; `off`: none).
    http_addr: tuple = field(default_factory=lambda: _env_addr("TOOLFLEET_HTTP_ADDR", "0.0.0.0:9091"))
    # TLS (PEM files): the CA to trust and an optional client certificate, per server.
    nats_ca_file: str = field(default_factory=lambda: _env_file("TOOLFLEET_NATS_CA_FILE"))
    nats_cert_file: str = field(default_factory=lambda: _env_file("TOOLFLEET_NATS_CERT_FILE"))
    nats_key_file: str = field(default_factory=lambda: _env_file("TOOLFLEET_NATS_KEY_FILE"))
    redis_ca_file: str = field(default_factory=lambda: _env_file("TOOLFLEET_REDIS_CA_FILE"))
    redis_cert_file: str = field(default_factory=lambda: _env_file("TOOLFLEET_REDIS_CERT_FILE"))
    redis_key_file: str = field(default_factory=lambda: _env_file("TOOLFLEET_REDIS_KEY_FILE"))

    def __post_init__(self):
        for server in ("nats", "redis"):
            if bool(getattr(self, f"{server}_cert_file")) != bool(getattr(self, f"{server}_key_file")):
                upper = server.upper()
                sys.exit(f"TOOLFLEET_{upper}_CERT_FILE and TOOLFLEET_{upper}_KEY_FILE go together")
        if (self.redis_ca_file or self.redis_cert_file) and not self.redis_url.startswith("rediss://"):
            sys.exit("a Redis TLS file is set, so TOOLFLEET_REDIS_URL must be rediss://")

    def nats_tls(self):
        """The SSL context for nats-py's `tls=`; None without NATS TLS files."""
        if not (self.nats_ca_file or self.nats_cert_file):
            return None
        context = ssl.create_default_context(cafile=self.nats_ca_file)
        if self.nats_cert_file:
            context.load_cert_chain(self.nats_cert_file, self.nats_key_file)
        return context

    def redis_tls(self):
        """redis-py's TLS options (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`)."""
        options = {}
        if self.redis_ca_file:
            options["ssl_ca_certs"] = self.redis_ca_file
        if self.redis_cert_file:
            options.update(ssl_certfile=self.redis_cert_file, ssl_keyfile=self.redis_key_file)
        return options


def now_ms():
    return int(time.time() * 1000)


def rfc3339(seconds=None):
    """UTC RFC 3339 with milliseconds, from one clock reading."""
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def serve(*tools, settings=None):
    """Serves `tools` (`@tool` functions; a plain function is made one as `@tool` would)
    until SIGTERM or SIGINT (drains, withdraws); blocks."""
    asyncio.run(run(list(tools), settings or Settings()))


async def run(tools, settings):
    """Serves `tools` with `settings` until SIGTERM or SIGINT."""
    from toolfleet_worker._worker import Worker

    tools = [t if isinstance(t, Tool) else tool(t) for t in tools]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Worker(tools, settings).run(stop)
