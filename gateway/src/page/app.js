// The live turn page: submits a decision to POST /v1/turns through the gateway client of
// clients/typescript (served at /page/toolfleet.js) and draws every event as it arrives;
// a dropped connection is resumed by the client. Plain JavaScript modules, no libraries.
import { GatewayClient } from "/page/toolfleet.js";

const $ = (id) => document.getElementById(id);
const TERMINAL = ["done", "error", "timeout", "skipped", "cancelled"];
let config = { jaeger_url: "", examples: [] };
let turn = null;

async function loadConfig() {
  const response = await fetch("/page/config.json");
  config = await response.json();
  const select = $("example");
  for (const example of config.examples) {
    const option = document.createElement("option");
    option.value = example.name;
    option.textContent = example.name;
    select.appendChild(option);
  }
  select.addEventListener("change", showExample);
  showExample();
  // A key typed (or filled in) while the settings loaded is kept.
  if (!$("key").value) $("key").value = localStorage.getItem("toolfleet.key") || "";
}

function showExample() {
  const example = config.examples.find((e) => e.name === $("example").value);
  if (example) $("decision").value = JSON.stringify(example.decision, null, 2);
}

function problem(text) {
  $("problem").textContent = text || "";
}

function reset() {
  turn = { start: performance.now(), calls: new Map(), order: [], end: null };
  $("calls").querySelector("tbody").innerHTML = "";
  for (const id of ["ack", "narration", "summary", "trace"]) $(id).hidden = true;
  $("narration").textContent = "";
  $("turn-id").textContent = "";
  $("status").textContent = "submitting…";
  $("status").dataset.done = "false";
}

function now() {
  return performance.now() - turn.start;
}

function call(id, name) {
  if (!turn.calls.has(id)) {
    const row = document.createElement("tr");
    row.dataset.callId = id;
    row.innerHTML = '<td class="id"></td><td class="tool"></td><td><span class="state"></span></td>' +
      '<td><div class="track"><div class="bar"></div></div></td><td class="ms"></td>';
    row.querySelector(".id").textContent = id;
    row.querySelector(".tool").textContent = name;
    $("calls").querySelector("tbody").appendChild(row);
    turn.calls.set(id, { id, name, row, state: "pending", from: now(), to: null, ms: null });
    turn.order.push(id);
  }
  return turn.calls.get(id);
}

function setState(entry, state) {
  entry.state = state;
  const at = now();
  if (state === "running") entry.from = at;
  if (TERMINAL.includes(state) && entry.to === null) entry.to = at;
}

function draw() {
  if (!turn) return;
  const axis = Math.max(turn.end ?? now(), 1);
  $("axis-end").textContent = "(0–" + axis.toFixed(0) + " ms)";
  for (const entry of turn.calls.values()) {
    const row = entry.row;
    row.dataset.state = entry.state;
    const badge = row.querySelector(".state");
    badge.textContent = entry.state;
    badge.className = "state " + entry.state;
    const to = entry.to ?? now();
    const bar = row.querySelector(".bar");
    bar.className = "bar " + entry.state;
    bar.style.left = (100 * entry.from / axis).toFixed(2) + "%";
    bar.style.width = Math.max(0.5, 100 * (to - entry.from) / axis).toFixed(2) + "%";
    const ms = entry.ms ?? (to - entry.from);
    row.querySelector(".ms").textContent = ms.toFixed(0);
  }
  if (turn.end === null) requestAnimationFrame(draw);
}

function onEvent(kind, event) {
  switch (kind) {
    case "ack":
      $("turn-id").textContent = "turn " + event.turn_id;
      $("ack").textContent = event.text;
      $("ack").hidden = false;
      for (const c of event.calls) call(c.tool_call_id, c.name);
      $("status").textContent = "running";
      break;
    case "tool_state":
      setState(call(event.tool_call_id, event.name), event.state);
      break;
    case "narration":
      $("narration").hidden = false;
      $("narration").textContent += ($("narration").textContent ? " " : "") + event.text;
      break;
    case "final":
      finish(event);
      break;
    case "error":
      turn.end = now();
      problem(event.error.code + ": " + event.error.message);
      $("status").textContent = "failed";
      $("status").dataset.done = "true";
      break;
  }
  draw();
}

function finish(final) {
  turn.end = now();
  for (const result of final.results) {
    const entry = call(result.tool_call_id, result.name);
    setState(entry, result.state);
    entry.ms = result.duration_ms;
  }
  $("narration").hidden = false;
  $("narration").textContent = final.text;
  const s = final.summary;
  $("summary").textContent = `summary: total ${s.total}, ok ${s.ok}, errors ${s.errors}, ` +
    `timeouts ${s.timeouts}, skipped ${s.skipped}` + (s.cancelled ? `, cancelled ${s.cancelled}` : "") + (final.deadline_hit ? " (deadline hit)" : "");
  $("summary").hidden = false;
  $("status").textContent = "finished in " + turn.end.toFixed(0) + " ms";
  $("status").dataset.done = "true";
}

function traceLink(traceparent) {
  const parts = (traceparent || "").split("-");
  if (parts.length !== 4 || !config.jaeger_url) return;
  $("trace").href = config.jaeger_url + "/trace/" + parts[1];
  $("trace").hidden = false;
}

async function submit() {
  problem("");
  let decision, context;
  try {
    decision = JSON.parse($("decision").value);
    context = JSON.parse($("context").value || "{}");
  } catch (e) {
    problem("not JSON: " + e.message);
    return;
  }
  const key = $("key").value.trim();
  localStorage.setItem("toolfleet.key", key);
  reset();
  requestAnimationFrame(draw);
  $("submit").disabled = true;
  const client = new GatewayClient({ apiKey: key });
  try {
    const stream = await client.submit({ decision, context, session_id: "live-page" });
    traceLink(stream.traceparent);
    for await (const event of stream) onEvent(event.type, event);
  } catch (e) {
    onEvent("error", { error: { code: e.code ?? "network", message: e.detail ?? e.message } });
  } finally {
    $("submit").disabled = false;
  }
}

$("submit").addEventListener("click", submit);
loadConfig().catch((e) => problem("could not load the page's settings: " + e.message));
