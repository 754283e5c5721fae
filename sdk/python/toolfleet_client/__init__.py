"""toolfleet frontend client for Python: submit a turn over NATS and read its events.

    import asyncio
    from toolfleet_client import FleetClient

    async def main():
        client = await FleetClient.connect("nats://127.0.0.1:4222")
        stream = await client.submit({"type": "tool_calls", "calls": [
            {"toolName": "crm.getOpenInvoices", "arguments": {"customerId": "cust_001"}}]},
            tenant_id="acme", deadline_ms=5000)
        async for event in stream:
            print(event["seq"], event["type"])
        await client.close()

    asyncio.run(main())

The client keeps the frontend's side of docs/PROTOCOL.md section 8: it asks again
(publishes the same request) while a turn is not accepted, attaches from the last
`seq` it holds after a gap or a silence, drops events it already has, waits out an
`overloaded` refusal for its `retry_after_ms`, and cancels. A NATS server that restarts
under a turn costs the turn nothing.

This module owns the public surface; `_client` owns the protocol.
"""

from toolfleet_client._client import (
    ASSUMED_DEADLINE_MS,
    PROBE_MAX,
    PROBE_START,
    ClientError,
    ClientErrorKind,
    FleetClient,
    TurnFailed,
    TurnStream,
)

__all__ = [
    "FleetClient",
    "TurnStream",
    "ClientError",
    "ClientErrorKind",
    "TurnFailed",
    "PROBE_START",
    "PROBE_MAX",
    "ASSUMED_DEADLINE_MS",
]
