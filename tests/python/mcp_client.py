"""The official MCP Python client against the gateway's /mcp.

Usage: mcp_client.py MCP_URL API_KEY [cancel]

Initializes, lists the tools, calls a tool that succeeds (with a progress callback), one
whose call fails, and one the tenant does not have; prints one JSON object with what it
saw. With a wrong key it prints {"refused": status}. With `cancel` it starts a call of
ten seconds and abandons it after one and a half (the SDK then sends
`notifications/cancelled`), and prints {"abandoned": true}.
"""

import asyncio
import json
import sys

import anyio
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

URL, KEY = sys.argv[1], sys.argv[2]


def result_of(result):
    text = " ".join(block.text for block in result.content if getattr(block, "text", None))
    return {"is_error": bool(result.is_error), "text": text,
            "structured": result.structured_content}


async def main():
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {KEY}"})
    progress = []

    async def on_progress(value, total, message):
        progress.append(message)

    async with streamable_http_client(URL, http_client=http) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            tools = await session.list_tools()
            ok = await session.call_tool("test.behave", {"value": "from mcp", "sleep_ms": 200},
                                         progress_callback=on_progress)
            failing = await session.call_tool("test.behave", {"fail": "fatal"})
            unknown = await session.call_tool("payments.refund", {})
    print(json.dumps({
        "server": init.server_info.name,
        "tools": sorted(t.name for t in tools.tools),
        "ok": result_of(ok),
        "failing": result_of(failing),
        "unknown": result_of(unknown),
        "progress": progress,
    }))


async def refused():
    async with httpx2.AsyncClient() as http:
        response = await http.post(URL, headers={"Authorization": "Bearer tfk_wrong"},
                                   json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        print(json.dumps({"refused": response.status_code}))


async def abandon():
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {KEY}"})
    async with streamable_http_client(URL, http_client=http) as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            with anyio.move_on_after(1.5):
                await session.call_tool("test.behave", {"sleep_ms": 10000, "value": "long"})
            await anyio.sleep(0.5)
    print(json.dumps({"abandoned": True}))


if KEY == "wrong":
    asyncio.run(refused())
elif sys.argv[3:] == ["cancel"]:
    asyncio.run(abandon())
else:
    asyncio.run(main())
