//! Taking a turn: the first step of every turn, and the turn's path as named steps.
//!
//! Owns the loop that takes requests in ([`take_turns`]: turn requests from the queue
//! group, bounded by `TOOLFLEET_INTAKE_CONCURRENCY`, and the attach and cancel requests
//! handed to `attach.rs` and `cancel.rs`; after shutdown, the turns already delivered),
//! decoding a turn request (JSON, turn id, tenant id in its normalized form), the
//! caller checks of `callers.rs` (a request whose reply is not the caller's own inbox is
//! dropped and counted, never answered), the header limits (a request with more or
//! larger headers than [`MAX_REQUEST_HEADERS`] and [`MAX_REQUEST_HEADER_BYTES`] is
//! refused `invalid_request` before its trace is read), reading its decision, and
//! [`take_turn`]: a short sequence that hands each step to its room — limits
//! (`limits.rs`), per-call verdicts (`validate.rs`), the call layout and jobs
//! (`dispatch.rs`), creating the turn in the join with its `ack` and `pending` states
//! (`admission.rs`), owning the turn until its deadline (`turns.rs`; `deadline.rs` ends
//! it then) and the first publishes (`sharing.rs`; the `dispatch_failed` results of
//! jobs that could not be published are recorded through `results.rs`). Fixes the turn span's identity (`trace.rs`) before anything
//! else and stores it with the turn; the work done here is the `intake` span, a child of
//! the turn span.
//!
//! Never ends a turn itself: every end, the no-tool answer and the rejections included,
//! goes through `finalize.rs`. Never publishes a job itself (`dispatch.rs` does). Next: workers
//! run the jobs, and `results.rs` records what they return.

use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::names::{spans, COORDINATOR_QUEUE_GROUP, HEADER_TURN_ID};
use toolfleet_common::telemetry;
use toolfleet_common::turn::{normalize_tenant, turn_codes, valid_turn_id};
use toolfleet_common::{CallError, CallResult, TurnRequest};
use toolfleet_decision::parse::{parse_decision, Decision, DecisionErrorKind, ToolCallsDecision};
use tracing::{info, info_span, warn, Instrument};

use crate::admission::{admit, first_events, Admission, Taken};
use crate::attach;
use crate::callers::Reply;
use crate::cancel;
use crate::dispatch::{build_jobs, Layout};
use crate::events;
use crate::finalize::{end_open_turn, finish, TurnEnd};
use crate::limits::{millis, TurnLimits};
use crate::log_sample::LogSample;
use crate::registry::Snapshot;
use crate::replica::{next_message, Replica};
use crate::store::redis::{CallEntry, NewTurn};
use crate::trace::{self, TurnTrace};
use crate::turns::{Ahead, OwnedTurn};
use crate::validate::{plan, Limits, PlannedCall, Verdict};
use crate::CoordinatorError;
use crate::{results, sharing};

/// Metric label of calls whose tool is not in the registry (model-written names would
/// make unbounded label values).
const UNKNOWN_TOOL_LABEL: &str = "_unknown";

/// The wait an `overloaded` refusal suggests before the turn is submitted again.
const OVERLOADED_RETRY_MS: u64 = 1000;

/// [`take_turns`] in a task of its own, so on a runtime thread even when `run` is what
/// `main` blocks on: each request then wakes a runtime thread, not the main thread and
/// then a runtime thread for its handler.
pub(crate) async fn take_turns_on_runtime(
    replica: &Arc<Replica>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    let intake = {
        let replica = Arc::clone(replica);
        tokio::spawn(async move { take_turns(&replica, shutdown).await })
    };
    match intake.await {
        Ok(taken) => taken,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        // Cancelled: the runtime is shutting down; drain what is left.
        Err(_) => Ok(()),
    }
}

