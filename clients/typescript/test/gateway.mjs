// toolfleet.js against a running gateway, as an application uses it.
//
// usage: node test/gateway.mjs BASE_URL API_KEY BUSY_BASE_URL
//
// BASE_URL is a gateway of a fleet serving the test pack; BUSY_BASE_URL a gateway of the
// same fleet that follows one turn at a time (TOOLFLEET_GATEWAY_MAX_TURNS=1). Runs each
// scenario and prints one JSON object with what each saw; the caller asserts on it.
import { GatewayClient, ToolfleetError } from "../toolfleet.js";

const [BASE, KEY, BUSY] = process.argv.slice(2);

const behave = (...sleeps) => ({
  type: "tool_calls",
  calls: sleeps.map((ms, i) => ({ id: `c${i}`, toolName: "test.behave", arguments: { sleep_ms: ms, value: i } })),
});

const seqs = (events) => events.map((e) => e.seq ?? null);
const types = (events) => events.map((e) => e.type);

async function collect(stream, limit = Infinity) {
  const events = [];
  for await (const event of stream) {
    events.push(event);
    if (events.length >= limit) break;
  }
  return events;
}

/** A fetch that cuts the first event stream after `frames` frames, as a dropped connection would. */
function cuttingFetch(frames, log) {
  let cut = false;
  return async (url, init = {}) => {
    const headers = new Headers(init.headers);
    log.push({ method: init.method ?? "GET", path: new URL(url).pathname, lastEventId: headers.get("last-event-id") });
    const response = await fetch(url, init);
    if (cut || !(response.headers.get("content-type") ?? "").startsWith("text/event-stream")) return response;
    cut = true;
    const reader = response.body.getReader();
    let seen = 0;
    let text = "";
    const decoder = new TextDecoder();
    const encoder = new TextEncoder();
    const body = new ReadableStream({
      async pull(controller) {
        if (seen >= frames) {
          reader.cancel().catch(() => {});
          controller.error(new TypeError("terminated: the connection was reset"));
          return;
        }
        const { value, done } = await reader.read();
        if (done) return controller.close();
        text += decoder.decode(value, { stream: true });
        // Pass whole frames only, up to `frames` of them.
        let end;
        while (seen < frames && (end = text.indexOf("\n\n")) >= 0) {
          controller.enqueue(encoder.encode(text.slice(0, end + 2)));
          text = text.slice(end + 2);
          seen += 1;
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  };
}

async function dropped() {
  const log = [];
  const client = new GatewayClient({ baseUrl: BASE, apiKey: KEY, fetch: cuttingFetch(3, log) });
  const stream = await client.submit({ decision: behave(100, 300, 600), deadline_ms: 30000 });
  const events = await collect(stream);
  const final = events.at(-1);
  return {
    seqs: seqs(events), types: types(events), resumes: stream.resumes,
    states: final.results.map((r) => r.state), summary: final.summary,
    streamToken: typeof stream.streamToken === "string" && stream.streamToken.startsWith("tfs_"),
    requests: log,
  };
}

async function leftAndResumed() {
  const client = new GatewayClient({ baseUrl: BASE, apiKey: KEY });
  const stream = await client.submit({ decision: behave(800), deadline_ms: 30000 });
  const first = await collect(stream, 2); // ack, pending; the connection is closed
  const after = stream.lastSeq;
  const rest = await collect(client.follow(stream.turnId, { after }));
  // Iterating the first stream again resumes it where it stopped.
  const again = await collect(stream);
  const stored = await client.turn(stream.turnId);
  return {
    first: seqs(first), after, rest: seqs(rest), restTypes: types(rest), again: seqs(again),
    stored: { status: stored.status, count: stored.events.length },
  };
}

async function withToken() {
  const client = new GatewayClient({ baseUrl: BASE, apiKey: KEY });
  const grant = await client.submitAsync({ decision: behave(200), deadline_ms: 30000 });
  // What a browser holds: the URL of its EventSource, no key.
  const direct = await fetch(grant.events_url, { headers: { Accept: "text/event-stream" } });
  const directStatus = direct.status;
  await direct.body.cancel();
  const keyless = new GatewayClient({ baseUrl: BASE });
  const events = await collect(keyless.follow(grant.turn_id, { token: grant.token }));
  let cancelRefused = null;
  try {
    await keyless.cancel(grant.turn_id);
  } catch (e) {
    cancelRefused = { status: e.status, code: e.code };
  }
  const minted = await client.streamToken(grant.turn_id);
  return {
    types: types(events), seqs: seqs(events),
    eventsUrl: client.eventsUrl(grant.turn_id, grant.token) === grant.events_url,
    directStatus, cancelRefused, minted: minted.token.startsWith("tfs_") && minted.turn_id === grant.turn_id,
  };
}

async function cancelled() {
  const client = new GatewayClient({ baseUrl: BASE, apiKey: KEY });
  const stream = await client.submit({ decision: behave(5000), deadline_ms: 30000 });
  const events = [];
  for await (const event of stream) {
    events.push(event);
    if (event.type === "tool_state" && event.state === "pending") break;
  }
  const started = Date.now();
  const reply = await stream.cancel();
  const final = await stream.final();
  const second = await client.cancel(stream.turnId);
  return {
    reply, second, states: final.results.map((r) => r.state), summary: final.summary,
    finalAfterMs: Date.now() - started,
  };
}

async function refused() {
  const client = new GatewayClient({ baseUrl: BASE, apiKey: KEY });
  const out = {};
  for (const [name, run] of [
    ["decision", () => client.submit({ decision: { type: "nonsense" } })],
    ["deadline", () => client.submit({ decision: behave(1), deadline_ms: 0 })],
    ["key", () => new GatewayClient({ baseUrl: BASE, apiKey: "tfk_" + "0".repeat(64) }).submit({ decision: behave(1) })],
    ["unknown", () => client.follow("never-submitted-here").final()],
  ]) {
    try {
      await run();
      out[name] = null;
    } catch (e) {
      out[name] = { error: e instanceof ToolfleetError, status: e.status, code: e.code, retryable: e.retryable };
    }
  }
  out.tools = (await client.tools("openai")).map((t) => t.function?.name ?? t.name).includes("test__behave");
  return out;
}

async function overloaded() {
  const retries = [];
  const client = new GatewayClient({ baseUrl: BUSY, apiKey: KEY, onRetry: (notice) => retries.push(notice) });
  const first = await client.submit({ decision: behave(1500), deadline_ms: 30000 });
  const firstDone = first.final();
  // A client that does not wait: the refusal, typed.
  let refusal = null;
  try {
    await new GatewayClient({ baseUrl: BUSY, apiKey: KEY, maxRetries: 0 }).submit({ decision: behave(1) });
  } catch (e) {
    refusal = { status: e.status, code: e.code, retryable: e.retryable, retryAfterMs: e.retryAfterMs };
  }
  const started = Date.now();
  const second = await client.run({ decision: behave(10), deadline_ms: 30000 });
  const acceptedAfterMs = Date.now() - started;
  const firstFinal = await firstDone;
  return {
    refusal, retries, acceptedAfterMs, secondSummary: second.summary, firstSummary: firstFinal.summary,
  };
}

const report = {};
for (const [name, scenario] of Object.entries({ dropped, leftAndResumed, withToken, cancelled, refused, overloaded })) {
  report[name] = await scenario();
}
console.log(JSON.stringify(report));
