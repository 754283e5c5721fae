"""A Python SDK worker whose one tool, `test.py_flaky`, fails retryably every time; its
deliveries (`idempotent=N`) come from FLAKY_ATTEMPTS, so a test can change the retry
policy between two starts."""

import os

from toolfleet_worker import ToolError, serve, tool


@tool("test.py_flaky", idempotent=int(os.environ["FLAKY_ATTEMPTS"]), timeout_ms=2000)
async def flaky(ctx):
    """Fails with a retryable error every time"""
    raise ToolError("flaky", f"attempt {ctx.attempt} failed", retryable=True)


if __name__ == "__main__":
    serve(flaky)
