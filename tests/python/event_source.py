"""A browser's own EventSource following a gateway turn through a dropped connection.

usage: event_source.py BASE_URL API_KEY TURN_BODY_JSON

What a frontend does: its backend (this script, holding the API key) submits the turn
with `Prefer: respond-async` and gets a stream token's `events_url`; the page in
headless Chromium opens `new EventSource(events_url)` — no key in the browser, none in
the URL. Between the browser and the gateway sits a TCP proxy that cuts the first event
stream after two events, so the EventSource reconnects by itself with `Last-Event-ID`.
Also opens an EventSource without a token and one with a token for another turn.

Prints one JSON object: the events the page received (id, type), how often the stream
opened and failed, the `/events` requests the proxy saw (with their Last-Event-ID), and
the readyState/event counts of the two refused EventSources.
"""

import json
import socket
import sys
import threading
import urllib.request

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
# Frames the first event stream carries before the proxy cuts it.
CUT_AFTER_FRAMES = 2


class Proxy:
    """Forwards 127.0.0.1:<port> to the gateway; cuts the first `/events` response."""

    def __init__(self, upstream_host, upstream_port):
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.events_requests = []
        self.cut = False
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client):
        upstream = socket.create_connection(self.upstream, timeout=60)
        head = client.recv(65536)
        text = head.decode("latin-1")
        line = text.split("\r\n", 1)[0]
        cut_this = False
        if "/events" in line:
            last = None
            for header in text.split("\r\n")[1:]:
                if header.lower().startswith("last-event-id:"):
                    last = header.split(":", 1)[1].strip()
            with self.lock:
                self.events_requests.append({"line": line, "last_event_id": last})
                if not self.cut:
                    self.cut = cut_this = True
        upstream.sendall(head)
        threading.Thread(target=self.pump, args=(client, upstream), daemon=True).start()
        self.pump(upstream, client, CUT_AFTER_FRAMES if cut_this else None)
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    @staticmethod
    def pump(source, sink, cut_after=None):
        """Copies `source` to `sink` until `source` ends or fails; with `cut_after`, only up
        to the end of that many event frames (those with an `id:`), however the bytes
        arrive: a turn that ended before the browser connected is replayed in one chunk,
        and the cut still falls between its events."""
        pending = b""  # what was sent since the last frame's end
        frames = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if cut_after is None:
                    sink.sendall(data)
                    continue
                buf, start = pending + data, 0
                while True:
                    end = buf.find(b"\n\n", start)
                    if end < 0:
                        break
                    frame, start = buf[start:end], end + 2
                    if b"id: " in frame:
                        frames += 1
                        if frames >= cut_after:
                            sink.sendall(buf[len(pending):start])
                            return
                sink.sendall(data)
                pending = buf[start:]
        except OSError:
            pass


FOLLOW = """async ([url, limitMs]) => {
  const seen = [];
  let opens = 0, errors = 0;
  await new Promise((resolve) => {
    const source = new EventSource(url);
    const timer = setTimeout(() => { source.close(); resolve(); }, limitMs);
    source.onopen = () => { opens += 1; };
    source.onerror = () => { errors += 1; };
    for (const type of ['ack', 'tool_state', 'narration', 'final', 'error']) {
      source.addEventListener(type, (e) => {
        seen.push({id: e.lastEventId, type, data: JSON.parse(e.data)});
        if (type === 'final' || type === 'error') {
          source.close(); clearTimeout(timer); resolve();
        }
      });
    }
  });
  return {events: seen, opens, errors};
}"""

REFUSED = """async ([url]) => {
  const source = new EventSource(url);
  let events = 0;
  source.onmessage = () => { events += 1; };
  // Not 'error': an EventSource fires its own `error` when the connection fails.
  for (const type of ['ack', 'tool_state', 'narration', 'final']) {
    source.addEventListener(type, () => { events += 1; });
  }
  const started = Date.now();
  while (source.readyState !== 2 && Date.now() - started < 10000) {
    await new Promise((r) => setTimeout(r, 50));
  }
  const state = source.readyState;
  source.close();
  return {readyState: state, events};
}"""


def submit(base, key, body):
    request = urllib.request.Request(
        base + "/v1/turns",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": "Bearer " + key,
            "Content-Type": "application/json",
            "Prefer": "respond-async",
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        return response.status, json.loads(response.read())


def main() -> None:
    base, key, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    host, port = base.removeprefix("http://").split(":")
    proxy = Proxy(host, int(port))
    front = f"http://127.0.0.1:{proxy.port}"
    status, accepted = submit(base, key, body)
    other_body = dict(body, turn_id=body["turn_id"] + "-other")
    _, other = submit(base, key, other_body)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        page = browser.new_page()
        # The frontend's page, of the proxy's origin, served by the browser itself: the
        # only connections to the proxy are the EventSources' own.
        page.route(
            front + "/blank",
            lambda route: route.fulfill(
                status=200, content_type="text/html", body="<html><body></body></html>"
            ),
        )
        page.goto(front + "/blank")
        followed = page.evaluate(FOLLOW, [front + accepted["events_url"], 60_000])
        no_token = page.evaluate(
            REFUSED, [front + f"/v1/turns/{accepted['turn_id']}/events"]
        )
        wrong_turn = page.evaluate(
            REFUSED,
            [front + f"/v1/turns/{accepted['turn_id']}/events?token={other['token']}"],
        )
        browser.close()
    report = {
        "status": status,
        "accepted": accepted,
        "key_in_url": key in accepted["events_url"],
        "events": [{"id": e["id"], "type": e["type"]} for e in followed["events"]],
        "final": next(
            (e["data"] for e in followed["events"] if e["type"] == "final"), None
        ),
        "opens": followed["opens"],
        "errors": followed["errors"],
        "events_requests": proxy.events_requests,
        "no_token": no_token,
        "wrong_turn": wrong_turn,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
