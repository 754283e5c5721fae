//! Where a job is published: one JetStream message per runnable call, on the subject of
//! its tool, with the ids in headers, the PRODUCER span's trace context and the turn
//! span's (`Fleet-Turn-Traceparent`).
//!
//! Owns the turn's call layout (which calls run now, which wait for a slot, which were
//! refused up front), building each [`JobEnvelope`], publishing jobs and waiting for
//! their stream acks, and releasing the next held-back call when a slot frees. Every
//! job passes through its tool's lane first (`sharing.rs`), which publishes it here
//! when the tool has a slot for it. A job that cannot be published gets a
//! `dispatch_failed` result, handed back to the caller ([`Unpublished`]), which records
//! it through `results.rs` so the turn still ends.
//!
//! Never decides whether a call may run (`validate.rs` does) and never publishes to a
//! frontend (`events.rs` does). Next: workers run the jobs, and their results come back
//! through `results.rs`.

use std::time::Duration;

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use toolfleet_common::call::{codes, now_rfc3339, unix_ms};
use toolfleet_common::names::spans;
use toolfleet_common::names::HEADER_TURN_TRACEPARENT;
use toolfleet_common::telemetry;
use toolfleet_common::tool::provider_tool_name;
use toolfleet_common::{CallError, CallResult, CallState, JobEnvelope, Names, TurnRequest};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::replica::JobSink;
use crate::store::redis::CallEntry;
use crate::trace::TurnTrace;
use crate::validate::{PlannedCall, Verdict};

/// Where each call of a planned turn stands before anything is published.
pub(crate) struct Layout {
    /// Every call by key, in the model's order, as the join stores them.
    pub calls: Vec<(String, CallEntry)>,
    /// Results of the calls refused up front, by key.
    pub refused: Vec<(String, CallResult)>,
    /// How many calls are dispatched (now or later).
    pub dispatched: usize,
    /// Whether some dispatched calls wait for a slot.
    pub paced: bool,
}

impl Layout {
    /// Lays out `planned` under `concurrency`: the first `concurrency` dispatched calls
    /// run at once, the rest are queued in the model's order.
    pub(crate) fn new(planned: &[PlannedCall], concurrency: usize) -> Self {
        let mut calls = Vec::with_capacity(planned.len());
        let mut refused = Vec::new();
        let mut dispatched = 0usize;
        for p in planned {
            let queued = p.dispatched() && {
                dispatched += 1;
                dispatched > concurrency
            };
            let entry = CallEntry {
                index: p.index,
                id: p.call.id.clone(),
                name: p.call.name.clone(),
                parent_id: p.call.parent_id.clone(),
                queued,
            };
            calls.push((p.key.clone(), entry));
            if let Verdict::Refuse(error) = &p.verdict {
                let mut r = CallResult::failure(&p.call, CallState::Error, error.clone());
                r.ended_at = Some(now_rfc3339());
                refused.push((p.key.clone(), r));
            }
        }
        Self {
            calls,
            refused,
            dispatched,
            paced: dispatched > concurrency,
        }
    }
}

/// The jobs of a turn: those published at once and those held back by pacing.
pub(crate) struct Jobs {
    /// Published at once, by call key.
    pub now: Vec<(String, JobEnvelope)>,
    /// Stored with the turn and published one by one as slots free, by call key, in the
    /// model's order.
    pub queued: Vec<(String, JobEnvelope)>,
}

