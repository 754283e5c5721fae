"""A Python SDK worker whose one tool, `test.py_wait`, waits up to `wait_ms` for its turn
to be cancelled; when `ctx.cancelled` is set it leaves a file named `<turn>.<call>` in
CANCEL_MARKERS, so a test can see that the call saw the cancellation."""

import asyncio
import os
import pathlib
from typing import TypedDict

from toolfleet_worker import serve, tool


class Wait(TypedDict, total=False):
    wait_ms: int


@tool("test.py_wait", timeout_ms=30000)
async def wait(args: Wait, ctx):
    """Waits for the turn to be cancelled, at most wait_ms"""
    try:
        await asyncio.wait_for(ctx.cancelled.wait(), args.get("wait_ms", 5000) / 1000)
    except asyncio.TimeoutError:
        return {"cancelled": False}
    marker = pathlib.Path(os.environ["CANCEL_MARKERS"]) / f"{ctx.turn_id}.{ctx.call_id}"
    marker.write_text("cancelled")
    return {"cancelled": True}


if __name__ == "__main__":
    serve(wait)