/// Takes turn requests from the queue group until `shutdown`, then the ones already
/// delivered to this replica (new ones go to the other replicas).
async fn take_turns(
    replica: &Arc<Replica>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    let take = |message, permit| {
        spawn_handler(replica, |replica| async move {
            handle_turn_message(replica, message).await;
            drop(permit);
        });
    };
    // Requests being taken in at once (`TOOLFLEET_INTAKE_CONCURRENCY`): a burst waits in
    // the subscription, not as that many decoded requests and plans in memory together.
    let intake_slots = Arc::new(Semaphore::new(replica.config.intake_concurrency));
    let slot = || async { Arc::clone(&intake_slots).acquire_owned().await.ok() };
    let attach = |message| {
        spawn_handler(replica, |replica| {
            attach::handle_attach_message(replica, message)
        });
    };
    let cancel = |message| {
        spawn_handler(replica, |replica| {
            cancel::handle_cancel_message(replica, message)
        });
    };
    let names = &replica.names;
    let subscribe = |subject| {
        replica
            .nats
            .queue_subscribe(subject, COORDINATOR_QUEUE_GROUP.to_string())
    };
    // Identified frontends (`<p>.turns.submit.<user>`) and unidentified ones.
    let mut identified = subscribe(names.turn_submit_any()).await?;
    let mut unidentified = subscribe(names.turn_submit()).await?;
    // Attach requests: a frontend following a turn it submitted.
    let mut attaching = subscribe(names.turn_attach_any()).await?;
    let mut attaching_unidentified = subscribe(names.turn_attach()).await?;
    // Cancel requests: a frontend stopping a turn it submitted.
    let mut cancelling = subscribe(names.turn_cancel_any()).await?;
    let mut cancelling_unidentified = subscribe(names.turn_cancel()).await?;
    info!(prefix = %names.prefix(), "coordinator taking turns");
    {
        let turns = futures::stream::select(&mut identified, &mut unidentified);
        let attaches = futures::stream::select(&mut attaching, &mut attaching_unidentified);
        let cancels = futures::stream::select(&mut cancelling, &mut cancelling_unidentified);
        let mut all = futures::stream::select(
            futures::stream::select(turns.map(Incoming::Turn), attaches.map(Incoming::Attach)),
            cancels.map(Incoming::Cancel),
        );
        while let Some(message) = next_message(&mut all, &shutdown).await {
            match message {
                Incoming::Turn(message) => take(message, slot().await),
                Incoming::Attach(message) => attach(message),
                Incoming::Cancel(message) => cancel(message),
            }
        }
    }
    replica.health.start_draining();
    info!("coordinator stopping: no new turns");
    let _ = identified.drain().await;
    let _ = unidentified.drain().await;
    let _ = attaching.unsubscribe().await;
    let _ = attaching_unidentified.unsubscribe().await;
    let _ = cancelling.unsubscribe().await;
    let _ = cancelling_unidentified.unsubscribe().await;
    let mut turns = futures::stream::select(identified, unidentified);
    while let Some(message) = turns.next().await {
        take(message, slot().await);
    }
    Ok(())
}

/// A message on one of the subjects frontends publish to.
enum Incoming {
    Turn(async_nats::Message),
    Attach(async_nats::Message),
    Cancel(async_nats::Message),
}

/// Spawns the handler `handle` makes of its own reference to `replica` on the replica's
/// tracked tasks. Boxed: the task then moves a pointer, not the handler's whole state
/// machine, each time it is spawned, polled to its end and dropped.
fn spawn_handler<F>(replica: &Arc<Replica>, handle: impl FnOnce(Arc<Replica>) -> F)
where
    F: Future<Output = ()> + Send + 'static,
{
    replica.tasks.spawn(Box::pin(handle(Arc::clone(replica))));
}

