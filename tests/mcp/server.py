"""A small MCP server on the official Python SDK (`MCPServer`, formerly FastMCP), for the
`mcp` pack's tests: `python server.py stdio` or `python server.py http PORT`.

Tools: `nap` sleeps (noting its pid, and its cancellation, in `$NAP_MARKER`), `fail` answers `isError` with the caller's reason, `forecast` returns
structured content (and the trace context it was called with). `learn` and `forget` add
and remove a tool at run time and announce the change (`notifications/tools/list_changed`).
"""

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel

server = MCPServer("fleet-test")


@server.tool(description="Sleep for `ms` milliseconds, then say so.", structured_output=False)
async def nap(ms: int) -> str:
    note(f"{os.getpid()}")
    try:
        await asyncio.sleep(ms / 1000)
    except asyncio.CancelledError:
        note(f"cancelled {os.getpid()}")
        raise
    return f"slept {ms} ms"


def note(line: str) -> None:
    """Appends `line` to the file named by NAP_MARKER, when set."""
    marker = os.environ.get("NAP_MARKER")
    if marker:
        with open(marker, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@server.tool(description="Always fails, with the given reason.")
async def fail(reason: str) -> str:
    raise ToolError(f"refused: {reason}")


class Forecast(BaseModel):
    city: str
    high_c: int
    sky: str
    traceparent_meta: str | None = None
    traceparent_header: str | None = None


@server.tool(
    description="Tomorrow's forecast for a city.",
    annotations=ToolAnnotations(read_only_hint=True),
)
async def forecast(city: str, ctx: Context) -> Forecast:
    rc = ctx.request_context
    meta = rc.meta or {}
    meta_tp = meta.get("traceparent") if isinstance(meta, dict) else getattr(meta, "traceparent", None)
    header_tp = None
    request = rc.request
    if request is not None and hasattr(request, "headers"):
        header_tp = request.headers.get("traceparent")
    return Forecast(
        city=city,
        high_c=21,
        sky="sunny",
        traceparent_meta=meta_tp,
        traceparent_header=header_tp,
    )


async def announce(ctx: Context) -> None:
    """Tells the client the tool list changed, on whichever channel its protocol has."""
    try:
        await ctx.notify_tools_changed()
    except Exception:  # noqa: BLE001 - no listen stream on this protocol version
        pass
    try:
        await ctx.request_context.session.send_tool_list_changed()
    except Exception:  # noqa: BLE001 - no session-wide channel on this protocol version
        pass


@server.tool(description="Adds a tool named `name` that echoes its text.")
async def learn(name: str, ctx: Context) -> str:
    async def echo(text: str) -> str:
        return text

    server.add_tool(echo, name=name, description=f"Echo ({name})", structured_output=False)
    await announce(ctx)
    return f"learned {name}"


@server.tool(description="Removes the tool named `name`.")
async def forget(name: str, ctx: Context) -> str:
    server.remove_tool(name)
    await announce(ctx)
    return f"forgot {name}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