/// Builds the job of every dispatched call of `planned` (laid out in `calls`).
pub(crate) fn build_jobs(
    planned: Vec<PlannedCall>,
    calls: &[(String, CallEntry)],
    turn_id: &str,
    request: &TurnRequest,
    deadline_unix_ms: u64,
) -> Jobs {
    let mut jobs = Jobs {
        now: Vec::new(),
        queued: Vec::new(),
    };
    for (p, (_, entry)) in planned.into_iter().zip(calls) {
        let Verdict::Dispatch { timeout_ms, .. } = p.verdict else {
            continue;
        };
        let job = JobEnvelope {
            turn_id: turn_id.to_string(),
            tenant_id: request.tenant_id.clone(),
            session_id: request.session_id.clone(),
            call: p.call,
            deadline_unix_ms,
            timeout_ms,
            dispatched_unix_ms: 0,
            context: request.context.clone(),
        };
        if entry.queued {
            jobs.queued.push((p.key, job));
        } else {
            jobs.now.push((p.key, job));
        }
    }
    jobs
}

/// A job that could not be published: the `dispatch_failed` result its caller records
/// (`results::record_unpublished`), so the turn still ends.
#[derive(Debug, Clone)]
pub(crate) struct Unpublished {
    /// The job's turn.
    pub turn_id: String,
    /// The turn's tenant.
    pub tenant: String,
    /// The call's key.
    pub key: String,
    /// The call's `dispatch_failed` result.
    pub result: CallResult,
}

/// What publishing jobs came to.
#[derive(Debug, Default)]
pub(crate) struct Dispatched {
    /// The keys of the jobs the stream acknowledged (or a lane stored).
    pub published: Vec<String>,
    /// The jobs that could not be published, with their results to record.
    pub failed: Vec<Unpublished>,
}

/// Publishes `jobs` (all at once, then waits for every stream ack). A job that cannot
/// be published gets a `dispatch_failed` result, handed back in [`Dispatched::failed`]
/// for the caller to record.
pub(crate) async fn publish(
    sink: JobSink<'_>,
    turn_id: &str,
    jobs: Vec<(String, JobEnvelope)>,
    trace: Option<&TurnTrace>,
) -> Dispatched {
    if jobs.is_empty() {
        return Dispatched::default();
    }
    let mut published = Vec::with_capacity(jobs.len());
    let mut failed = Vec::new();
    let mut pending = Vec::with_capacity(jobs.len());
    let (address, port) = telemetry::server_of(&sink.config.nats_url);
    for (key, mut job) in jobs {
        job.dispatched_unix_ms = unix_ms();
        let subject = job_subject(sink.names, &job);
        let span = publish_span(trace, turn_id, &job, &subject);
        span.record("server.address", address.as_str());
        span.record("server.port", port);
        let outcome = publish_job(sink, &job, subject, &span, trace).await;
        pending.push((key, job, outcome, span));
    }
    for (key, job, outcome, span) in pending {
        let first = match outcome {
            Ok(ack) => std::future::IntoFuture::into_future(ack)
                .instrument(span.clone())
                .await
                .map(|_| ())
                .map_err(JobPublishError::from),
            Err(e) => Err(e),
        };
        let error = match first {
            Ok(()) => {
                published.push(key);
                continue;
            }
            // A job that can never be published is not published again.
            Err(error) if !error.retryable() => error,
            // Whether the job reached the stream is unknown: ask again with the same
            // message id, which the stream de-duplicates.
            // Boxed: a rare path whose future would otherwise grow every publish.
            Err(error) => match Box::pin(publish_again(sink, &job, &span, trace, error)).await {
                Ok(()) => {
                    published.push(key);
                    continue;
                }
                Err(error) => error,
            },
        };
        let message = format!("job publish failed: {error}");
        telemetry::set_error(&span, codes::DISPATCH_FAILED, &message);
        warn!(%turn_id, call = %job.call.id, %error, "job publish failed");
        let error = if error.retryable() {
            CallError::retryable(codes::DISPATCH_FAILED, message)
        } else {
            CallError::fatal(codes::DISPATCH_FAILED, message)
        };
        let mut result = CallResult::failure(&job.call, CallState::Error, error);
        result.ended_at = Some(now_rfc3339());
        failed.push(Unpublished {
            turn_id: turn_id.to_string(),
            tenant: job.tenant_id,
            key,
            result,
        });
    }
    Dispatched { published, failed }
}

