"""Drives toolfleet_client through what a frontend does with a turn, and reports it.

usage: frontend_client.py NATS_URL PREFIX SCENARIO

SCENARIO `follow`: a turn of three calls read to its end; the same turn attached from
`seq` 0 once it ended; a 60 s turn left after its first two events and attached from
there, and attached from 0; an id never submitted; a turn cancelled while its call
sleeps, then cancelled again. SCENARIO `overloaded` (tenant `busy`, one turn in flight):
a second turn submitted while the first runs, waited out for the refusal's
`retry_after_ms`. SCENARIO `as_user`: the client connected as the NATS user and password
of TOOLFLEET_NATS_USER and TOOLFLEET_NATS_PASSWORD (deploy/nats/auth.conf): the catalog,
a turn, the turn attached again, a cancel. SCENARIO `rewound`: a turn whose last
events the Redis of TOOLFLEET_TEST_REDIS_URL loses (trimmed under the key of
TOOLFLEET_PREFIX) once three of its four calls are done, read to its `final`. Prints one
JSON object.
"""

import asyncio
import json
import os
import sys
import time
import urllib.parse
import uuid

from toolfleet_client import FleetClient, TurnFailed


def behave(*sleeps):
    return {"type": "tool_calls", "calls": [
        {"id": f"c{i}", "toolName": "test.behave", "arguments": {"sleep_ms": ms, "value": i}}
        for i, ms in enumerate(sleeps)
    ]}


async def drain(stream):
    return [event async for event in stream]


def shape(events):
    return {"seqs": [e.get("seq") for e in events], "types": [e["type"] for e in events]}


async def follow(client):
    report = {}
    # A turn of three calls, read to its end.
    stream = await client.submit(behave(100, 200, 300), "acme", deadline_ms=60000)
    events = await drain(stream)
    final = events[-1]
    report["three_calls"] = {**shape(events), "summary": final.get("summary"),
                             "states": [r["state"] for r in final.get("results", [])],
                             "deadline_ms": stream.deadline_ms, "asks": stream.asks}
    # The ended turn attached from 0: every event again, the same final.
    again = await drain(await client.attach(stream.turn_id))
    report["replayed"] = {**shape(again), "same_final": again[-1] == final}

    # A long turn left after its first two events, then attached from there.
    stream = await client.submit(behave(1500), "acme", deadline_ms=60000)
    first = [await stream.next_event(), await stream.next_event()]
    await stream.close()
    resumed = await client.attach(stream.turn_id, after_seq=stream.last_seq)
    deadline_before_ack = resumed.deadline_ms
    rest = await drain(resumed)
    from_zero = await client.attach(stream.turn_id)
    replay = await drain(from_zero)
    report["resumed"] = {"first": shape(first), "rest": shape(rest),
                         "final_state": rest[-1]["results"][0]["state"],
                         "deadline_without_ack": deadline_before_ack,
                         "deadline_from_replayed_ack": from_zero.deadline_ms,
                         "replay": shape(replay)}

    # An id never submitted.
    unknown = await drain(await client.attach("never-submitted-here"))
    report["unknown"] = {**shape(unknown), "code": unknown[-1].get("error", {}).get("code")}

    # A turn cancelled while its call sleeps; its final still comes on the stream.
    stream = await client.submit(behave(5000, 10), "acme", deadline_ms=30000)
    ack = await stream.next_event()
    while True:
        event = await stream.next_event()
        if event["type"] == "tool_state" and event["state"] == "done":
            break
    began = time.monotonic()
    reply = await stream.cancel()
    final = await stream.final()
    second = await client.cancel(stream.turn_id)
    report["cancelled"] = {"ack": ack["type"], "reply": reply, "second": second,
                           "summary": final["summary"],
                           "states": [r["state"] for r in final["results"]],
                           "final_after_s": time.monotonic() - began}

    # A refused request: an `error` event, raised by final().
    try:
        await client.run_turn({"type": "nonsense"}, "acme")
        report["refused"] = None
    except TurnFailed as e:
        report["refused"] = {"code": e.code, "retryable": e.retryable}
    return report


async def overloaded(client):
    first = await client.submit(behave(300), "busy", deadline_ms=2500)
    ack = await first.next_event()
    began = time.monotonic()
    second = await client.submit(behave(10), "busy", deadline_ms=5000)
    events = []
    accepted_after = None
    async for event in second:
        if accepted_after is None:
            accepted_after = time.monotonic() - began
        events.append(event)
    await first.final()
    refusal = second.last_refusal or {}
    return {"first_ack": ack["type"], "second": shape(events),
            "second_summary": events[-1].get("summary"), "refusals": second.refusals,
            "refusal_code": refusal.get("error", {}).get("code"),
            "retry_after_ms": refusal.get("error", {}).get("retry_after_ms"),
            "accepted_after_s": accepted_after, "asks": second.asks}


async def as_user(client):
    tools = await client.catalog("native", tenant_id="acme")
    stream = await client.submit({"type": "tool_calls", "calls": [
        {"id": "inv", "toolName": "crm.getOpenInvoices", "arguments": {"customerId": "cust_001"}}]},
        "acme", deadline_ms=10000)
    events = await drain(stream)
    again = await drain(await client.attach(stream.turn_id))
    cancel = await client.cancel(stream.turn_id)
    return {"tools": sorted(t.get("name") for t in tools), "turn": shape(events),
            "summary": events[-1].get("summary"), "asks": stream.asks,
            "again": shape(again), "cancel": cancel}


async def redis_command(url, *args):
    """One command to the Redis of `url` (no password), over RESP; its reply line."""
    address = urllib.parse.urlparse(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    request = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = str(arg).encode()
        request.append(b"$%d\r\n%s\r\n" % (len(data), data))
    writer.write(b"".join(request))
    await writer.drain()
    reply = (await reader.readline()).decode().strip()
    writer.close()
    await writer.wait_closed()
    return reply


async def rewound(client):
    # Redis comes back without the turn's last events once three fast calls are done, as
    # one that died before writing them to disk: the slow call's `done`, the narration
    # and the `final` are stored under seqs the client already holds.
    redis_url = os.environ["TOOLFLEET_TEST_REDIS_URL"]
    turn_id = uuid.uuid4().hex
    stream = await client.submit(behave(10, 10, 10, 2000), "acme", turn_id=turn_id,
                                 deadline_ms=20000)
    events, done = [], 0
    while done < 3:
        event = await stream.next_event(10)
        events.append(event)
        done += event["type"] == "tool_state" and event.get("state") == "done"
    held = stream.last_seq
    key = f"{os.environ['TOOLFLEET_PREFIX']}:turn:{{{turn_id}}}:events"
    trimmed = await redis_command(redis_url, "LTRIM", key, 0, 0)
    rest = [event async for event in stream]
    stored = await redis_command(redis_url, "LLEN", key)
    final = rest[-1] if rest else {}
    return {"held": held, "trimmed": trimmed, "stored": int(stored.lstrip(":")),
            "last": final.get("type"), "last_seq": final.get("seq"),
            "summary": final.get("summary")}


async def main():
    url, prefix, scenario = sys.argv[1:4]
    user = os.environ.get("TOOLFLEET_NATS_USER")
    password = os.environ.get("TOOLFLEET_NATS_PASSWORD")
    async with await FleetClient.connect(url, prefix=prefix, user=user,
                                         password=password) as client:
        scenarios = {"follow": follow, "overloaded": overloaded, "as_user": as_user,
                     "rewound": rewound}
        report = await scenarios[scenario](client)
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
