//! `POST /v1/chat/completions`: the OpenAI Chat Completions API in front of a real model,
//! with the model's tool loop run on the fleet. A frontend changes only its base URL and
//! key.
//!
//! Owns the loop. The request goes upstream with the tools offered (the caller's own
//! plus the tenant's fleet tools, see [`offered_tools`]); while the model answers with
//! calls of fleet tools only, all of them run as one fleet turn (ids and order kept), every
//! result is appended as a `role: "tool"` message in the model's call order, and the
//! model is asked again. The caller gets the model's final answer; or, when a message
//! also calls a tool the caller declared itself, that message with *every* call in order
//! (`finish_reason: "tool_calls"`) and the fleet calls' ids in the `toolfleet` extension:
//! their turn already ran, and the gateway inserts their results (in place of anything the
//! caller sent for them) when the caller sends the conversation back with its own results.
//! Typed clients that build `tools` themselves ask for the fleet's tools beside their own
//! with the `X-Toolfleet-Tools: fleet` header. Each round's fleet turn id is a digest of the
//! tenant, the key, the conversation before the model's message and its calls
//! ([`turn_id`]): a retry re-attaches to its turn, no other conversation ever does. Limits: rounds, calls per round, a stop-after
//! gate (`first`, `burst`): the tightest of the configuration's, the API key's and the
//! request's `toolfleet` object. Counted in `toolfleet.chat.*` and the GenAI client
//! metrics.
//!
//! Streamed and unstreamed answers are the same: each round is read whole (streamed
//! tool-call deltas gathered into calls), and the chunks of the round that ends the loop
//! are sent as the upstream sent them; while fleet calls run the stream carries SSE
//! comments, which clients ignore. Upstream failures pass through with their status and
//! body; fleet failures become tool results. Never stores anything: a turn's results
//! live in the join for its retention time.

mod assemble;
mod turn_id;
mod upstream;

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use toolfleet_common::tool::CatalogFormat;
use toolfleet_common::turn::TurnOptions;
use toolfleet_common::{TurnEvent, TurnRequest};
use tracing::Instrument;

pub use assemble::{assemble, chunks_of};
pub use upstream::{Failure, Upstream, UpstreamError};

use crate::auth::Caller;
use crate::config::UpstreamConfig;
use crate::error::{codes, ApiError};
use crate::extract::ApiJson;
use crate::keys::{ChatLimits, StopAfter};
use crate::Gateway;
use turn_id::turn_id_of;

/// The extension object: loop options in a request, what the loop did in an answer.
pub const EXTENSION: &str = "toolfleet";
/// The request header that adds the fleet's tools beside the caller's own `tools`
/// (value `fleet`), for clients that build the `tools` array themselves.
pub const TOOLS_HEADER: &str = "x-toolfleet-tools";
/// How long the catalog may take.
const CATALOG_WAIT: Duration = Duration::from_secs(5);

/// The request's `toolfleet` object (removed before the request goes upstream).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoopOptions {
    /// Rounds of fleet calls before the loop stops (capped by the configuration).
    pub max_rounds: Option<u32>,
    /// Calls of one round that run (capped by the configuration).
    pub max_calls_per_round: Option<usize>,
    /// Stop offering tools after the first round (`first`) or after the first round
    /// with more than one call (`burst`).
    pub stop_after: Option<StopAfter>,
    /// Budget of each round's fleet turn, in ms.
    pub deadline_ms: Option<u64>,
}

/// The limits one request runs under: the tightest of the configuration's, the API key's
/// and the request's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limits {
    max_rounds: u32,
    max_calls: usize,
    stop_after: Option<StopAfter>,
}

