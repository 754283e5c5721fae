// Types of toolfleet.js: a client of the toolfleet HTTP gateway (docs/PROTOCOL.md §11).
// The event and body shapes are those of PROTOCOL §3 (JSON Schemas in docs/schemas/).

/** How many times a refused (429, 503) or failed request is sent again. */
export const DEFAULT_MAX_RETRIES: number;
/** How many times in a row a stream resumes without receiving an event before it gives up. */
export const DEFAULT_MAX_RESUMES: number;

/** A call's error (PROTOCOL §3.5). */
export interface CallError {
  code: string;
  message: string;
  retryable?: boolean;
  retry_after_ms?: number;
  user_message?: string;
}

export type CallState = "pending" | "running" | "done" | "error" | "timeout" | "skipped" | "cancelled";

/** One call's result in the `final` event (PROTOCOL §3.4). */
export interface CallResult {
  tool_call_id: string;
  name: string;
  ok: boolean;
  state: CallState;
  result: unknown;
  error: CallError | null;
  started_at: string | null;
  ended_at: string | null;
  duration_ms: number;
  attempts: number;
  summary?: string;
  worker_id?: string;
}

export interface Summary {
  total: number;
  ok: number;
  errors: number;
  timeouts: number;
  skipped: number;
  cancelled?: number;
}

/** Fields every stored event carries: `seq`, its position among the turn's events (the
 * frame's `id:`). */
interface Stored {
  seq?: number;
  turn_id: string;
}

export interface AckEvent extends Stored {
  type: "ack";
  text: string;
  calls: { tool_call_id: string; name: string }[];
  deadline_ms?: number;
}

export interface ToolStateEvent extends Stored {
  type: "tool_state";
  tool_call_id: string;
  name: string;
  state: CallState;
  error?: CallError;
}

export interface NarrationEvent extends Stored {
  type: "narration";
  text: string;
}

export interface FinalEvent extends Stored {
  type: "final";
  text: string;
  results: CallResult[];
  summary: Summary;
  history: { openai: object[]; anthropic: object[] };
  deadline_hit: boolean;
  history_omitted?: boolean;
}

export interface ErrorEvent {
  type: "error";
  turn_id?: string;
  error: CallError;
}

/** A turn event (PROTOCOL §3.2). */
export type TurnEvent = AckEvent | ToolStateEvent | NarrationEvent | FinalEvent | ErrorEvent;

/** The body of `POST /v1/turns` (PROTOCOL §11.1); the key decides the tenant. */
export interface TurnRequest {
  decision: unknown;
  turn_id?: string;
  tenant_id?: string;
  session_id?: string;
  user_message?: string;
  /** The turn's budget in ms, at least 1; leave it out for the fleet's default. */
  deadline_ms?: number;
  options?: { max_calls?: number; concurrency?: number };
  context?: Record<string, unknown>;
}

/** `DELETE /v1/turns/{id}` (PROTOCOL §8.4a). */
export interface CancelReply {
  turn_id: string;
  outcome: "cancelled" | "already_ended" | "unknown_turn" | "invalid_request" | "unavailable";
  ended?: "cancelled" | "complete" | "deadline" | "no_tools";
}

/** A stream token for one turn (PROTOCOL §11.1d); `events_url` is absolute against `baseUrl`. */
export interface StreamGrant {
  turn_id: string;
  token: string;
  expires_at: string;
  events_url: string;
}

/** What `onRetry` is told before a request is sent again. */
export interface RetryNotice {
  attempt: number;
  /** 429 or 503, or 0 when the network failed. */
  status: number;
  code: string;
  waitMs: number;
}

export interface GatewayClientOptions {
  /** The gateway's address, e.g. `http://127.0.0.1:8080`; "" (same origin) by default. */
  baseUrl?: string;
  /** An API key (`tfk_…`), sent as `Authorization: Bearer`. None for token-only streams. */
  apiKey?: string | null;
  /** The `fetch` to use; `globalThis.fetch` by default. */
  fetch?: typeof fetch;
  /** Times a 429/503 or failed request is sent again (default 5). */
  maxRetries?: number;
  /** Resumes in a row without an event before a stream gives up (default 8). */
  maxResumes?: number;
  /** Called before a request is sent again. */
  onRetry?: ((notice: RetryNotice) => void) | null;
  /** Extra headers of every request (e.g. `traceparent`). */
  headers?: Record<string, string>;
}

/** A refused request, or a turn that ended with an `error` event. */
export class ToolfleetError extends Error {
  /** HTTP status; 0 for a turn's own `error` event or a failed fetch. */
  status: number;
  /** Stable error code (PROTOCOL §4.2, §11.3), `network`, `stream_lost` or `closed`. */
  code: string;
  retryable: boolean;
  retryAfterMs: number | null;
  /** The explanation alone, for people (never matched on). */
  detail: string;
  event: ErrorEvent | null;
}

/** The events of one turn in `seq` order, each once; resumes when its connection drops. */
export class TurnStream implements AsyncIterable<TurnEvent> {
  readonly client: GatewayClient;
  readonly turnId: string;
  /** The `seq` of the last event handed out (0 before any). */
  lastSeq: number;
  /** A token that reads this turn's events, from the submission's answer. */
  streamToken: string | null;
  /** The `traceparent` of the submission's answer. */
  traceparent: string | null;
  /** How many times the stream connected again after its connection dropped. */
  resumes: number;
  /** Whether the last event (`final` or `error`) was handed out. */
  done: boolean;
  [Symbol.asyncIterator](): AsyncIterator<TurnEvent>;
  /** Reads to the end: the `final` event; rejects with a `ToolfleetError` on `error`. */
  final(): Promise<FinalEvent>;
  /** Cancels the turn; its `final` still comes on this stream. */
  cancel(options?: { signal?: AbortSignal }): Promise<CancelReply>;
  /** Stops reading; the turn runs on. */
  close(): void;
}

export class GatewayClient {
  constructor(options?: GatewayClientOptions);
  readonly baseUrl: string;
  /** Submits a turn; resolves once it is accepted, with its event stream. */
  submit(request: TurnRequest, options?: { signal?: AbortSignal; headers?: Record<string, string> }): Promise<TurnStream>;
  /** Submits with `Prefer: respond-async`: resolves at acceptance with a stream token. */
  submitAsync(request: TurnRequest, options?: { signal?: AbortSignal }): Promise<StreamGrant>;
  /** The events of a turn after `seq` `after`, through the key or a stream `token`. */
  follow(turnId: string, options?: { after?: number; token?: string | null; signal?: AbortSignal }): TurnStream;
  /** Submits a turn and resolves with its `final` event. */
  run(request: TurnRequest, options?: { signal?: AbortSignal }): Promise<FinalEvent>;
  cancel(turnId: string, options?: { signal?: AbortSignal }): Promise<CancelReply>;
  turn(turnId: string, options?: { signal?: AbortSignal }): Promise<{ turn_id: string; status: "running" | "ended"; events: TurnEvent[]; final?: FinalEvent }>;
  streamToken(turnId: string, options?: { signal?: AbortSignal }): Promise<StreamGrant>;
  /** The URL a browser's `EventSource` follows a turn at with a stream token. */
  eventsUrl(turnId: string, token: string): string;
  tools(format?: "openai" | "anthropic" | "mcp" | "native", options?: { signal?: AbortSignal }): Promise<object[]>;
}

/** A new turn id: 32 lowercase hex digits. */
export function newTurnId(): string;

/** Splits a Server-Sent Events body into frames. */
export function sseFrames(body: ReadableStream<Uint8Array>): AsyncGenerator<{ id: string | null; event: string; data: string }>;
