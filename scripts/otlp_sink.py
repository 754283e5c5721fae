"""An OTLP/HTTP sink on loopback for the measurement scripts.

    python3 scripts/otlp_sink.py PORT [SPANS_FILE]

Accepts every `POST` (`/v1/traces`, `/v1/metrics`) and answers success, as a collector
would. With SPANS_FILE, each trace export (protobuf, read field by field: only the
resource's service.name and each span's ids, name and times) is appended to it as one
JSON object per span and line.
"""
import json, struct, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def fields(buf):
    """(field number, wire type, value) of each field of one protobuf message."""
    i, n = 0, len(buf)
    def varint():
        nonlocal i
        shift = value = 0
        while True:
            b = buf[i]; i += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
    while i < n:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 1:
            yield number, wire, struct.unpack_from("<Q", buf, i)[0]; i += 8
        elif wire == 2:
            length = varint()
            yield number, wire, buf[i:i + length]; i += length
        elif wire == 5:
            yield number, wire, struct.unpack_from("<I", buf, i)[0]; i += 4
        else:
            raise ValueError(f"wire type {wire}")

def service_of(resource):
    for number, _, kv in fields(resource):
        if number != 1:
            continue
        key = value = None
        for n, _, v in fields(kv):
            if n == 1:
                key = v.decode()
            elif n == 2:
                for an, _, av in fields(v):
                    if an == 1:
                        value = av.decode()
        if key == "service.name":
            return value
    return ""

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
