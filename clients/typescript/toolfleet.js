// toolfleet gateway client: submit a turn over HTTP and read its events as they come.
//
// One ES module with no dependencies, for browsers and Node 20+ alike (it needs only
// `fetch`, `ReadableStream`, `TextDecoder` and `crypto.getRandomValues`). Types are in
// toolfleet.d.ts. The wire is docs/PROTOCOL.md section 11:
//
// - POST /v1/turns with `Accept: text/event-stream` answers once the turn is accepted and
//   streams its events as Server-Sent Events, each stored event with `id:` = its `seq`;
// - GET /v1/turns/{id}/events with `Last-Event-ID` resumes after the last `seq` held;
// - DELETE /v1/turns/{id} cancels; POST /v1/turns/{id}/stream-token mints a token for a
//   browser's `EventSource`, which cannot send the API key;
// - 429 and 503 carry `Retry-After` (503 `overloaded`: the fleet or the gateway is full).
//
// A stream resumes by itself when its connection drops, hands every event out once and
// in `seq` order, and waits out `Retry-After` before asking again. The turn id is chosen
// here, so a submission whose answer was lost is sent again and follows the same turn
// (the gateway never runs a turn's calls twice).

/** How many times a refused (429, 503) or failed request is sent again. */
export const DEFAULT_MAX_RETRIES = 5;
/** How many times in a row a stream resumes without receiving an event before it gives up. */
export const DEFAULT_MAX_RESUMES = 8;
/** First pause before a resume or a retry after a network failure; doubles up to 4 s. */
const BACKOFF_START_MS = 250;
const BACKOFF_MAX_MS = 4000;
/** Turn ids the gateway takes: 1-64 of [A-Za-z0-9_-]. */
const TURN_ID = /^[A-Za-z0-9_-]{1,64}$/;

/** A refused request or a turn that ended with an `error` event. */
export class ToolfleetError extends Error {
  constructor({ status = 0, code, message, retryable = false, retryAfterMs = null, event = null }) {
    super(`${code}: ${message}`);
    this.name = "ToolfleetError";
    /** The explanation alone, for people (never matched on). */
    this.detail = message;
    /** HTTP status (0 when the turn's own `error` event or the network failed). */
    this.status = status;
    /** The stable error code (PROTOCOL 4.2, 11.3), or `network` for a failed fetch. */
    this.code = code;
    this.retryable = retryable;
    /** How long to wait before asking again, when the answer said. */
    this.retryAfterMs = retryAfterMs;
    /** The `error` event, when the turn ended with one. */
    this.event = event;
  }
}

/** A new turn id: 32 lowercase hex digits. */
export function newTurnId() {
  const bytes = new Uint8Array(16);
  globalThis.crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

const sleep = (ms, signal) =>
  new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });

/** `Retry-After` (seconds or an HTTP date) in milliseconds, or null. */
function retryAfterMs(response, body) {
  const fromBody = body?.error?.retry_after_ms;
  if (Number.isFinite(fromBody) && fromBody >= 0) return fromBody;
  const header = response.headers.get("retry-after");
  if (!header) return null;
  const seconds = Number(header);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const at = Date.parse(header);
  return Number.isFinite(at) ? Math.max(0, at - Date.now()) : null;
}

/** The error of a refused answer, from its `{"error": {...}}` body. */
async function refusal(response) {
  const body = await response.json().catch(() => null);
  const error = body?.error ?? {};
  return new ToolfleetError({
    status: response.status,
    code: error.code ?? `http_${response.status}`,
    message: error.message ?? (response.statusText || "refused"),
    retryable: error.retryable ?? (response.status === 429 || response.status === 503),
    retryAfterMs: retryAfterMs(response, body),
  });
}

function isAbort(error) {
  return error?.name === "AbortError";
}

/**
 * Splits a Server-Sent Events body into frames `{id, event, data}` (the `data:` lines
 * joined with "\n"), as the HTML specification parses them: LF, CRLF or CR line ends,
 * comments (`:`) skipped, one optional space after the colon.
 */
