"""`/healthz`, `/readyz` and `/metrics` for the Python worker, like the Rust worker's
(`TOOLFLEET_HTTP_ADDR`, default `0.0.0.0:9091`, `off` for none): health fails when a
pull loop died, readiness until the tools are served and from shutdown on; metrics in
Prometheus text: calls per tool and outcome with their duration, jobs in flight, the
worker's capacity. It only answers HTTP; the worker records into it."""

import asyncio

_STATUS = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}


def _label(value):
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Ops:
    def __init__(self, concurrency):
        self.concurrency = concurrency
        self.ready = False
        self.pulls = []
        self.calls = {}  # (tool, outcome) -> [count, seconds]
        self.in_flight = {}  # tool -> jobs running
        self.server = None

    def started(self, tool):
        self.in_flight[tool] = self.in_flight.get(tool, 0) + 1

    def finished(self, tool, outcome, seconds):
        self.in_flight[tool] = max(self.in_flight.get(tool, 1) - 1, 0)
        entry = self.calls.setdefault((tool, outcome), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def healthy(self):
        return not any(task.done() for task in self.pulls)

    def metrics(self):
        lines = ["# TYPE toolfleet_call_duration_seconds summary"]
        for (tool, outcome), (count, seconds) in sorted(self.calls.items()):
            labels = f'gen_ai_tool_name="{_label(tool)}",outcome="{_label(outcome)}"'
            lines.append(f"toolfleet_call_duration_seconds_count{{{labels}}} {count}")
            lines.append(f"toolfleet_call_duration_seconds_sum{{{labels}}} {seconds:.6f}")
        lines.append("# TYPE toolfleet_jobs_in_flight gauge")
        for tool, running in sorted(self.in_flight.items()):
            lines.append(f'toolfleet_jobs_in_flight{{gen_ai_tool_name="{_label(tool)}"}} {running}')
        lines.append("# TYPE toolfleet_worker_capacity gauge")
        lines.append(f"toolfleet_worker_capacity {self.concurrency}")
        return "\n".join(lines) + "\n"

    async def start(self, addr):
        if addr is not None:
            self.server = await asyncio.start_server(self._answer, addr[0], addr[1])

    def address(self):
        return self.server.sockets[0].getsockname() if self.server else None

    async def close(self):
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _answer(self, reader, writer):
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) > 1 else ""
            if path == "/healthz":
                status, body = (200, "ok\n") if self.healthy() else (503, "a pull loop died\n")
            elif path == "/readyz":
                status, body = (200, "ready\n") if self.ready else (503, "not serving\n")
            elif path == "/metrics":
                status, body = 200, self.metrics()
            else:
                status, body = 404, "not found\n"
            data = body.encode()
            kind = "text/plain; version=0.0.4" if path == "/metrics" else "text/plain"
            writer.write(f"HTTP/1.1 {status} {_STATUS[status]}\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                         + data)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
