"""Runs turns through a fleet for a while, as a frontend would, and reports how each ended.

usage: frontend_chaos.py NATS_URL PREFIX SECONDS CONCURRENCY MODE

MODE `client` uses toolfleet_client (PROTOCOL 8.1: asks again, attaches, drops
duplicates by `seq`); MODE `once` publishes each request once and waits for its events,
as the first sample of PROTOCOL 8.1 did. CONCURRENCY turns are kept in flight for
SECONDS; each has three `test.behave` calls and a 6 s deadline. A turn is lost when no
`final` arrives within its deadline plus 10 s. Prints one JSON object: the counts, the
lost turn ids, the slowest turn, and the events that were out of order or repeated.
"""

import asyncio
import json
import random
import sys
import time
import uuid

import nats
import nats.errors

from toolfleet_client import ClientError, FleetClient

DEADLINE_MS = 6000
WAIT = DEADLINE_MS / 1000 + 10


def decision(rng):
    return {"type": "tool_calls", "calls": [
        {"id": f"c{i}", "toolName": "test.behave",
         "arguments": {"sleep_ms": rng.randint(20, 300), "value": i}}
        for i in range(3)
    ]}


async def with_client(client, rng, report):
    stream = await client.submit(decision(rng), "acme", deadline_ms=DEADLINE_MS)
    seqs, final = [], None
    try:
        async for event in stream:
            seqs.append(event.get("seq"))
            if event["type"] == "final":
                final = event
            elif event["type"] == "error":
                report["errors"][event["error"]["code"]] = \
                    report["errors"].get(event["error"]["code"], 0) + 1
    except ClientError as e:
        report["client_errors"][e.kind.value] = report["client_errors"].get(e.kind.value, 0) + 1
    report["asks"] += stream.asks
    report["reasked_turns"] += stream.asks > 1
    if seqs and seqs != list(range(1, len(seqs) + 1)):
        report["out_of_order"].append({"turn_id": stream.turn_id, "seqs": seqs})
    return stream.turn_id, final


async def once(nc, prefix, rng, report):
    """The first sample of PROTOCOL 8.1: one publish, then wait."""
    turn_id = uuid.uuid4().hex
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    final = None
    try:
        await nc.publish(f"{prefix}.turns.submit", json.dumps({
            "turn_id": turn_id, "tenant_id": "acme", "decision": decision(rng),
            "deadline_ms": DEADLINE_MS}).encode(), reply=inbox,
            headers={"Fleet-Turn-Id": turn_id})
        report["asks"] += 1
        until = time.monotonic() + WAIT
        while final is None:
            left = until - time.monotonic()
            if left <= 0:
                break
            try:
                message = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            try:
                event = json.loads(message.data)
            except ValueError:
                continue
            if event.get("type") == "final":
                final = event
            elif event.get("type") == "error":
                code = event["error"]["code"]
                report["errors"][code] = report["errors"].get(code, 0) + 1
                break
    except nats.errors.Error as e:
        name = type(e).__name__
        report["client_errors"][name] = report["client_errors"].get(name, 0) + 1
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass
    return turn_id, final


async def main():
    url, prefix, seconds, concurrency, mode = sys.argv[1:6]
    seconds, concurrency = float(seconds), int(concurrency)
    client = await FleetClient.connect(url, prefix=prefix)
    report = {"mode": mode, "turns": 0, "finals": 0, "lost": 0, "lost_turns": [],
              "finals_with_all_results": 0, "calls_ok": 0, "errors": {},
              "client_errors": {}, "out_of_order": [], "asks": 0, "reasked_turns": 0,
              "slowest_turn_s": 0.0, "finals_per_turn": {}}
    end = time.monotonic() + seconds
    finals = {}

    async def lane(k):
        rng = random.Random(k)
        while time.monotonic() < end:
            began = time.monotonic()
            if mode == "client":
                turn_id, final = await with_client(client, rng, report)
            else:
                turn_id, final = await once(client.nc, prefix, rng, report)
            report["turns"] += 1
            report["slowest_turn_s"] = max(report["slowest_turn_s"], time.monotonic() - began)
            if final is None:
                report["lost"] += 1
                report["lost_turns"].append(turn_id)
                continue
            finals[turn_id] = finals.get(turn_id, 0) + 1
            report["finals"] += 1
            if final.get("turn_id") == turn_id and len(final.get("results", [])) == 3:
                report["finals_with_all_results"] += 1
            report["calls_ok"] += final.get("summary", {}).get("ok", 0)

    await asyncio.gather(*(lane(k) for k in range(concurrency)))
    counts = {}
    for n in finals.values():
        counts[str(n)] = counts.get(str(n), 0) + 1
    report["finals_per_turn"] = counts
    await client.close()
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
