"""An OTLP/HTTP sink on loopback for the measurement scripts.

    python3 scripts/otlp_sink.py PORT [SPANS_FILE]

Accepts every `POST` (`/v1/traces`, `/v1/metrics`) and answers success, as a collector
would. With SPANS_FILE, each trace export (protobuf, read field by field: only the
resource's service.name and each span's ids, name and times) is appended to it as one
JSON object per span and line.
"""
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The protobuf reading is the Jaeger stand-in's (deploy/ci-images/otlp_standin.py), which
# the CI image ships alone; importing it from the checkout keeps one reader of the format.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deploy" / "ci-images"))
from otlp_standin import attributes, fields  # noqa: E402

def service_of(resource):
    """The service.name of a Resource message ("" when it names none)."""
    return attributes(kv for n, _, kv in fields(resource) if n == 1).get("service.name", "")

def spans_of(body):
    for number, _, resource_spans in fields(body):
        if number != 1:
            continue
        service, scopes = "", []
        for n, _, v in fields(resource_spans):
            if n == 1:
                service = service_of(v)
            elif n == 2:
                scopes.append(v)
        for scope in scopes:
            for n, _, span in fields(scope):
                if n != 2:
                    continue
                s = {"service": service}
                for f, _, v in fields(span):
                    if f == 1: s["trace"] = v.hex()
                    elif f == 2: s["id"] = v.hex()
                    elif f == 4: s["parent"] = v.hex()
                    elif f == 5: s["name"] = v.decode()
                    elif f == 7: s["start"] = v
                    elif f == 8: s["end"] = v
                yield s

out = open(sys.argv[2], "a") if len(sys.argv) > 2 else None
writing = threading.Lock()
class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if out is not None and self.path.endswith("/v1/traces"):
            lines = [json.dumps(span) + "\n" for span in spans_of(body)]
            with writing:
                out.writelines(lines)
                out.flush()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