/// Why a job was not published.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JobPublishError {
    /// The job does not encode: publishing it again cannot help.
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
    /// The publish or its stream ack failed.
    #[error(transparent)]
    Publish(#[from] async_nats::jetstream::context::PublishError),
}

impl JobPublishError {
    /// Whether publishing the same job again may succeed: not for a job that does not
    /// encode or that is larger than the server accepts, which fail the same way every
    /// time; yes for the rest (a timeout, no stream leader, a connection being
    /// replaced), where whether the job reached the stream is unknown.
    pub(crate) fn retryable(&self) -> bool {
        match self {
            Self::Encode(_) => false,
            Self::Publish(error) => !matches!(error.kind(), PublishErrorKind::MaxPayloadExceeded),
        }
    }
}

/// The subject `job` is published on: its tool's, in its turn's stream partition.
fn job_subject(names: &Names, job: &JobEnvelope) -> String {
    names.job_subject_in(names.partition_of(&job.turn_id), &job.call.name)
}

/// Failed publishes of one job after which its replica moves to another NATS server of
/// a cluster (about 0.85 s of failing).
const MOVE_AFTER_ATTEMPTS: usize = 3;

/// Waits before publishing a job again after its publish or stream ack failed.
const REPUBLISH_DELAYS: [Duration; 4] = [
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
];

/// Publishes `job` again after `error`, with the same `Nats-Msg-Id`, until the stream
/// acknowledges it (a copy that did arrive the first time is acknowledged as a
/// duplicate and stored once) or the turn's deadline would pass: after the delays,
/// once a second. This rides through a stream leader change (a new leader is elected
/// within seconds on a cluster) or a short NATS restart. When the publish still fails
/// after [`MOVE_AFTER_ATTEMPTS`] tries on a cluster and no stream is described through
/// the replica's server either, its connection moves to another server (`Failover`):
/// its own may be cut off, or have rejoined with a JetStream that answers "no stream
/// found" until it catches up. A publish failing while the other streams answer is one
/// stream electing a leader, and moving would not help. An error that can never
/// succeed ([`JobPublishError::retryable`]) ends the tries at once.
async fn publish_again(
    sink: JobSink<'_>,
    job: &JobEnvelope,
    span: &tracing::Span,
    trace: Option<&TurnTrace>,
    mut error: JobPublishError,
) -> Result<(), JobPublishError> {
    let last = REPUBLISH_DELAYS[REPUBLISH_DELAYS.len() - 1];
    for (attempt, delay) in REPUBLISH_DELAYS
        .into_iter()
        .chain(std::iter::repeat(last))
        .enumerate()
    {
        if attempt >= MOVE_AFTER_ATTEMPTS
            && sink
                .failover
                .claim_if_cut_off(sink.js, &sink.names.all_streams())
                .await
        {
            info!(turn_id = %job.turn_id, %error, "job publishes keep failing through this NATS server; moving to another");
            if let Err(move_error) = sink.nats.force_reconnect().await {
                warn!(error = %move_error, "could not move to another NATS server");
            }
        }
        let due = unix_ms() + u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        if due >= job.deadline_unix_ms {
            break;
        }
        debug!(turn_id = %job.turn_id, call = %job.call.id, %error, "job publish unconfirmed; publishing again");
        tokio::time::sleep(delay).await;
        let subject = job_subject(sink.names, job);
        let ack = match publish_job(sink, job, subject, span, trace).await {
            Ok(ack) => ack,
            Err(e) if !e.retryable() => return Err(e),
            Err(e) => {
                error = e;
                continue;
            }
        };
        match std::future::IntoFuture::into_future(ack)
            .instrument(span.clone())
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) => error = e.into(),
        }
        if !error.retryable() {
            break;
        }
    }
    Err(error)
}

