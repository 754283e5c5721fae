"""The conformance probe (docs/PROTOCOL.md section 7.11): the tool `toolfleet conformance`
drives to check a worker. Serve it with `python -m toolfleet_worker.conformance` (the
name from TOOLFLEET_CONFORMANCE_TOOL, default `conformance.probe`). It owns the probe's
behaviour only; serving is the SDK's."""

import asyncio
import os

from toolfleet_worker import Output, ToolError, serve, tool

NAME = "conformance.probe"

ARGS = {
    "type": "object",
    "properties": {
        "behave": {"type": "string", "enum": ["echo", "fail_retryable", "sleep", "panic"]},
        "value": {},
        "sleep_ms": {"type": "integer", "minimum": 0},
        "succeed_on_attempt": {"type": ["integer", "null"], "minimum": 0},
    },
    "additionalProperties": False,
}


def probe(name=NAME):
    """The probe under `name`: idempotent with 3 deliveries, a 10 s timeout."""

    @tool(name, input_schema=ARGS, waiting_hint="running the conformance probe",
          timeout_ms=10000, idempotent=3)
    async def run(args, ctx):
        """Echoes, fails retryably, sleeps or panics on request"""
        behave = args.get("behave", "echo")
        if behave == "sleep":
            await asyncio.sleep(args.get("sleep_ms", 0) / 1000)
        elif behave == "panic":
            raise RuntimeError("conformance probe asked to panic")
        elif behave == "fail_retryable":
            if ctx.attempt < (args.get("succeed_on_attempt") or 2):
                raise ToolError("conformance_retry", f"attempt {ctx.attempt} fails on request",
                                retryable=True)
        value = {"value": args.get("value"), "attempt": ctx.attempt, "tenant_id": ctx.tenant_id}
        return Output(value, summary="The probe answered.")

    return run


if __name__ == "__main__":
    serve(probe(os.environ.get("TOOLFLEET_CONFORMANCE_TOOL", "").strip() or NAME))
