//! Taking a turn: parse the request and decision, validate every call, create the turn
//! in Redis, emit `ack` and `pending`, dispatch the jobs, arm the deadline.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use tokio_util::sync::CancellationToken;
use toolfleet_common::ack::compose_acknowledgement;
use toolfleet_common::call::{codes, unix_ms};
use toolfleet_common::decision::{parse_decision, Decision, DecisionErrorKind};
use toolfleet_common::names::spans;
use toolfleet_common::names::{HEADER_CALL_ID, HEADER_MSG_ID, HEADER_TENANT_ID, HEADER_TURN_ID};
use toolfleet_common::telemetry;
use toolfleet_common::turn::{turn_codes, valid_turn_id, AckCall};
use toolfleet_common::{CallError, CallResult, CallState, JobEnvelope, TurnEvent, TurnRequest};
use tracing::{debug, info_span, warn, Instrument};

use crate::events;
use crate::finalize::close_turn;
use crate::join::{CallEntry, Finalized, NewTurn};
use crate::results::record_result;
use crate::validate::{plan, Limits, PlannedCall, Verdict};
use crate::{Inner, OwnedTurn, QueuedJob};

/// Metric label of calls whose tool is not in the registry (model-written names would
/// make unbounded label values).
const UNKNOWN_TOOL_LABEL: &str = "_unknown";