/// The producer span of one job publish, a child of the turn span (of the current span
/// when the turn is not traced).
fn publish_span(
    trace: Option<&TurnTrace>,
    turn_id: &str,
    job: &JobEnvelope,
    subject: &str,
) -> tracing::Span {
    let span = info_span!(
        "publish",
        otel.name = toolfleet_common::names::concat(&[spans::PUBLISH, " ", subject]).as_str(),
        otel.kind = "producer",
        messaging.system = "nats",
        messaging.operation.name = spans::PUBLISH,
        messaging.operation.type = "send",
        messaging.destination.name = subject,
        messaging.message.id = job.msg_id().as_str(),
        server.address = tracing::field::Empty,
        server.port = tracing::field::Empty,
        gen_ai.tool.name = job.call.name.as_str(),
        gen_ai.tool.call.id = job.call.id.as_str(),
        toolfleet.tool.provider_name = provider_tool_name(&job.call.name).as_str(),
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = job.tenant_id.as_str(),
        error.type = tracing::field::Empty,
    );
    if let Some(trace) = trace {
        trace.parent(&span);
    }
    span
}

/// Sends one job; the returned future resolves with the stream's ack.
async fn publish_job(
    sink: JobSink<'_>,
    job: &JobEnvelope,
    subject: String,
    span: &tracing::Span,
    trace: Option<&TurnTrace>,
) -> Result<PublishAckFuture, JobPublishError> {
    let body = serde_json::to_vec(job)?;
    let mut headers = toolfleet_common::headers::call_headers(job);
    telemetry::inject_span(span, &mut headers);
    if let Some(trace) = trace {
        let traceparent = trace.span.traceparent();
        toolfleet_common::headers::set(&mut headers, HEADER_TURN_TRACEPARENT, &traceparent);
    }
    // Jobs go only to `subject`, built from `Names` by the caller.
    #[allow(clippy::disallowed_methods)]
    let publishing = sink.js.publish_with_headers(subject, headers, body.into());
    Ok(publishing.await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::testing;
    use async_nats::jetstream::context::PublishError;
    use std::sync::Arc;

    #[test]
    fn only_a_publish_that_may_succeed_is_tried_again() {
        let encode = serde_json::from_str::<u8>("x").map_err(JobPublishError::from);
        assert!(encode.is_err_and(|e| !e.retryable()));
        let too_large =
            JobPublishError::from(PublishError::new(PublishErrorKind::MaxPayloadExceeded));
        assert!(!too_large.retryable());
        for kind in [
            PublishErrorKind::TimedOut,
            PublishErrorKind::StreamNotFound,
            PublishErrorKind::BrokenPipe,
        ] {
            assert!(JobPublishError::from(PublishError::new(kind)).retryable());
        }
    }

    #[tokio::test]
    async fn jobs_that_cannot_be_published_come_back_with_a_retryable_dispatch_failed() {
        let replica = testing::replica(Arc::new(MemoryStore::default())).await;
        let job: JobEnvelope = serde_json::from_value(serde_json::json!({
            "turn_id": "t1", "tenant_id": "acme",
            "call": {"id": "c1", "name": "crm.get", "arguments": {}},
            "deadline_unix_ms": unix_ms() + 150, "timeout_ms": 100, "dispatched_unix_ms": 0
        }))
        .unwrap_or_else(|e| panic!("job: {e}"));
        let dispatched = publish(replica.job_sink(), "t1", vec![("c1".into(), job)], None).await;
        assert!(dispatched.published.is_empty());
        let [failed] = &dispatched.failed[..] else {
            panic!("one failure expected: {dispatched:?}");
        };
        assert_eq!(
            (
                failed.turn_id.as_str(),
                failed.key.as_str(),
                failed.tenant.as_str()
            ),
            ("t1", "c1", "acme")
        );
        let error = failed.result.error.as_ref();
        assert!(error.is_some_and(|e| e.code == codes::DISPATCH_FAILED && e.retryable));
    }
}