impl Limits {
    fn of(config: &UpstreamConfig, key: &ChatLimits, request: &LoopOptions) -> Self {
        let max_rounds = [key.max_rounds, request.max_rounds]
            .into_iter()
            .flatten()
            .fold(config.max_rounds, u32::min);
        let max_calls = [
            key.max_calls_per_round.map(|c| c as usize),
            request.max_calls_per_round,
        ]
        .into_iter()
        .flatten()
        .fold(config.max_calls_per_round, usize::min);
        let stop_after = [key.stop_after, request.stop_after]
            .into_iter()
            .max_by_key(|gate| StopAfter::strictness(*gate))
            .flatten();
        Self {
            max_rounds,
            max_calls,
            stop_after,
        }
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    headers: axum::http::HeaderMap,
    ApiJson(body): ApiJson<Value>,
) -> Response {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let span = tracing::info_span!(
        "chat_completions",
        otel.name = %format!("chat {model}"),
        gen_ai.operation.name = "chat",
        gen_ai.system = "openai",
        gen_ai.request.model = %model,
        toolfleet.tenant.id = %caller.tenant,
        toolfleet.openai.rounds = tracing::field::Empty,
        toolfleet.openai.fleet_calls = tracing::field::Empty,
    );
    match start(gateway, caller, &headers, body)
        .instrument(span)
        .await
    {
        Ok(response) => response,
        Err(Refusal::Api(error)) => error.into_response(),
        Err(Refusal::Upstream(failure)) => failure.into_response(),
    }
}

/// Why a request got no completion.
enum Refusal {
    Api(ApiError),
    Upstream(Failure),
}

impl From<ApiError> for Refusal {
    fn from(error: ApiError) -> Self {
        Self::Api(error)
    }
}

async fn start(
    gateway: Arc<Gateway>,
    caller: Caller,
    headers: &axum::http::HeaderMap,
    body: Value,
) -> Result<Response, Refusal> {
    let Some(upstream) = gateway.upstream.clone() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::UPSTREAM_NOT_CONFIGURED,
            "no model server is configured (TOOLFLEET_UPSTREAM_BASE_URL)",
        )
        .into());
    };
    let Value::Object(mut body) = body else {
        return Err(ApiError::invalid_request("the body must be a JSON object").into());
    };
    let with_fleet = fleet_header(headers)?;
    let options: LoopOptions = match body.remove(EXTENSION) {
        Some(value) => serde_json::from_value(value)
            .map_err(|e| ApiError::invalid_request(format!("the `{EXTENSION}` object: {e}")))?,
        None => LoopOptions::default(),
    };
    if options.deadline_ms == Some(0) {
        return Err(ApiError::invalid_request(format!(
            "`{EXTENSION}.deadline_ms` must be at least 1 (leave it out for the default)"
        ))
        .into());
    }
    if !body.get("messages").is_some_and(Value::is_array) {
        return Err(ApiError::invalid_request("`messages` must be an array").into());
    }
    let config = &gateway.config.upstream;
    if let Some(model) = &config.model {
        body.insert("model".into(), Value::String(model.clone()));
    }
    let streamed = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    gateway.nats_connected()?;
    let catalog = gateway.chat_catalogs.get(&gateway, &caller.tenant).await?;
    let (tools, fleet) = offered_tools(body.remove("tools"), with_fleet, &catalog)?;
    if !tools.is_empty() {
        body.insert("tools".into(), Value::Array(tools));
    }
    let slot = gateway.slots.try_take().ok_or_else(ApiError::overloaded)?;
    let limits = Limits::of(config, &caller.chat, &options);
    let mut conversation = Conversation {
        max_rounds: limits.max_rounds,
        max_calls: limits.max_calls,
        stop_after: limits.stop_after,
        deadline_ms: options.deadline_ms,
        gateway,
        tenant: caller.tenant,
        key_id: caller.key_id,
        body,
        fleet,
        asked: 0,
        rounds: 0,
        fleet_calls: 0,
        usage: Value::Null,
        usage_rounds: 0,
    };
    conversation.fill_fleet_results().await;
    conversation.asked = conversation.messages().len();
    if !streamed {
        let answer = conversation.complete(&upstream).await;
        if answer.is_err() {
            upstream.metrics().completion("upstream_error");
        }
        drop(slot);
        return answer.map(|v| axum::Json(v).into_response());
    }
    // The first round is asked before answering, so its failure keeps its status.
    let first = upstream
        .stream(&conversation.body)
        .await
        .map_err(|failure| {
            upstream.metrics().completion("upstream_error");
            Refusal::Upstream(failure)
        })?;
    let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(32);
    let span = tracing::Span::current();
    tokio::spawn(
        async move {
            let _slot = slot;
            conversation.stream(&upstream, first, sender).await;
        }
        .instrument(span),
    );
    let frames = futures::stream::unfold(receiver, |mut receiver| async move {
        let frame = receiver.recv().await?;
        Some((Ok::<_, Infallible>(frame), receiver))
    });
    let mut response = Body::from_stream(frames).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}