/// Handles one message on the turn subject.
pub(crate) async fn handle_turn_message(inner: Arc<Inner>, message: async_nats::Message) {
    let Some(reply) = message.reply.as_ref().map(|r| r.to_string()) else {
        warn!(subject = %message.subject, "turn request without a reply subject dropped");
        return;
    };
    let request: TurnRequest = match serde_json::from_slice(&message.payload) {
        Ok(r) => r,
        Err(error) => {
            let turn_id = message
                .headers
                .as_ref()
                .and_then(|h| h.get(HEADER_TURN_ID))
                .map(|v| v.to_string());
            events::publish(
                &inner.nats,
                &reply,
                &events::turn_error(
                    turn_id.as_deref(),
                    CallError::fatal(
                        turn_codes::INVALID_REQUEST,
                        format!("not a turn request: {error}"),
                    ),
                ),
            )
            .await;
            return;
        }
    };
    let turn_id = request
        .turn_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    if !valid_turn_id(&turn_id) {
        events::publish(
            &inner.nats,
            &reply,
            &events::turn_error(
                None,
                CallError::fatal(
                    turn_codes::INVALID_REQUEST,
                    "turn_id must be 1-64 characters of [A-Za-z0-9_-]",
                ),
            ),
        )
        .await;
        return;
    }
    if request.tenant_id.is_empty()
        || request.tenant_id.len() > 128
        || request.tenant_id.chars().any(char::is_control)
    {
        events::publish(
            &inner.nats,
            &reply,
            &events::turn_error(
                Some(&turn_id),
                CallError::fatal(
                    turn_codes::INVALID_REQUEST,
                    "tenant_id must be 1-128 characters without control characters",
                ),
            ),
        )
        .await;
        return;
    }
    let span = info_span!(
        "turn",
        otel.name = spans::TURN,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        toolfleet.turn.id = %turn_id,
        toolfleet.tenant.id = %request.tenant_id,
        toolfleet.session.id = request.session_id.as_deref().unwrap_or_default(),
        toolfleet.turn.calls = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    telemetry::set_remote_parent(&span, message.headers.as_ref());
    take_turn(inner, turn_id, reply, request)
        .instrument(span)
        .await;
}

async fn take_turn(inner: Arc<Inner>, turn_id: String, reply: String, request: TurnRequest) {
    let fail = |code: &str, message: String| {
        let span = tracing::Span::current();
        span.record("otel.status_code", "ERROR");
        span.record("error.type", code);
        events::turn_error(Some(&turn_id), CallError::fatal(code, message))
    };
    let config = &inner.config;
    let policy = config.tenants.get(&request.tenant_id);
    let decision = match parse_decision(&request.decision, config.max_decision_calls) {
        Ok(d) => d,
        Err(error) => {
            let code = match error.kind() {
                DecisionErrorKind::TooManyCalls => turn_codes::DECISION_TOO_LARGE,
                _ => turn_codes::INVALID_DECISION,
            };
            events::publish(&inner.nats, &reply, &fail(code, error.to_string())).await;
            return;
        }
    };
    let decision = match decision {
        Decision::Final { text } => {
            events::publish(
                &inner.nats,
                &reply,
                &TurnEvent::Narration {
                    turn_id: turn_id.clone(),
                    text: text.clone(),
                },
            )
            .await;
            events::publish(
                &inner.nats,
                &reply,
                &TurnEvent::Final(toolfleet_common::FinalEvent {
                    turn_id: turn_id.clone(),
                    text,
                    results: Vec::new(),
                    summary: Default::default(),
                    history: Default::default(),
                    deadline_hit: false,
                }),
            )
            .await;
            return;
        }
        Decision::ToolCalls(d) => d,
    };

    let max_calls = [
        Some(config.max_calls),
        policy.max_calls,
        request.options.max_calls,
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(config.max_calls);
    let concurrency = [
        Some(config.concurrency),
        policy.concurrency,
        request.options.concurrency,
        decision.concurrency,
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(config.concurrency)
    .max(1);
    let max_deadline_ms = policy
        .deadline_ms
        .unwrap_or(u64::MAX)
        .min(millis(config.max_deadline));
    let budget_ms = request
        .deadline_ms
        .or(policy.deadline_ms)
        .unwrap_or_else(|| millis(config.default_deadline))
        .min(decision.timeout_ms.unwrap_or(u64::MAX))
        .min(max_deadline_ms)
        .max(1);
    let now = unix_ms();
    let deadline = now + budget_ms;

    let registry = inner.registry.snapshot();
    let planned = plan(
        decision.calls,
        &request.tenant_id,
        policy,
        &Limits {
            max_calls,
            max_argument_bytes: config.max_argument_bytes,
            tool_timeout_cap_ms: policy.tool_timeout_ms,
            tenant_argument_keys: &config.tenant_argument_keys,
        },
        &registry,
    );

    let dispatch_count = planned.iter().filter(|p| p.dispatched()).count();
    let paced = dispatch_count > concurrency;
    let mut calls = Vec::with_capacity(planned.len());
    let mut refused = Vec::new();
    let mut dispatched_seen = 0usize;
    for p in &planned {
        let queued = p.dispatched() && {
            dispatched_seen += 1;
            dispatched_seen > concurrency
        };
        calls.push((
            p.key.clone(),
            CallEntry {
                index: p.index,
                id: p.call.id.clone(),
                name: p.call.name.clone(),
                parent_id: p.call.parent_id.clone(),
                queued,
            },
        ));
        if let Verdict::Refuse(error) = &p.verdict {
            let mut r = CallResult::failure(&p.call, CallState::Error, error.clone());
            r.ended_at = Some(toolfleet_common::call::now_rfc3339());
            refused.push((p.key.clone(), r));
        }
    }
    let entries: HashMap<String, CallEntry> = calls.iter().cloned().collect();
    let turn_span = tracing::Span::current();
    turn_span.record("toolfleet.turn.calls", planned.len());
    inner.metrics.turn_started(planned.len());
    for (_, r) in &refused {
        let known = registry.get(&r.name).is_some();
        inner.metrics.call_ended(
            if known { &r.name } else { UNKNOWN_TOOL_LABEL },
            r.state.as_str(),
            r.error.as_ref().map(|e| e.code.as_str()),
        );
    }
    let traceparent = telemetry::traceparent(&turn_span).unwrap_or_default();
    let created = inner
        .join
        .create(NewTurn {
            turn_id: &turn_id,
            reply: &reply,
            tenant: &request.tenant_id,
            deadline_unix_ms: deadline,
            paced,
            calls,
            results: refused.clone(),
            ttl_ms: budget_ms + millis(config.retention),
            created_unix_ms: now,
            traceparent: &traceparent,
        })
        .await;
    match created {
        Ok(true) => {}
        Ok(false) => {
            events::publish(
                &inner.nats,
                &reply,
                &fail(
                    turn_codes::DUPLICATE_TURN,
                    format!("turn {turn_id} already exists"),
                ),
            )
            .await;
            return;
        }
        Err(error) => {
            warn!(%error, "could not create the turn");
            events::publish(
                &inner.nats,
                &reply,
                &events::turn_error(
                    Some(&turn_id),
                    CallError::retryable(turn_codes::UNAVAILABLE, "the turn store is unavailable"),
                ),
            )
            .await;
            return;
        }
    }

    // ack, then one state per call, before any job leaves.
    let hints: Vec<&str> = planned
        .iter()
        .filter(|p| p.dispatched())
        .filter_map(|p| match &p.verdict {
            Verdict::Dispatch { tool, .. } => tool.definition.waiting_hint.as_deref(),
            Verdict::Refuse(_) => None,
        })
        .collect();
    let text = decision
        .acknowledgement
        .clone()
        .unwrap_or_else(|| compose_acknowledgement(&hints));
    events::publish(
        &inner.nats,
        &reply,
        &TurnEvent::Ack {
            turn_id: turn_id.clone(),
            text,
            calls: planned
                .iter()
                .map(|p| AckCall {
                    tool_call_id: p.call.id.clone(),
                    name: p.call.name.clone(),
                })
                .collect(),
        },
    )
    .await;
    for p in &planned {
        let (state, error) = match &p.verdict {
            Verdict::Dispatch { .. } => (CallState::Pending, None),
            Verdict::Refuse(e) => (CallState::Error, Some(e.clone())),
        };
        events::publish(
            &inner.nats,
            &reply,
            &events::tool_state(&turn_id, &p.call.id, &p.call.name, state, error),
        )
        .await;
    }

    if dispatch_count == 0 {
        match inner.join.finalize(&turn_id, "complete").await {
            Ok(Finalized::Ended(closing)) => {
                Box::pin(close_turn(&inner, &turn_id, closing, false)).await
            }
            Ok(_) => {}
            Err(error) => {
                // The turn stays open in Redis with its deadline entry: the sweeper ends it.
                warn!(%error, "could not finalize a turn without runnable calls");
            }
        }
        return;
    }

    let mut now_jobs = Vec::new();
    let mut queue = VecDeque::new();
    for p in planned.into_iter().filter(PlannedCall::dispatched) {
        let Verdict::Dispatch { timeout_ms, .. } = p.verdict else {
            continue;
        };
        let entry = entries.get(&p.key).cloned();
        let job = JobEnvelope {
            turn_id: turn_id.clone(),
            tenant_id: request.tenant_id.clone(),
            session_id: request.session_id.clone(),
            call: p.call,
            deadline_unix_ms: deadline,
            timeout_ms,
            dispatched_unix_ms: 0,
            context: request.context.clone(),
        };
        match entry {
            Some(entry) if entry.queued => queue.push_back(QueuedJob {
                key: p.key,
                job,
                entry,
            }),
            _ => now_jobs.push((p.key, job)),
        }
    }

    let timer = CancellationToken::new();
    inner.own(
        turn_id.clone(),
        OwnedTurn {
            reply: reply.clone(),
            span: turn_span.clone(),
            queue,
            timer: timer.clone(),
            ended_calls: Default::default(),
        },
    );
    arm_deadline(&inner, turn_id.clone(), deadline, timer);
    dispatch(&inner, &turn_id, now_jobs, &turn_span).await;
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Ends the turn at its deadline unless it ended first.
fn arm_deadline(inner: &Arc<Inner>, turn_id: String, deadline: u64, cancel: CancellationToken) {
    let inner_task = Arc::clone(inner);
    inner.tasks.spawn(async move {
        let wait = Duration::from_millis(deadline.saturating_sub(unix_ms()));
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = tokio::time::sleep(wait) => {
                finalize_at_deadline(&inner_task, &turn_id).await;
            }
        }
    });
}

/// Ends `turn_id` at its deadline if nobody did.
pub(crate) async fn finalize_at_deadline(inner: &Arc<Inner>, turn_id: &str) {
    match inner.join.finalize(turn_id, "deadline").await {
        Ok(Finalized::Ended(closing)) => {
            inner
                .gated(turn_id, |gate| async move {
                    // States of results recorded here before the end are published first.
                    let _ending = gate.recording.write().await;
                    let _publishing = gate.publishing.lock().await;
                    Box::pin(close_turn(inner, turn_id, closing, true)).await;
                })
                .await;
        }
        Ok(Finalized::AlreadyEnded | Finalized::UnknownTurn) => {
            inner.release(turn_id);
            if let Err(error) = inner.join.forget_deadline(turn_id).await {
                debug!(%turn_id, %error, "deadline index cleanup failed");
            }
        }
        Err(error) => warn!(%turn_id, %error, "deadline finalization failed; the sweeper retries"),
    }
}

/// Publishes `jobs` (all at once, then waits for every stream ack). A job that cannot
/// be published gets a `dispatch_failed` result.
pub(crate) async fn dispatch(
    inner: &Arc<Inner>,
    turn_id: &str,
    jobs: Vec<(String, JobEnvelope)>,
    parent: &tracing::Span,
) {
    let mut pending = Vec::with_capacity(jobs.len());
    for (key, mut job) in jobs {
        job.dispatched_unix_ms = unix_ms();
        let subject = inner.names.job_subject(&job.call.name);
        let span = info_span!(
            parent: parent,
            "publish",
            otel.name = %format!("{} {subject}", spans::PUBLISH),
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            messaging.system = "nats",
            messaging.operation.name = spans::PUBLISH,
            messaging.operation.type = "send",
            messaging.destination.name = %subject,
            messaging.message.id = %job.msg_id(),
            gen_ai.tool.name = %job.call.name,
            gen_ai.tool.call.id = %job.call.id,
            toolfleet.turn.id = %turn_id,
            error.type = tracing::field::Empty,
        );
        let outcome = publish_job(inner, &job, subject, &span).await;
        pending.push((key, job, outcome, span));
    }
    for (key, job, outcome, span) in pending {
        let error = match outcome {
            Ok(ack) => match std::future::IntoFuture::into_future(ack)
                .instrument(span.clone())
                .await
            {
                Ok(_) => continue,
                Err(e) => e.to_string(),
            },
            Err(e) => e,
        };
        span.record("otel.status_code", "ERROR");
        span.record("error.type", codes::DISPATCH_FAILED);
        warn!(%turn_id, call = %job.call.id, %error, "job publish failed");
        let mut result = CallResult::failure(
            &job.call,
            CallState::Error,
            CallError::retryable(
                codes::DISPATCH_FAILED,
                format!("job publish failed: {error}"),
            ),
        );
        result.ended_at = Some(toolfleet_common::call::now_rfc3339());
        // Boxed: a rare path whose future would otherwise grow every dispatch.
        Box::pin(record_result(inner, turn_id, &key, result)).await;
    }
}

async fn publish_job(
    inner: &Inner,
    job: &JobEnvelope,
    subject: String,
    span: &tracing::Span,
) -> Result<async_nats::jetstream::context::PublishAckFuture, String> {
    let body = serde_json::to_vec(job).map_err(|e| e.to_string())?;
    let mut headers = HeaderMap::new();
    headers.insert(HEADER_MSG_ID, job.msg_id().as_str());
    headers.insert(HEADER_TURN_ID, job.turn_id.as_str());
    headers.insert(HEADER_CALL_ID, job.call.id.as_str());
    headers.insert(HEADER_TENANT_ID, job.tenant_id.as_str());
    telemetry::inject_span(span, &mut headers);
    inner
        .js
        .publish_with_headers(subject, headers, body.into())
        .await
        .map_err(|e| e.to_string())
}

/// Dispatches the next queued job of an owned, paced turn after one of its calls ended.
pub(crate) async fn release_slot(inner: &Arc<Inner>, turn_id: &str) {
    let Some(next) = inner.next_queued(turn_id) else {
        return;
    };
    let mut entry = next.entry.clone();
    entry.queued = false;
    if let Err(error) = inner.join.mark_dispatched(turn_id, &next.key, &entry).await {
        warn!(%turn_id, %error, "could not mark a queued call dispatched");
    }
    let parent = inner
        .turn_span(turn_id)
        .unwrap_or_else(tracing::Span::current);
    dispatch(inner, turn_id, vec![(next.key, next.job)], &parent).await;
}