export async function* sseFrames(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let frame = { id: null, event: "", data: [] };
  const line = (text) => {
    if (text === "") {
      const out = frame.data.length ? { id: frame.id, event: frame.event || "message", data: frame.data.join("\n") } : null;
      frame = { id: null, event: "", data: [] };
      return out;
    }
    if (text.startsWith(":")) return null;
    const colon = text.indexOf(":");
    const field = colon < 0 ? text : text.slice(0, colon);
    let value = colon < 0 ? "" : text.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") frame.data.push(value);
    else if (field === "event") frame.event = value;
    else if (field === "id" && !value.includes("\0")) frame.id = value;
    return null;
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      for (;;) {
        const end = buffer.search(/\r\n|\r|\n/);
        // A CR at the end of what came may be the first half of a CRLF.
        if (end < 0 || (!done && end === buffer.length - 1 && buffer[end] === "\r")) break;
        const width = buffer.startsWith("\r\n", end) ? 2 : 1;
        const out = line(buffer.slice(0, end));
        buffer = buffer.slice(end + width);
        if (out) yield out;
      }
      if (done) return;
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** A client of one gateway, for one API key (or none: streams followed with a token). */
export class GatewayClient {
  /**
   * @param {object} options see toolfleet.d.ts
   */
  constructor({ baseUrl = "", apiKey = null, fetch: fetchImpl, maxRetries = DEFAULT_MAX_RETRIES, maxResumes = DEFAULT_MAX_RESUMES, onRetry = null, headers = {} } = {}) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.apiKey = apiKey;
    this.fetch = fetchImpl ?? globalThis.fetch.bind(globalThis);
    this.maxRetries = maxRetries;
    this.maxResumes = maxResumes;
    this.onRetry = onRetry;
    this.headers = headers;
  }

  /** Headers of every request: the key, then the caller's own. */
  _headers(extra = {}) {
    const headers = { ...this.headers, ...extra };
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    return headers;
  }

  _url(path, query = {}) {
    const params = new URLSearchParams();
    for (const [name, value] of Object.entries(query)) if (value !== undefined && value !== null) params.set(name, String(value));
    const tail = params.toString();
    return `${this.baseUrl}${path}${tail ? `?${tail}` : ""}`;
  }

  /**
   * Sends a request made by `make()` until it is answered with something other than 429
   * or 503, waiting `Retry-After` between tries (at most `maxRetries` times); a network
   * failure is tried again after a doubling pause. Every request sent this way is
   * idempotent (a turn is submitted with its id).
   */
  async _send(make, signal) {
    let pause = BACKOFF_START_MS;
    for (let attempt = 0; ; attempt++) {
      let response;
      try {
        response = await this.fetch(...make());
      } catch (error) {
        if (isAbort(error) || signal?.aborted || attempt >= this.maxRetries) {
          throw isAbort(error) ? error : new ToolfleetError({ code: "network", message: String(error?.message ?? error), retryable: true });
        }
        this.onRetry?.({ attempt: attempt + 1, status: 0, code: "network", waitMs: pause });
        await sleep(pause, signal);
        pause = Math.min(pause * 2, BACKOFF_MAX_MS);
        continue;
      }
      if ((response.status === 429 || response.status === 503) && attempt < this.maxRetries) {
        const error = await refusal(response);
        const waitMs = error.retryAfterMs ?? pause;
        this.onRetry?.({ attempt: attempt + 1, status: response.status, code: error.code, waitMs });
        await sleep(waitMs, signal);
        pause = Math.min(pause * 2, BACKOFF_MAX_MS);
        continue;
      }
      return response;
    }
  }

  async _json(method, path, { query, body, signal } = {}) {
    const headers = this._headers(body === undefined ? {} : { "Content-Type": "application/json" });
    const response = await this._send(() => [this._url(path, query), {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    }], signal);
    if (!response.ok) throw await refusal(response);
    return response.json();
  }

  /**
   * Submits a turn (the fields of PROTOCOL 3.1 but `tenant_id`, which the key decides)
   * and resolves once it is accepted, with the stream of its events. A `turn_id` is
   * chosen when the request has none. Rejects with a `ToolfleetError` when the gateway
   * refuses the turn (after waiting out up to `maxRetries` 429/503 answers).
   */
  async submit(request, { signal, headers = {} } = {}) {
    const body = { ...request };
    if (body.turn_id === undefined || body.turn_id === null) body.turn_id = newTurnId();
    if (!TURN_ID.test(body.turn_id)) {
      throw new ToolfleetError({ code: "invalid_request", message: "turn_id must be 1-64 characters of [A-Za-z0-9_-]" });
    }
    const stream = new TurnStream(this, body.turn_id, { signal });
    const send = () => [this._url("/v1/turns"), {
      method: "POST",
      headers: this._headers({ ...headers, "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify(body),
      signal: stream._abort.signal,
    }];
    const response = await this._send(send, stream._abort.signal);
    if (!response.ok) throw await refusal(response);
    stream._adopt(response);
    return stream;
  }

  /**
   * Submits a turn with `Prefer: respond-async`: resolves once it is accepted with
   * `{turn_id, token, expires_at, events_url}` (the URL made absolute against
   * `baseUrl`), ready for `new EventSource(events_url)` or `follow(turn_id, {token})`.
   */
  async submitAsync(request, { signal } = {}) {
    const body = { ...request };
    if (body.turn_id === undefined || body.turn_id === null) body.turn_id = newTurnId();
    const response = await this._send(() => [this._url("/v1/turns"), {
      method: "POST",
      headers: this._headers({ "Content-Type": "application/json", Prefer: "respond-async" }),
      body: JSON.stringify(body),
      signal,
    }], signal);
    if (response.status !== 202) throw await refusal(response);
    const accepted = await response.json();
    return { ...accepted, events_url: this.baseUrl + accepted.events_url };
  }

  /**
   * The events of turn `turnId` after `seq` `after` (0: all of them), read through the
   * API key, or through a stream `token` when given (a browser that holds no key).
   * Connects on the first read.
   */
  follow(turnId, { after = 0, token = null, signal } = {}) {
    const stream = new TurnStream(this, turnId, { token, signal });
    stream.lastSeq = after;
    return stream;
  }

  /** Submits a turn and resolves with its `final` event (rejects on an `error` one). */
  async run(request, options) {
    return (await this.submit(request, options)).final();
  }

  /** Cancels turn `turnId` (PROTOCOL 11.1c): `{turn_id, outcome, ended}`. */
  cancel(turnId, { signal } = {}) {
    return this._json("DELETE", `/v1/turns/${encodeURIComponent(turnId)}`, { signal });
  }

  /** Every event stored so far for turn `turnId`: `{turn_id, status, events, final?}`. */
  turn(turnId, { signal } = {}) {
    return this._json("GET", `/v1/turns/${encodeURIComponent(turnId)}`, { signal });
  }

  /** A stream token for turn `turnId` (PROTOCOL 11.1d), `events_url` made absolute. */
  async streamToken(turnId, { signal } = {}) {
    const minted = await this._json("POST", `/v1/turns/${encodeURIComponent(turnId)}/stream-token`, { signal });
    return { ...minted, events_url: this.baseUrl + minted.events_url };
  }

  /** The URL a browser's `EventSource` follows turn `turnId` at with a stream token. */
  eventsUrl(turnId, token) {
    return this._url(`/v1/turns/${encodeURIComponent(turnId)}/events`, { token });
  }

  /** The catalog of the key's tenant in `format` (`openai`, `anthropic`, `mcp`, `native`). */
  async tools(format = "openai", { signal } = {}) {
    return (await this._json("GET", "/v1/tools", { query: { format }, signal })).tools;
  }
}

/**
 * The events of one turn, in `seq` order, each once: `for await (const event of stream)`
 * ends after the `final` or `error` event. When the connection drops, the stream
 * resumes from the last `seq` it handed out.
 */
export class TurnStream {
  constructor(client, turnId, { token = null, signal } = {}) {
    this.client = client;
    this.turnId = turnId;
    /** The `seq` of the last event handed out (0 before any). */
    this.lastSeq = 0;
    /** A token that reads this turn's events (from the submission's answer). */
    this.streamToken = token;
    /** The `traceparent` of the submission's answer: the gateway span of the turn. */
    this.traceparent = null;
    /** How many times the stream connected again after its connection dropped. */
    this.resumes = 0;
    /** Whether the last event was handed out. */
    this.done = false;
    this._token = token;
    this._response = null;
    this._abort = new AbortController();
    this._closed = false;
    signal?.addEventListener("abort", () => this.close(), { once: true });
  }

  _adopt(response) {
    this._response = response;
    this.streamToken = response.headers.get("toolfleet-stream-token") ?? this.streamToken;
    this.traceparent = response.headers.get("traceparent");
  }

  /** Connects (again) for the events after `lastSeq`. */
  async _resume() {
    const client = this.client;
    const path = `/v1/turns/${encodeURIComponent(this.turnId)}/events`;
    const query = this._token ? { token: this._token, after: this.lastSeq } : {};
    const headers = this._token ? { Accept: "text/event-stream" } : client._headers({ Accept: "text/event-stream" });
    if (this.lastSeq > 0) headers["Last-Event-ID"] = String(this.lastSeq);
    const response = await client._send(() => [client._url(path, query), { method: "GET", headers, signal: this._abort.signal }], this._abort.signal);
    if (response.status === 204) return null;
    if (!response.ok) throw await refusal(response);
    return response;
  }

  async *[Symbol.asyncIterator]() {
    let quiet = 0;
    let pause = BACKOFF_START_MS;
    let lastError = null;
    while (!this.done && !this._closed) {
      let response = this._response;
      this._response = null;
      if (!response) {
        try {
          response = await this._resume();
        } catch (error) {
          if (this._closed) return;
          if (error instanceof ToolfleetError && error.code !== "network") throw error;
          response = undefined;
          lastError = error;
        }
        if (response === null) {
          // 204: the gateway holds nothing after the last seq handed out, the final.
          this.done = true;
          return;
        }
      }
      if (response) {
        try {
          for await (const frame of sseFrames(response.body)) {
            let event;
            try {
              event = JSON.parse(frame.data);
            } catch {
              continue;
            }
            const seq = frame.id === null ? null : Number(frame.id);
            if (seq !== null && Number.isInteger(seq)) {
              // A turn ends once: its `final` or `error` is new to a stream that has
              // not ended, whatever its seq (a Redis that lost acknowledged writes
              // when it died numbers later events again from below the one held).
              const last = event.type === "final" || event.type === "error";
              if (seq <= this.lastSeq && !last) continue;
              this.lastSeq = Math.max(seq, this.lastSeq);
              // The frame's `id:` is the event's `seq`, as on the NATS wire.
              event = { seq, ...event };
            } else if (event.type === "error" && event.error?.retryable && this.lastSeq > 0 && quiet + 1 < this.client.maxResumes) {
              // The gateway stopped waiting (`timeout`) or lost the fleet for a moment
              // (`unavailable`); the turn's events are stored: resume.
              lastError = new ToolfleetError({ code: event.error.code, message: event.error.message, retryable: true, event });
              break;
            }
            quiet = 0;
            pause = BACKOFF_START_MS;
            if (event.type === "final" || event.type === "error") this.done = true;
            yield event;
            if (this.done) return;
          }
        } catch (error) {
          if (this._closed) return;
          lastError = error;
        }
      }
      if (this.done || this._closed) return;
      quiet += 1;
      if (quiet >= this.client.maxResumes) {
        if (lastError instanceof ToolfleetError) throw lastError;
        throw new ToolfleetError({ code: "stream_lost", message: `no event of turn ${this.turnId} in ${quiet} connections: ${lastError?.message ?? "the stream ended early"}`, retryable: true });
      }
      await sleep(pause, this._abort.signal);
      pause = Math.min(pause * 2, BACKOFF_MAX_MS);
      this.resumes += 1;
    }
  }

  /** Reads the stream to its end: the `final` event; rejects with the `error` event's error. */
  async final() {
    for await (const event of this) {
      if (event.type === "final") return event;
      if (event.type === "error") {
        const e = event.error ?? {};
        throw new ToolfleetError({ code: e.code, message: e.message, retryable: !!e.retryable, retryAfterMs: e.retry_after_ms ?? null, event });
      }
    }
    throw new ToolfleetError({ code: "closed", message: `the stream of turn ${this.turnId} was closed before its final` });
  }

  /** Cancels the turn; its `final` (calls without a result `cancelled`) still comes here. */
  cancel(options) {
    return this.client.cancel(this.turnId, options);
  }

  /** Stops reading; the turn runs on (follow it again with `client.follow(turnId, {after: lastSeq})`). */
  close() {
    this._closed = true;
    this._abort.abort();
  }
}