/// Tenants' OpenAI-format catalogs, each reused for the configured time so that a busy
/// conversation does not ask the coordinators for the catalog on every request. A tool
/// that appears or goes away shows up at most that long later (a call of a tool whose
/// workers left still gets its `no_live_worker` result from the fleet).
#[derive(Debug)]
pub struct CatalogCache {
    ttl: Duration,
    entries: std::sync::Mutex<HashMap<String, CachedCatalog>>,
}

/// A catalog and when it was read.
type CachedCatalog = (Arc<Vec<Value>>, std::time::Instant);

/// Tenants remembered at most; the cache is emptied when full.
const CATALOG_CACHE_ENTRIES: usize = 10_000;

impl CatalogCache {
    /// A cache trusting an answer for `ttl` (zero: never).
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            entries: Default::default(),
        }
    }

    /// `tenant`'s catalog, asked of the coordinators when not cached.
    async fn get(&self, gateway: &Gateway, tenant: &str) -> Result<Arc<Vec<Value>>, ApiError> {
        if !self.ttl.is_zero() {
            let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((catalog, at)) = entries.get(tenant) {
                if at.elapsed() < self.ttl {
                    return Ok(Arc::clone(catalog));
                }
            }
        }
        let catalog = Arc::new(
            gateway
                .client
                .catalog(
                    CatalogFormat::Openai,
                    Some(tenant.to_string()),
                    CATALOG_WAIT,
                )
                .await?,
        );
        // An empty catalog (no worker yet) is not kept: the first worker shows at once.
        if !self.ttl.is_zero() && !catalog.is_empty() {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            if entries.len() >= CATALOG_CACHE_ENTRIES {
                entries.clear();
            }
            entries.insert(
                tenant.to_string(),
                (Arc::clone(&catalog), std::time::Instant::now()),
            );
        }
        Ok(catalog)
    }
}

/// Whether the request's [`TOOLS_HEADER`] asks for the fleet's tools beside its own.
fn fleet_header(headers: &axum::http::HeaderMap) -> Result<bool, ApiError> {
    let mut with_fleet = false;
    for value in headers.get_all(TOOLS_HEADER) {
        let words = value.to_str().unwrap_or("\u{fffd}");
        for word in words.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            if !word.eq_ignore_ascii_case("fleet") {
                return Err(ApiError::invalid_request(format!(
                    "the {TOOLS_HEADER} header takes `fleet`, not {word:?}"
                )));
            }
            with_fleet = true;
        }
    }
    Ok(with_fleet)
}

