"""A stand-in for Jaeger all-in-one where no registry serves its image.

    python3 otlp_standin.py

Port 4318 takes OTLP/HTTP trace exports (protobuf) and keeps each span's service,
instance, name, whether it has a parent, and its string attributes; like Jaeger 1.62 it
has no /v1/metrics and answers 404 there (counted). Port 16686 serves GET /api/spans
(every span kept, and the counts) as JSON; port 14269 answers GET / for health checks.
Port 4317 (OTLP/gRPC) is not served.
"""
import json, struct, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_SPANS = 200_000
lock = threading.Lock()
spans = []
counts = {"trace_posts": 0, "metrics_posts": 0, "other_posts": 0, "spans_dropped": 0}


def fields(buf):
    """(field number, wire type, value) of each field of one protobuf message."""
    i, n = 0, len(buf)

    def varint():
        nonlocal i
        shift = value = 0
        while True:
            b = buf[i]
            i += 1
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
            yield number, wire, struct.unpack_from("<Q", buf, i)[0]
            i += 8
        elif wire == 2:
            length = varint()
            yield number, wire, bytes(buf[i:i + length])
            i += length
        elif wire == 5:
            yield number, wire, struct.unpack_from("<I", buf, i)[0]
            i += 4
        else:
            raise ValueError(f"wire type {wire}")


def attributes(kvs):
    """String, bool and int attributes of repeated KeyValue fields."""
    out = {}
    for kv in kvs:
        key, value = None, None
        for n, _, v in fields(kv):
            if n == 1:
                key = v.decode("utf-8", "replace")
            elif n == 2:
                for an, _, av in fields(v):
                    if an == 1:
                        value = av.decode("utf-8", "replace")
                    elif an in (2, 3):
                        value = str(av)
        if key is not None and value is not None:
            out[key] = value
    return out


def spans_of(body):
    """Every span of an ExportTraceServiceRequest."""
    for number, _, resource_spans in fields(body):
        if number != 1:
            continue
        resource, scope_spans = {}, []
        for n, _, v in fields(resource_spans):
            if n == 1:
                resource = attributes(x for rn, _, x in fields(v) if rn == 1)
            elif n == 2:
                scope_spans.append(v)
        for ss in scope_spans:
            scope = ""
            for n, _, v in fields(ss):
                if n == 1:
                    for sn, _, sv in fields(v):
                        if sn == 1:
                            scope = sv.decode("utf-8", "replace")
                elif n == 2:
                    name, parent, attrs = "", False, []
                    for fn, _, fv in fields(v):
                        if fn == 4 and fv:
                            parent = True
                        elif fn == 5:
                            name = fv.decode("utf-8", "replace")
                        elif fn == 9:
                            attrs.append(fv)
                    yield {
                        "service": resource.get("service.name", ""),
                        "instance": resource.get("service.instance.id", ""),
                        "scope": scope,
                        "name": name,
                        "parent": parent,
                        "attributes": attributes(attrs),
                    }


class Collector(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/v1/traces":
            try:
                got = list(spans_of(body))
            except (ValueError, IndexError, struct.error):
                self.send_response(400)
                self.end_headers()
                return
            with lock:
                counts["trace_posts"] += 1
                room = max(0, MAX_SPANS - len(spans))
                spans.extend(got[:room])
                counts["spans_dropped"] += len(got) - min(len(got), room)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        with lock:
            key = "metrics_posts" if self.path == "/v1/metrics" else "other_posts"
            counts[key] += 1
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Query(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split("?")[0] != "/api/spans":
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        with lock:
            body = json.dumps({"counts": dict(counts), "spans": list(spans)}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    servers = [
        ThreadingHTTPServer(("0.0.0.0", port), handler)
        for port, handler in ((4318, Collector), (16686, Query), (14269, Health))
    ]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    servers[0].serve_forever()