/// Handles one message on the turn subject.
pub(crate) async fn handle_turn_message(replica: Arc<Replica>, message: async_nats::Message) {
    if message.reply.is_none() {
        static LOGGED: LogSample = LogSample::refusals();
        if let Some(suppressed) = LOGGED.admit() {
            warn!(subject = %message.subject, suppressed, "turn request without a reply subject dropped");
        }
        return;
    }
    let Some((caller, reply)) = replica.caller_of(&message, "turn request") else {
        return;
    };
    // Before the trace is read from the headers, the body decoded or Redis asked.
    if let Some(why) = headers_over_limits(message.headers.as_ref()) {
        static LOGGED: LogSample = LogSample::refusals();
        if let Some(suppressed) = LOGGED.admit() {
            warn!(subject = %message.subject, suppressed, "turn request refused: {why}");
        }
        let error = CallError::fatal(turn_codes::INVALID_REQUEST, why);
        return reject(&replica, None, reply, error, None).await;
    }
    // The turn span's ids and start are fixed here; whoever ends the turn exports it.
    let mut trace = TurnTrace::begin(message.headers.as_ref());
    let max = replica.config.max_turns_in_progress;
    let Some(_taking) = replica.turns.try_take(max) else {
        let turn_id = header_turn_id(&message);
        let message = format!(
            "this coordinator follows {max} turns, its limit (TOOLFLEET_MAX_TURNS_IN_PROGRESS); nothing was stored, retry after {OVERLOADED_RETRY_MS} ms"
        );
        let error = CallError::retryable(turn_codes::OVERLOADED, message)
            .retry_after(std::time::Duration::from_millis(OVERLOADED_RETRY_MS));
        return reject(&replica, turn_id, reply, error, trace).await;
    };
    if let Some(full) = replica.memory.admit(message.payload.len()) {
        let turn_id = header_turn_id(&message);
        let message = format!(
            "the turn store holds {} of its {} bytes with the turns just let in, and this turn would take it past the {} % at which new turns wait (TOOLFLEET_REDIS_SHED_PERCENT) so the turns in flight can end; nothing was stored, retry after {OVERLOADED_RETRY_MS} ms",
            full.used, full.max, full.shed_percent
        );
        let error = CallError::retryable(turn_codes::OVERLOADED, message)
            .retry_after(std::time::Duration::from_millis(OVERLOADED_RETRY_MS));
        return reject(&replica, turn_id, reply, error, trace).await;
    }
    let max_context = replica.config.max_context_bytes;
    let decoded = decode(&message, max_context).and_then(|(turn_id, request)| {
        match caller.check_tenant(&replica.config.frontends, &request.tenant_id) {
            Ok(()) => Ok((turn_id, request)),
            Err(error) => Err((Some(turn_id), error)),
        }
    });
    let (turn_id, request) = match decoded {
        Ok(decoded) => decoded,
        Err((turn_id, error)) => return reject(&replica, turn_id, reply, error, trace).await,
    };
    if let Some(trace) = trace.as_mut() {
        trace.tenant.clone_from(&request.tenant_id);
        trace.session.clone_from(&request.session_id);
    }
    let span = info_span!(
        "intake",
        otel.name = spans::INTAKE,
        otel.kind = "internal",
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = request.tenant_id.as_str(),
        toolfleet.session.id = tracing::field::Empty,
        toolfleet.turn.calls = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if let Some(session) = &request.session_id {
        span.record("toolfleet.session.id", session.as_str());
    }
    match &trace {
        Some(trace) => trace.parent(&span),
        None => telemetry::set_remote_parent(&span, message.headers.as_ref()),
    }
    let caller = caller.frontend.unwrap_or_default();
    let digest = request_digest(&request);
    take_turn(
        replica,
        Taken {
            turn_id,
            reply,
            caller,
            digest,
        },
        request,
        trace,
    )
    .instrument(span)
    .await;
}

/// The most headers a turn request may carry, each value of a repeated name counted.
/// A turn needs none; a frontend sends its turn id, `traceparent`, `tracestate`,
/// `baggage`, perhaps `Nats-Msg-Id`, and a few of its own.
pub(crate) const MAX_REQUEST_HEADERS: usize = 64;

/// The most bytes a turn request's header names and values may add up to: room for a
/// full W3C `baggage` (8,192 bytes) and `tracestate` (32 members) beside the rest.
pub(crate) const MAX_REQUEST_HEADER_BYTES: usize = 16 * 1024;

/// Why `headers` are more or larger than a turn request may carry
/// ([`MAX_REQUEST_HEADERS`], [`MAX_REQUEST_HEADER_BYTES`]), or `None`. Reads at most
/// one value past either limit, so 20,000 headers cost what 65 do.
fn headers_over_limits(headers: Option<&async_nats::HeaderMap>) -> Option<String> {
    let (mut count, mut bytes) = (0usize, 0usize);
    for (name, values) in headers?.iter() {
        let name: &str = name.as_ref();
        for value in values {
            count += 1;
            bytes = bytes.saturating_add(name.len() + value.as_str().len());
            if count > MAX_REQUEST_HEADERS {
                return Some(format!(
                    "a turn request carries at most {MAX_REQUEST_HEADERS} headers"
                ));
            }
            if bytes > MAX_REQUEST_HEADER_BYTES {
                return Some(format!(
                    "a turn request's headers hold at most {MAX_REQUEST_HEADER_BYTES} bytes of names and values"
                ));
            }
        }
    }
    None
}

/// The turn id the request's header names, for refusing a request unread.
fn header_turn_id(message: &async_nats::Message) -> Option<String> {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(toolfleet_common::headers::name(HEADER_TURN_ID)))
        .map(|v| v.to_string())
}

