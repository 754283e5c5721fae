"""Tools written the way sdk/python/README.md shows: bare `@tool`, arguments typed with a
TypedDict (the schema the model sees, unknown arguments refused), `async def` and plain
`def` (a blocking one runs on a thread), no arguments at all, a spoken summary hook, and
the SDK's conformance probe served beside them.
Run: pip install ./sdk/python && python3 typed_tools.py"""

import asyncio
import time
from typing import Annotated, Literal, TypedDict

from toolfleet_worker import Output, ToolError, serve, tool
from toolfleet_worker.conformance import probe


class Person(TypedDict):
    name: str


@tool
async def greet(args: Person, ctx):
    """Greets a person on behalf of the caller's tenant."""
    return Output({"text": f"Hello {args['name']}"},
                  summary=f"Hello {args['name']}, from {ctx.tenant_id}.")


class Pause(TypedDict):
    # A range, as the coordinator checks it before any worker runs.
    ms: Annotated[int, {"minimum": 0, "maximum": 5000}]


@tool
async def wait_async(args: Pause):
    """Waits without blocking (asyncio.sleep), then answers."""
    await asyncio.sleep(args["ms"] / 1000)
    return {"waited_ms": args["ms"]}


@tool(timeout_ms=10000, summary=lambda out: f"I waited {out['waited_ms']} milliseconds.")
def wait_blocking(args: Pause):
    """Blocks its thread (time.sleep, as a blocking client library would), then answers."""
    time.sleep(args["ms"] / 1000)
    return {"waited_ms": args["ms"]}


class Convert(TypedDict):
    celsius: float
    units: Literal["F", "K"]


@tool("units.convert")
def convert(args: Convert):
    """Converts degrees Celsius to Fahrenheit or Kelvin."""
    if args["celsius"] < -273.15:
        raise ToolError("below_absolute_zero", f"{args['celsius']} is below -273.15",
                        user_message="That is colder than anything can be.")
    value = args["celsius"] * 9 / 5 + 32 if args["units"] == "F" else args["celsius"] + 273.15
    return Output({"value": value}, summary=f"That is {value:.1f} degrees {args['units']}.")


@tool
def clock():
    """Says the time on the worker's clock; takes no arguments."""
    return {"unix_ms": int(time.time() * 1000)}


@tool
def broken(args: Person):
    """Always raises (a bug in a tool): the call fails `tool_panicked`."""
    return {"length": len(args["name"]) / 0}


if __name__ == "__main__":
    serve(greet, wait_async, wait_blocking, convert, clock, broken, probe())
