// The Server-Sent Events parser of toolfleet.js on its own: frames split at every byte,
// every line ending, comments, multi-line data, a frame without id. Run: npm test
import assert from "node:assert/strict";
import { test } from "node:test";
import { sseFrames } from "../toolfleet.js";

/** A body that delivers `text` in the given pieces. */
function body(pieces) {
  const encoder = new TextEncoder();
  return new ReadableStream({
    start(controller) {
      for (const piece of pieces) controller.enqueue(encoder.encode(piece));
      controller.close();
    },
  });
}

async function frames(pieces) {
  const out = [];
  for await (const frame of sseFrames(body(pieces))) out.push(frame);
  return out;
}

const TEXT =
  ": keep-alive\n" +
  "id: 1\nevent: ack\ndata: {\"type\":\"ack\",\"text\":\"Sure – one moment\"}\n\n" +
  "event: error\ndata: {\"type\":\"error\"}\n\n" +
  "id: 2\r\nevent: narration\r\ndata: line one\r\ndata:line two\r\n\r\n" +
  "id: 3\revent: final\rdata: {}\r\r";

const EXPECTED = [
  { id: "1", event: "ack", data: "{\"type\":\"ack\",\"text\":\"Sure – one moment\"}" },
  { id: null, event: "error", data: "{\"type\":\"error\"}" },
  { id: "2", event: "narration", data: "line one\nline two" },
  { id: "3", event: "final", data: "{}" },
];

test("one piece", async () => {
  assert.deepEqual(await frames([TEXT]), EXPECTED);
});

test("split at every position, multi-byte characters included", async () => {
  const bytes = new TextEncoder().encode(TEXT);
  for (let cut = 1; cut < bytes.length; cut++) {
    const decoder = new TextDecoder();
    // Pieces of raw bytes: a character may be cut in two.
    const stream = new ReadableStream({
      start(controller) {
        controller.enqueue(bytes.slice(0, cut));
        controller.enqueue(bytes.slice(cut));
        controller.close();
      },
    });
    const out = [];
    for await (const frame of sseFrames(stream)) out.push(frame);
    assert.deepEqual(out, EXPECTED, `cut at byte ${cut} (${decoder.decode(bytes.slice(0, cut)).slice(-8)})`);
  }
});

test("one byte at a time", async () => {
  const bytes = new TextEncoder().encode(TEXT);
  const stream = new ReadableStream({
    start(controller) {
      for (const b of bytes) controller.enqueue(new Uint8Array([b]));
      controller.close();
    },
  });
  const out = [];
  for await (const frame of sseFrames(stream)) out.push(frame);
  assert.deepEqual(out, EXPECTED);
});

test("a frame cut off by the end of the body is not handed out", async () => {
  assert.deepEqual(await frames(["id: 1\nevent: ack\ndata: {}\n\nid: 2\ndata: {\"par"]), [
    { id: "1", event: "ack", data: "{}" },
  ]);
});