/// The request with its turn id (generated when absent), or why it is refused (with
/// the turn id when one is known).
fn decode(
    message: &async_nats::Message,
    max_context_bytes: usize,
) -> Result<(String, TurnRequest), (Option<String>, CallError)> {
    let invalid = |message: String| CallError::fatal(turn_codes::INVALID_REQUEST, message);
    let mut request: TurnRequest = serde_json::from_slice(&message.payload).map_err(|error| {
        let headers = message.headers.as_ref();
        let turn_id = headers
            .and_then(|h| h.get(toolfleet_common::headers::name(HEADER_TURN_ID)))
            .map(|v| v.to_string());
        (turn_id, invalid(format!("not a turn request: {error}")))
    })?;
    let turn_id = request
        .turn_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    if !valid_turn_id(&turn_id) {
        let why = "turn_id must be 1-64 characters of [A-Za-z0-9_-]";
        return Err((None, invalid(why.into())));
    }
    request.tenant_id = normalize_tenant(&request.tenant_id);
    let tenant = &request.tenant_id;
    if tenant.is_empty() || tenant.len() > 128 || tenant.chars().any(char::is_control) {
        let why = "tenant_id must be 1-128 characters without control characters";
        return Err((Some(turn_id), invalid(why.into())));
    }
    // The context cannot be larger than the request, so only a large request is measured.
    if message.payload.len() > max_context_bytes {
        let size = serde_json::to_vec(&request.context).map_or(usize::MAX, |c| c.len());
        if size > max_context_bytes {
            let why = format!(
                "the turn context is {size} bytes, more than the {max_context_bytes} accepted (TOOLFLEET_MAX_CONTEXT_BYTES); it is copied into every job"
            );
            return Err((
                Some(turn_id),
                CallError::fatal(turn_codes::CONTEXT_TOO_LARGE, why),
            ));
        }
    }
    Ok((turn_id, request))
}