/// The tools sent upstream and the OpenAI names of the fleet tools among them.
///
/// - no `tools`, or `"tools": "fleet"`: the tenant's whole fleet catalog;
/// - an array: its entries in order, where an entry naming a fleet tool
///   (`{"type": "function", "function": {"name": "crm__getOpenInvoices"}}`, the rest
///   optional) is replaced by the fleet's definition, and an entry `{"type": "fleet"}` is
///   replaced by the whole catalog; every other entry is the caller's own tool;
/// - `with_fleet` (the request's `X-Toolfleet-Tools: fleet`): the whole catalog after the
///   array's entries, as if the array ended with `{"type": "fleet"}`.
///
/// A caller tool whose name is also a fleet tool's is the fleet's: the fleet runs it.
pub fn offered_tools(
    requested: Option<Value>,
    with_fleet: bool,
    catalog: &[Value],
) -> Result<(Vec<Value>, HashSet<String>), ApiError> {
    let name_of = |tool: &Value| {
        tool.pointer("/function/name")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let by_name: HashMap<String, Value> = catalog
        .iter()
        .filter_map(|tool| Some((name_of(tool)?, tool.clone())))
        .collect();
    let mut entries = match requested {
        None | Some(Value::Null) => vec![json!({"type": "fleet"})],
        Some(Value::String(word)) if word == "fleet" => vec![json!({"type": "fleet"})],
        Some(Value::Array(entries)) => entries,
        Some(other) => {
            return Err(ApiError::invalid_request(format!(
                "`tools` must be an array or \"fleet\", not {other}"
            )))
        }
    };
    if with_fleet {
        entries.push(json!({"type": "fleet"}));
    }
    let (mut tools, mut fleet, mut seen) = (Vec::new(), HashSet::new(), HashSet::new());
    for entry in entries {
        if entry.get("type").and_then(Value::as_str) == Some("fleet") {
            for tool in catalog {
                if let Some(name) = name_of(tool).filter(|n| seen.insert(n.clone())) {
                    fleet.insert(name);
                    tools.push(tool.clone());
                }
            }
            continue;
        }
        let Some(name) = name_of(&entry) else {
            tools.push(entry);
            continue;
        };
        if !seen.insert(name.clone()) {
            continue;
        }
        match by_name.get(&name) {
            Some(definition) => {
                fleet.insert(name);
                tools.push(definition.clone());
            }
            None => tools.push(entry),
        }
    }
    Ok((tools, fleet))
}

/// One chat request on its way through the loop.
struct Conversation {
    gateway: Arc<Gateway>,
    tenant: String,
    /// The API key's id (part of every round's turn id).
    key_id: String,
    /// What goes upstream; `messages` grows by each round.
    body: Map<String, Value>,
    /// OpenAI names of the fleet tools offered.
    fleet: HashSet<String>,
    /// How many of `messages` the caller sent (the rest are the loop's rounds).
    asked: usize,
    max_rounds: u32,
    max_calls: usize,
    stop_after: Option<StopAfter>,
    deadline_ms: Option<u64>,
    rounds: u32,
    fleet_calls: usize,
    /// `usage` summed over every model round that reported one, and how many did.
    usage: Value,
    usage_rounds: u32,
}

/// What a round's answer means.
enum Step {
    /// The loop ends with this response (the model's, or one the gateway wrote).
    Answer(Value),
    /// Fleet calls ran; ask the model again.
    Again,
}

impl Conversation {
    /// The loop without streaming.
    async fn complete(&mut self, upstream: &Upstream) -> Result<Value, Refusal> {
        loop {
            let response = upstream
                .complete(&self.body)
                .await
                .map_err(Refusal::Upstream)?;
            match self.step(response).await {
                Step::Answer(answer) => return Ok(answer),
                Step::Again => {}
            }
        }
    }

    /// The loop, streamed: `first` is the first round's chunks.
    async fn stream(
        &mut self,
        upstream: &Upstream,
        first: Vec<Value>,
        sender: tokio::sync::mpsc::Sender<Bytes>,
    ) {
        let mut chunks = first;
        loop {
            let response = assemble(&chunks);
            let answer = match self.step(response).await {
                Step::Answer(answer) => answer,
                Step::Again => {
                    let note = format!(
                        ": toolfleet round {} ran {} fleet calls\n\n",
                        self.rounds, self.fleet_calls
                    );
                    if sender.send(Bytes::from(note)).await.is_err() {
                        return;
                    }
                    match upstream.stream(&self.body).await {
                        Ok(next) => chunks = next,
                        Err(failure) => {
                            upstream.metrics().completion("upstream_error");
                            let _ = sender.send(data(&failure.json())).await;
                            let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                            return;
                        }
                    }
                    continue;
                }
            };
            // The upstream's own chunks when the answer is its message as it came; the
            // gateway's when it wrote or annotated the answer.
            let own = assemble(&chunks);
            let frames = if answer == own {
                chunks
            } else if without_usage(&strip_extension(&answer)) == without_usage(&own) {
                let mut chunks = chunks;
                if let (Some(Value::Object(last)), Some(extension)) =
                    (chunks.last_mut(), answer.get(EXTENSION))
                {
                    last.insert(EXTENSION.into(), extension.clone());
                }
                // The chunk that carries the round's usage carries the summed one.
                if let Some(usage) = answer.get("usage") {
                    let carrier = chunks
                        .iter_mut()
                        .rev()
                        .find(|c| c.get("usage").is_some_and(|u| !u.is_null()));
                    if let Some(Value::Object(chunk)) = carrier {
                        chunk.insert("usage".into(), usage.clone());
                    }
                }
                chunks
            } else {
                chunks_of(&answer)
            };
            for chunk in &frames {
                if sender.send(data(chunk)).await.is_err() {
                    return;
                }
            }
            let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            return;
        }
    }

    /// Decides on one round's `response`, running its fleet calls when it has any.
    async fn step(&mut self, response: Value) -> Step {
        if let Some(round) = response.get("usage").filter(|u| u.is_object()) {
            add_usage(&mut self.usage, round);
            self.usage_rounds += 1;
        }
        let message = response
            .pointer("/choices/0/message")
            .cloned()
            .unwrap_or(Value::Null);
        let calls: Vec<Value> = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if calls.is_empty() {
            self.count("answered");
            return Step::Answer(self.annotate(response, None));
        }
        let is_fleet = |call: &Value| {
            call.pointer("/function/name")
                .and_then(Value::as_str)
                .is_some_and(|name| self.fleet.contains(name))
        };
        let fleet_calls: Vec<Value> = calls.iter().filter(|c| is_fleet(c)).cloned().collect();
        if fleet_calls.len() < calls.len() {
            // The caller must run some: it gets every call; the fleet's run now, in the
            // turn the caller's next request finds from what it sends back, which holds
            // none of this request's rounds.
            let ids: Vec<Value> = fleet_calls
                .iter()
                .filter_map(|c| c.get("id").cloned())
                .collect();
            if !fleet_calls.is_empty() {
                self.count_round(fleet_calls.len());
                let before = self.messages().get(..self.asked).unwrap_or_default();
                let _ = self.run_turn(before, &calls, &fleet_calls).await;
            }
            self.count("caller_tools");
            let note = json!({
                "fleet_call_ids": ids,
                "note": "the fleet ran these calls; send the conversation back with results for the other calls only and the gateway adds the fleet's",
            });
            return Step::Answer(self.annotate(response, Some(note)));
        }
        if self.rounds >= self.max_rounds {
            self.count("max_rounds");
            return Step::Answer(self.stopped(&response));
        }
        self.rounds += 1;
        self.fleet_calls += calls.len();
        self.count_round(calls.len());
        let results = self.run_turn(self.messages(), &calls, &calls).await;
        if let Some(Value::Array(messages)) = self.body.get_mut("messages") {
            messages.push(message);
            messages.extend(results);
        }
        let stop = match self.stop_after {
            Some(StopAfter::First) => true,
            Some(StopAfter::Burst) => calls.len() > 1,
            None => false,
        };
        if stop {
            self.body.insert("tool_choice".into(), json!("none"));
        }
        Step::Again
    }

    /// The conversation as it goes upstream next.
    fn messages(&self) -> &[Value] {
        match self.body.get("messages") {
            Some(Value::Array(messages)) => messages,
            _ => &[],
        }
    }

    /// Counts the completion's `outcome`.
    fn count(&self, outcome: &'static str) {
        if let Some(upstream) = &self.gateway.upstream {
            upstream.metrics().completion(outcome);
        }
    }

    /// Counts one round of `calls` fleet calls.
    fn count_round(&self, calls: usize) {
        if let Some(upstream) = &self.gateway.upstream {
            upstream.metrics().round(calls);
        }
    }

    /// The model's `response` with what the loop did in the extension object.
    fn annotate(&self, mut response: Value, extra: Option<Value>) -> Value {
        let span = tracing::Span::current();
        span.record("toolfleet.openai.rounds", self.rounds);
        span.record("toolfleet.openai.fleet_calls", self.fleet_calls as u64);
        // The caller is billed for every round the model answered, not only the last.
        if self.usage_rounds > 1 {
            if let Value::Object(fields) = &mut response {
                fields.insert("usage".into(), self.usage.clone());
            }
        }
        if self.rounds == 0 && extra.is_none() {
            return response;
        }
        let mut extension = json!({"rounds": self.rounds, "fleet_calls": self.fleet_calls});
        if let (Some(Value::Object(fields)), Value::Object(target)) = (extra, &mut extension) {
            target.extend(fields);
        }
        if let Value::Object(fields) = &mut response {
            fields.insert(EXTENSION.into(), extension);
        }
        response
    }

    /// The answer when the rounds cap stops the loop: the model's last message becomes
    /// a plain assistant message saying so (`finish_reason: "length"`).
    fn stopped(&self, response: &Value) -> Value {
        let mut answer = response.clone();
        let text = format!(
            "Stopped: the model asked for more tool calls after {} rounds, the limit.",
            self.rounds
        );
        if let Some(Value::Object(choice)) = answer.pointer_mut("/choices/0") {
            choice.insert(
                "message".into(),
                json!({"role": "assistant", "content": text}),
            );
            choice.insert("finish_reason".into(), json!("length"));
        }
        self.annotate(answer, Some(json!({"stopped": "max_rounds"})))
    }

    /// Runs `fleet_calls` (of a message said after `before`, whose calls are `all`) as
    /// one fleet turn; the `role: "tool"` message of each, in order. A turn that fails as
    /// a whole gives each call an error result.
    async fn run_turn(&self, before: &[Value], all: &[Value], fleet_calls: &[Value]) -> Vec<Value> {
        let turn_id = turn_id_of(&self.tenant, &self.key_id, before, all, &self.fleet);
        let request = TurnRequest {
            turn_id: Some(turn_id),
            tenant_id: self.tenant.clone(),
            session_id: None,
            user_message: None,
            decision: json!({"role": "assistant", "content": null, "tool_calls": fleet_calls}),
            deadline_ms: self.deadline_ms,
            options: TurnOptions {
                max_calls: Some(self.max_calls),
                concurrency: None,
            },
            context: Map::new(),
        };
        let wait = self.gateway.event_wait(self.deadline_ms);
        let outcome = async {
            let mut stream = self.gateway.client.submit(request).await?;
            final_of(&mut stream, wait).await
        }
        .await;
        match outcome {
            Ok(Ok(history)) => history,
            Ok(Err(error)) => failed_results(fleet_calls, &error.code, &error.message),
            Err(error) => failed_results(fleet_calls, "unavailable", &error.to_string()),
        }
    }

    /// Puts the fleet's results into the conversation after an assistant message whose
    /// fleet calls the caller could not answer: one that also called the caller's own
    /// tools (the gateway answered it with every call while the fleet ran its own), or one
    /// whose fleet calls have no result. Read from the turn that ran them, the fleet's
    /// result of a fleet call replaces whatever the caller sent for it (a typed client
    /// answers a call of a tool it does not know with an error of its own); each block
    /// of tool messages ends up in the message's call order.
    async fn fill_fleet_results(&mut self) {
        let Some(Value::Array(messages)) = self.body.get("messages").cloned() else {
            return;
        };
        let mut out: Vec<Value> = Vec::with_capacity(messages.len());
        let mut i = 0;
        while i < messages.len() {
            let message = &messages[i];
            i += 1;
            let calls: Vec<Value> = match message.get("role").and_then(Value::as_str) {
                Some("assistant") => message
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
                _ => Vec::new(),
            };
            if calls.is_empty() {
                out.push(message.clone());
                continue;
            }
            let mut block = Vec::new();
            while i < messages.len()
                && messages[i].get("role").and_then(Value::as_str) == Some("tool")
            {
                block.push(messages[i].clone());
                i += 1;
            }
            let answered: HashSet<&str> = block
                .iter()
                .filter_map(|m| m.get("tool_call_id").and_then(Value::as_str))
                .collect();
            let is_fleet = |c: &Value| {
                c.pointer("/function/name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| self.fleet.contains(n))
            };
            let fleet_calls: Vec<&Value> = calls.iter().filter(|c| is_fleet(c)).collect();
            let mixed = fleet_calls.len() < calls.len();
            let missing = fleet_calls.iter().any(|c| {
                c.get("id")
                    .and_then(Value::as_str)
                    .is_some_and(|id| !answered.contains(id))
            });
            if fleet_calls.is_empty() || !(mixed || missing) {
                out.push(message.clone());
                out.extend(block);
                continue;
            }
            let stored = self.stored_results(&out, &calls, &fleet_calls).await;
            out.push(message.clone());
            let mut by_id: HashMap<String, Value> = HashMap::new();
            let expired = stored.is_none();
            let (first, then) = match &stored {
                Some(results) => (results.as_slice(), block.as_slice()),
                None => (block.as_slice(), &[][..]),
            };
            for m in first.iter().chain(then) {
                if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
                    by_id.entry(id.to_string()).or_insert_with(|| m.clone());
                }
            }
            if expired {
                let unanswered: Vec<Value> = fleet_calls
                    .iter()
                    .filter(|c| {
                        c.get("id")
                            .and_then(Value::as_str)
                            .is_some_and(|id| !by_id.contains_key(id))
                    })
                    .map(|c| (*c).clone())
                    .collect();
                for m in failed_results(
                    &unanswered,
                    "result_expired",
                    "the fleet's result of this call is no longer kept; ask for the call again",
                ) {
                    if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
                        by_id.insert(id.to_string(), m.clone());
                    }
                }
            }
            for call in &calls {
                if let Some(m) = call
                    .get("id")
                    .and_then(Value::as_str)
                    .and_then(|id| by_id.remove(id))
                {
                    out.push(m);
                }
            }
            // Tool messages naming no call of the message stay, after the others.
            out.extend(block.into_iter().filter(|m| {
                m.get("tool_call_id")
                    .and_then(Value::as_str)
                    .is_some_and(|id| by_id.contains_key(id))
            }));
        }
        self.body.insert("messages".into(), Value::Array(out));
    }

    /// The fleet's results of `fleet_calls` (of a message said after `before`, whose calls
    /// are `all`) from the turn that ran them; `None` when that turn is gone.
    async fn stored_results(
        &self,
        before: &[Value],
        all: &[Value],
        fleet_calls: &[&Value],
    ) -> Option<Vec<Value>> {
        let turn_id = turn_id_of(&self.tenant, &self.key_id, before, all, &self.fleet);
        let wait = self.gateway.event_wait(self.deadline_ms);
        let client = &self.gateway.client;
        let outcome = async {
            let mut stream = client.attach_from(&turn_id, Some(&self.tenant), 0).await?;
            final_of(&mut stream, wait).await
        }
        .await;
        let wanted: HashSet<&str> = fleet_calls
            .iter()
            .filter_map(|c| c.get("id").and_then(Value::as_str))
            .collect();
        match outcome {
            Ok(Ok(history)) => Some(
                history
                    .into_iter()
                    .filter(|m| {
                        m.get("tool_call_id")
                            .and_then(Value::as_str)
                            .is_some_and(|id| wanted.contains(id))
                    })
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// The turn's `role: "tool"` messages once its `final` arrives, or its turn-level error.
async fn final_of(
    stream: &mut toolfleet_common::client::TurnStream,
    wait: Duration,
) -> Result<Result<Vec<Value>, toolfleet_common::CallError>, toolfleet_common::client::ClientError>
{
    loop {
        match stream.next_event(wait).await? {
            TurnEvent::Final(fin) => return Ok(Ok(fin.session_history().openai)),
            TurnEvent::Error { error, .. } => return Ok(Err(error)),
            _ => {}
        }
    }
}

/// A `role: "tool"` message with an error for each of `calls`.
fn failed_results(calls: &[Value], code: &str, message: &str) -> Vec<Value> {
    calls
        .iter()
        .map(|call| {
            let content = json!({"error": {"code": code, "message": message}}).to_string();
            json!({"role": "tool", "tool_call_id": call.get("id").cloned().unwrap_or(Value::Null), "content": content})
        })
        .collect()
}

/// `value` without the extension object.
/// Adds one round's `usage` into `total`: numbers are summed, nested objects
/// (`prompt_tokens_details`, …) field by field, anything else kept from the latest round.
fn add_usage(total: &mut Value, round: &Value) {
    let (Value::Object(sum), Value::Object(add)) = (&mut *total, round) else {
        *total = round.clone();
        return;
    };
    for (name, value) in add {
        match (sum.get_mut(name), value) {
            (Some(Value::Number(a)), Value::Number(b)) => {
                if let (Some(x), Some(y)) = (a.as_u64(), b.as_u64()) {
                    *a = (x + y).into();
                } else if let Some(n) = a
                    .as_f64()
                    .zip(b.as_f64())
                    .and_then(|(x, y)| serde_json::Number::from_f64(x + y))
                {
                    *a = n;
                }
            }
            (Some(inner @ Value::Object(_)), Value::Object(_)) => add_usage(inner, value),
            (Some(slot), _) => *slot = value.clone(),
            (None, _) => {
                sum.insert(name.clone(), value.clone());
            }
        }
    }
}

/// `value` without its `usage`.
fn without_usage(value: &Value) -> Value {
    let mut value = value.clone();
    if let Value::Object(fields) = &mut value {
        fields.remove("usage");
    }
    value
}

fn strip_extension(value: &Value) -> Value {
    let mut value = value.clone();
    if let Value::Object(fields) = &mut value {
        fields.remove(EXTENSION);
    }
    value
}

/// One SSE `data:` frame.
fn data(chunk: &Value) -> Bytes {
    Bytes::from(format!("data: {chunk}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "description": "d", "parameters": {"type": "object"}}})
    }

    #[test]
    fn usage_is_summed_over_rounds_field_by_field() {
        let mut total = Value::Null;
        add_usage(
            &mut total,
            &json!({"prompt_tokens": 110, "completion_tokens": 7, "total_tokens": 117,
                    "prompt_tokens_details": {"cached_tokens": 100}}),
        );
        add_usage(
            &mut total,
            &json!({"prompt_tokens": 240, "completion_tokens": 31, "total_tokens": 271,
                    "prompt_tokens_details": {"cached_tokens": 64},
                    "completion_tokens_details": {"reasoning_tokens": 12}}),
        );
        assert_eq!(
            total,
            json!({"prompt_tokens": 350, "completion_tokens": 38, "total_tokens": 388,
                   "prompt_tokens_details": {"cached_tokens": 164},
                   "completion_tokens_details": {"reasoning_tokens": 12}})
        );
    }

    #[test]
    fn fleet_tools_are_offered_by_default_and_by_name() {
        let catalog = vec![tool("crm__a"), tool("crm__b")];
        let (tools, fleet) = offered_tools(None, false, &catalog).expect("offered");
        assert_eq!(tools.len(), 2);
        assert!(fleet.contains("crm__a") && fleet.contains("crm__b"));

        let mine = json!({"type": "function", "function": {"name": "lookup_weather"}});
        let requested = json!([mine, {"type": "function", "function": {"name": "crm__b"}}]);
        let (tools, fleet) =
            offered_tools(Some(requested.clone()), false, &catalog).expect("offered");
        assert_eq!(tools, vec![mine.clone(), tool("crm__b")]);
        assert_eq!(fleet, HashSet::from(["crm__b".to_string()]));

        let (tools, _) = offered_tools(Some(json!("fleet")), false, &catalog).expect("offered");
        assert_eq!(tools.len(), 2);
        assert!(offered_tools(Some(json!(7)), false, &[]).is_err());

        // The header adds the whole catalog after the caller's own, each tool once.
        let (tools, fleet) = offered_tools(Some(requested), true, &catalog).expect("offered");
        assert_eq!(tools, vec![mine.clone(), tool("crm__b"), tool("crm__a")]);
        assert_eq!(fleet.len(), 2);
        let (tools, _) = offered_tools(None, true, &catalog).expect("offered");
        assert_eq!(tools.len(), 2);
        let (tools, _) = offered_tools(Some(json!([mine])), false, &catalog).expect("offered");
        assert_eq!(tools.len(), 1, "an array alone is only the caller's tools");
    }

    #[test]
    fn the_tools_header_takes_fleet_only() {
        let mut headers = axum::http::HeaderMap::new();
        assert!(!fleet_header(&headers).expect("no header"));
        headers.insert(TOOLS_HEADER, HeaderValue::from_static("Fleet"));
        assert!(fleet_header(&headers).expect("fleet"));
        headers.insert(TOOLS_HEADER, HeaderValue::from_static("everything"));
        assert!(fleet_header(&headers).is_err());
    }

    #[test]
    fn the_tightest_of_configuration_key_and_request_wins() {
        let config = UpstreamConfig::default();
        let none = Limits::of(&config, &ChatLimits::default(), &LoopOptions::default());
        assert_eq!(
            (none.max_rounds, none.max_calls, none.stop_after),
            (8, 16, None)
        );

        let key = ChatLimits {
            max_rounds: Some(2),
            max_calls_per_round: Some(4),
            stop_after: Some(StopAfter::Burst),
        };
        let looser = LoopOptions {
            max_rounds: Some(6),
            max_calls_per_round: Some(100),
            stop_after: None,
            deadline_ms: None,
        };
        let limits = Limits::of(&config, &key, &looser);
        assert_eq!(
            (limits.max_rounds, limits.max_calls, limits.stop_after),
            (2, 4, Some(StopAfter::Burst))
        );
        let tighter = LoopOptions {
            max_rounds: Some(1),
            max_calls_per_round: Some(3),
            stop_after: Some(StopAfter::First),
            deadline_ms: None,
        };
        let limits = Limits::of(&config, &key, &tighter);
        assert_eq!(
            (limits.max_rounds, limits.max_calls, limits.stop_after),
            (1, 3, Some(StopAfter::First))
        );
    }
}
