"""A deliberately faulty worker for the conformance tests: the Python SDK with two type
slips a hand-written worker makes. `conformance.faulty` writes `duration_ms` as a float
(0.27) in every result; `conformance.sloppy` announces `timeout_ms` as 2000.0."""

from toolfleet_worker import _worker, serve
from toolfleet_worker.conformance import probe

publish = _worker.Worker._publish


async def publish_float_durations(self, msg, job, result, *rest):
    if result.get("name") == "conformance.faulty":
        result["duration_ms"] = 0.27
    await publish(self, msg, job, result, *rest)


_worker.Worker._publish = publish_float_durations

sloppy = probe("conformance.sloppy")
sloppy.definition["timeout_ms"] = 2000.0

if __name__ == "__main__":
    serve(probe("conformance.faulty"), sloppy)
