// A turn followed by toolfleet.js while its gateway is killed and started again.
//
// usage: node test/restart.mjs BASE_URL API_KEY
//
// Submits a turn whose call sleeps 3 s, reads its first two events, prints
// {"ready": turn_id} and reads on: the caller kills the gateway then and starts it again
// on the same address. Prints one JSON object with every event the stream handed out.
import { GatewayClient } from "../toolfleet.js";

const [BASE, KEY] = process.argv.slice(2);
const client = new GatewayClient({ baseUrl: BASE, apiKey: KEY });
const stream = await client.submit({
  decision: { type: "tool_calls", calls: [{ id: "slow", toolName: "test.behave", arguments: { sleep_ms: 3000 } }] },
  deadline_ms: 30000,
});
const events = [];
for await (const event of stream) {
  events.push(event);
  if (events.length === 2) console.log(JSON.stringify({ ready: stream.turnId }));
}
const final = events.at(-1);
console.log(JSON.stringify({
  seqs: events.map((e) => e.seq ?? null),
  types: events.map((e) => e.type),
  resumes: stream.resumes,
  states: final.results?.map((r) => r.state) ?? [],
}));