/// The SHA-256 (hex) of what makes a request the same turn: its tenant, session and
/// decision. A resubmission with the same id replays the stored turn only when its
/// digest matches.
pub(crate) fn request_digest(request: &TurnRequest) -> String {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    digest.update(request.tenant_id.as_bytes());
    digest.update([0]);
    digest.update(request.session_id.as_deref().unwrap_or_default().as_bytes());
    digest.update([0]);
    digest.update(serde_json::to_vec(&request.decision).unwrap_or_default());
    digest
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A turn's path, step by step, inside the intake span.
async fn take_turn(
    replica: Arc<Replica>,
    taken: Taken,
    request: TurnRequest,
    mut trace: Option<TurnTrace>,
) {
    let config = &replica.config;
    let decision = match read_decision(config, &request) {
        Ok(decision) => decision,
        Err(end) => return end_without_calls(&replica, taken, &request, trace, end).await,
    };
    let Taken {
        turn_id,
        reply,
        caller,
        digest,
    } = taken;
    let registry = replica.registry.snapshot();
    let Plan {
        limits,
        now,
        deadline,
        planned,
        layout,
        acknowledgement,
    } = plan_turn(config, &registry, &request, decision);
    trace_planned(
        trace.as_mut(),
        &turn_id,
        &request.tenant_id,
        &planned,
        &registry,
    );
    let (traceparent, stored_trace) = TurnTrace::stored(trace.as_ref());
    let first = first_events(&turn_id, &planned, acknowledgement, limits.budget_ms);
    let planned_calls = planned.len();
    let jobs = build_jobs(planned, &layout.calls, &turn_id, &request, deadline);
    let lanes = replica.sharing();
    let tenant = &request.tenant_id;
    if let Err(error) =
        sharing::admit_turn(lanes, &turn_id, tenant, &jobs, deadline, limits.budget_ms).await
    {
        return reject(&replica, Some(turn_id), reply, error, trace).await;
    }
    let laned = sharing::laned(lanes, &turn_id, &jobs);
    let new_turn = NewTurn {
        turn_id: &turn_id,
        reply: reply.as_str(),
        digest: &digest,
        tenant: &request.tenant_id,
        deadline_unix_ms: deadline,
        paced: layout.paced,
        calls: layout.calls.clone(),
        results: layout.refused,
        ttl_ms: limits.budget_ms + millis(config.retention),
        created_unix_ms: now,
        traceparent: &traceparent,
        trace: &stored_trace,
        caller: &caller,
        events: first.clone(),
        ended: false,
        queued: jobs.queued,
        laned,
    };
    let script = trace::join_script("CREATE", &turn_id, &request.tenant_id);
    let refused = new_turn.results.clone();
    match admit(replica.outbox(), new_turn, &reply)
        .instrument(script)
        .await
    {
        Admission::New => {}
        Admission::Replayed => return,
        Admission::Refused(error) => {
            sharing::turn_refused(lanes, tenant, &turn_id, &jobs.now, laned).await;
            return reject(&replica, Some(turn_id), reply, error, trace).await;
        }
    }
    count_refused(&replica.metrics, planned_calls, &refused, &registry);
    events::publish_stored(&replica.nats, &reply, 1, &first).await;
    if layout.dispatched == 0 {
        return end_open_turn(&replica, &turn_id, false).await;
    }
    let owned = owned_turn(
        &replica,
        reply,
        trace.clone(),
        deadline,
        layout.calls,
        &refused,
        now,
    );
    replica.turns.own(turn_id.clone(), owned);
    let dispatched = sharing::dispatch(lanes, &turn_id, jobs.now, trace.as_ref(), laned).await;
    results::record_unpublished(&replica, dispatched.failed).await;
}

/// A turn's plan before anything is stored: its limits and deadline, each call's
/// verdict, the calls' layout, and the model's own acknowledgement.
struct Plan {
    limits: TurnLimits,
    now: u64,
    deadline: u64,
    planned: Vec<PlannedCall>,
    layout: Layout,
    acknowledgement: Option<String>,
}

/// Plans `decision` under the request's limits (`limits.rs`) and each call's verdict
/// (`validate.rs`).
fn plan_turn(
    config: &crate::CoordinatorConfig,
    registry: &Snapshot,
    request: &TurnRequest,
    decision: ToolCallsDecision,
) -> Plan {
    let policy = config.tenants.get(&request.tenant_id);
    let limits = TurnLimits::resolve(config, policy, request, &decision);
    let now = unix_ms();
    let validation = Limits {
        max_calls: limits.max_calls,
        max_argument_bytes: config.max_argument_bytes,
        tool_timeout_cap_ms: policy.tool_timeout_ms,
        tenant_argument_keys: &config.tenant_argument_keys,
    };
    let planned = plan(
        decision.calls,
        &request.tenant_id,
        policy,
        &validation,
        registry,
    );
    let layout = Layout::new(&planned, limits.concurrency);
    Plan {
        deadline: now + limits.budget_ms,
        limits,
        now,
        planned,
        layout,
        acknowledgement: decision.acknowledgement,
    }
}

/// What this replica keeps of a turn it took: where its events go, its span, its
/// deadline, its calls' tools, and (with a narrator that narrates ahead) its
/// calls and refused results for closing it ahead.
fn owned_turn(
    replica: &Replica,
    reply: Reply,
    trace: Option<TurnTrace>,
    deadline_unix_ms: u64,
    calls: Vec<(String, CallEntry)>,
    refused: &[(String, CallResult)],
    created_unix_ms: u64,
) -> OwnedTurn {
    let tools = calls
        .iter()
        .map(|(_, call)| (call.id.clone(), call.name.clone()))
        .collect();
    let ahead = if replica.narrator.narrates_ahead() {
        Ahead::new(calls, refused, created_unix_ms)
    } else {
        None
    };
    OwnedTurn {
        reply,
        trace,
        deadline_unix_ms,
        ended_calls: Default::default(),
        started: Default::default(),
        tools,
        ahead,
    }
}

/// The decision's calls; else the model's plain answer (`Err(Ok)`) or why the
/// decision is refused (`Err(Err)`).
fn read_decision(
    config: &crate::CoordinatorConfig,
    request: &TurnRequest,
) -> Result<ToolCallsDecision, Result<String, CallError>> {
    if request.deadline_ms == Some(0) {
        // 0 is no budget at all: every call would time out. A frontend that means "the
        // default" leaves the field out.
        return Err(Err(CallError::fatal(
            turn_codes::INVALID_REQUEST,
            "deadline_ms must be at least 1 (leave it out for the default)",
        )));
    }
    match parse_decision(&request.decision, config.max_decision_calls) {
        Ok(Decision::ToolCalls(d)) => Ok(d),
        Ok(Decision::Final { text }) => Err(Ok(text)),
        Err(error) => {
            let code = match error.kind() {
                DecisionErrorKind::TooManyCalls => turn_codes::DECISION_TOO_LARGE,
                _ => turn_codes::INVALID_DECISION,
            };
            Err(Err(CallError::fatal(code, error.to_string())))
        }
    }
}

/// Ends a turn refused before any call ran.
/// Ends a turn whose decision runs no call: the model's text is its answer (`Ok`), or
/// the decision is refused (`Err`).
async fn end_without_calls(
    replica: &Arc<Replica>,
    taken: Taken,
    request: &TurnRequest,
    trace: Option<TurnTrace>,
    end: Result<String, CallError>,
) {
    match end {
        Ok(text) => {
            let end = TurnEnd::NoTools {
                taken,
                tenant: request.tenant_id.clone(),
                text,
                trace,
            };
            finish(replica, end).await;
        }
        Err(error) => reject(replica, Some(taken.turn_id), taken.reply, error, trace).await,
    }
}

async fn reject(
    replica: &Arc<Replica>,
    turn_id: Option<String>,
    reply: Reply,
    error: CallError,
    trace: Option<TurnTrace>,
) {
    let end = TurnEnd::Rejected {
        turn_id,
        reply,
        error,
        trace,
    };
    finish(replica, end).await;
}

/// Notes the turn's calls on its spans: their count, and one span per call refused
/// before dispatch, so every call id is in the trace.
fn trace_planned(
    trace: Option<&mut TurnTrace>,
    turn_id: &str,
    tenant: &str,
    planned: &[PlannedCall],
    registry: &Snapshot,
) {
    tracing::Span::current().record("toolfleet.turn.calls", planned.len() as i64);
    let trace = trace.map(|t| {
        t.calls = planned.len();
        &*t
    });
    for p in planned {
        if let Verdict::Refuse(error) = &p.verdict {
            let (id, tool) = (&p.call.id, &p.call.name);
            trace::refused_call(trace, turn_id, tenant, id, tool, error, registry);
        }
    }
}

/// Counts the turn and its calls refused up front.
fn count_refused(
    metrics: &FleetMetrics,
    calls: usize,
    refused: &[(String, CallResult)],
    registry: &Snapshot,
) {
    metrics.turn_started(calls);
    for (_, r) in refused {
        let known = registry.get(&r.name).is_some();
        let label = if known { &r.name } else { UNKNOWN_TOOL_LABEL };
        metrics.call_result(label, r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::Created;
    use crate::store::TurnStore;
    use crate::testing::{self, event_types, finals, open_turn, stored, REPLY};

    fn turn_message(
        replica: &Replica,
        reply: &str,
        request: serde_json::Value,
    ) -> async_nats::Message {
        async_nats::Message {
            subject: replica.names.turn_submit().into(),
            reply: Some(reply.to_string().into()),
            payload: serde_json::to_vec(&request).unwrap_or_default().into(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        }
    }

    fn calls(turn_id: &str, tools: &[&str], deadline_ms: u64) -> serde_json::Value {
        let calls: Vec<_> = (1..)
            .zip(tools)
            .map(|(i, tool)| serde_json::json!({"id": format!("c{i}"), "toolName": tool, "arguments": {}}))
            .collect();
        serde_json::json!({
            "turn_id": turn_id, "tenant_id": "acme", "deadline_ms": deadline_ms,
            "decision": {"type": "tool_calls", "calls": calls}
        })
    }

    fn answer(turn_id: &str, text: &str) -> serde_json::Value {
        serde_json::json!({
            "turn_id": turn_id, "tenant_id": "acme",
            "decision": {"type": "final", "text": text}
        })
    }

    #[test]
    fn headers_are_limited_in_number_and_bytes_every_value_counted() {
        use async_nats::HeaderMap;
        let many = |n: usize, name: &dyn Fn(usize) -> String| {
            let mut headers = HeaderMap::new();
            for i in 0..n {
                headers.append(name(i).as_str(), "v");
            }
            headers
        };
        assert_eq!(headers_over_limits(None), None);
        let distinct = |i: usize| format!("X-H{i}");
        let at_limit = many(MAX_REQUEST_HEADERS, &distinct);
        assert_eq!(headers_over_limits(Some(&at_limit)), None);
        let over = many(MAX_REQUEST_HEADERS + 1, &distinct);
        assert!(headers_over_limits(Some(&over)).is_some());
        // One name repeated is as many headers as its values.
        let repeated = many(20_000, &|_| "X-Same".to_string());
        assert!(headers_over_limits(Some(&repeated)).is_some());

        let mut traced = HeaderMap::new();
        traced.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        traced.insert("baggage", "k=v,".repeat(2048).as_str());
        traced.insert(HEADER_TURN_ID, "t1");
        assert_eq!(headers_over_limits(Some(&traced)), None, "a full baggage");
        let name = "X-Big";
        let fits = "x".repeat(MAX_REQUEST_HEADER_BYTES - name.len());
        let mut big = HeaderMap::new();
        big.insert(name, fits.as_str());
        assert_eq!(headers_over_limits(Some(&big)), None);
        big.insert(name, format!("{fits}x").as_str());
        assert!(headers_over_limits(Some(&big)).is_some());
    }

    #[tokio::test]
    async fn a_turn_is_stored_with_its_ack_and_pending_states_first_and_ends_once() {
        let (store, replica) = testing::store_and_replica().await;
        // No NATS behind this replica: both jobs fail to publish before the deadline,
        // and their dispatch_failed results end the turn.
        let request = calls("t1", &["crm.get", "crm.get"], 600);
        handle_turn_message(Arc::clone(&replica), turn_message(&replica, REPLY, request)).await;
        let turn = stored(&store, "t1");
        let types = event_types(&turn);
        assert_eq!(types[..3], ["ack", "tool_state", "tool_state"], "{types:?}");
        assert!(turn.events[1].contains(r#""state":"pending""#));
        assert_eq!((finals(&turn), turn.published), (1, 1));
        assert!(turn.events.iter().any(|e| e.contains("dispatch_failed")));
        assert!(
            !replica.turns.owns("t1"),
            "the ended turn is no longer owned"
        );
    }

    #[tokio::test]
    async fn a_call_to_an_unknown_tool_is_refused_up_front_and_the_turn_ends_at_once() {
        let (store, replica) = testing::store_and_replica().await;
        let request = calls("t1", &["nope.tool"], 60_000);
        handle_turn_message(Arc::clone(&replica), turn_message(&replica, REPLY, request)).await;
        let turn = stored(&store, "t1");
        assert_eq!(event_types(&turn).first().map(String::as_str), Some("ack"));
        assert!(
            turn.events[1].contains(r#""state":"error""#),
            "{}",
            turn.events[1]
        );
        assert_eq!(turn.ended.as_deref(), Some("complete"));
        assert_eq!((finals(&turn), turn.published), (1, 1));
    }

    #[tokio::test]
    async fn an_answer_without_tools_is_stored_ended_and_a_resubmission_replays_it() {
        let (store, replica) = testing::store_and_replica().await;
        let first = turn_message(&replica, REPLY, answer("t1", "hello"));
        handle_turn_message(Arc::clone(&replica), first).await;
        let turn = stored(&store, "t1");
        assert_eq!(event_types(&turn), ["narration", "final"]);
        assert_eq!(
            (turn.ended.as_deref(), turn.published),
            (Some("no_tools"), 1)
        );

        // The same request again: replayed (marked sent again), nothing stored twice.
        let again = turn_message(&replica, REPLY, answer("t1", "hello"));
        handle_turn_message(Arc::clone(&replica), again).await;
        // Another decision under the same id: refused, the stored turn untouched.
        let other = turn_message(&replica, REPLY, answer("t1", "something else"));
        handle_turn_message(Arc::clone(&replica), other).await;
        let turn = stored(&store, "t1");
        assert_eq!(event_types(&turn), ["narration", "final"]);
        assert!(turn.events[0].contains("hello"));
        assert_eq!(turn.published, 2, "the replay marked the final sent again");
    }

    #[tokio::test]
    async fn a_turn_id_another_frontend_holds_is_refused_and_left_as_stored() {
        let (store, replica) = testing::store_and_replica().await;
        let mut theirs = open_turn("t1", 1, unix_ms() + 60_000);
        theirs.caller = "web";
        assert!(matches!(store.create(theirs).await, Ok(Created::New)));
        let request = calls("t1", &["crm.get"], 60_000);
        handle_turn_message(Arc::clone(&replica), turn_message(&replica, REPLY, request)).await;
        let turn = stored(&store, "t1");
        assert_eq!((turn.caller.as_str(), turn.events.len()), ("web", 1));
        assert_eq!(turn.state, "open");
    }

    #[tokio::test]
    async fn requests_refused_before_the_store_leave_nothing_stored() {
        let (store, replica) = testing::store_and_replica().await;
        // A reply outside the caller's inbox: dropped unread.
        let elsewhere = turn_message(&replica, "orders.new", answer("t1", "hi"));
        handle_turn_message(Arc::clone(&replica), elsewhere).await;
        // A deadline of 0 ms, and a decision that does not parse.
        let mut zero = calls("t2", &["crm.get"], 0);
        zero["deadline_ms"] = 0.into();
        handle_turn_message(Arc::clone(&replica), turn_message(&replica, REPLY, zero)).await;
        let mut unparsed = answer("t3", "x");
        unparsed["decision"] = serde_json::json!({"type": "nonsense"});
        handle_turn_message(
            Arc::clone(&replica),
            turn_message(&replica, REPLY, unparsed),
        )
        .await;
        // A store that cannot be reached refuses the turn.
        store.set_unavailable(true);
        let unreachable = turn_message(&replica, REPLY, answer("t4", "hi"));
        handle_turn_message(Arc::clone(&replica), unreachable).await;
        store.set_unavailable(false);
        for turn_id in ["t1", "t2", "t3", "t4"] {
            assert!(store.turn(turn_id).is_none(), "{turn_id} was stored");
        }
    }
}
