//! Serving one tool: pulling its jobs, running the handler under its timeout, publishing
//! the result, acking the job.
//!
//! Owns the life of a job on this worker. It must never ack a job whose result was not
//! published (the job is handed back instead), nor run a handler past the call's time
//! budget.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use async_nats::HeaderMap;
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::call::{codes, now_rfc3339, unix_ms};
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::names::{spans, HEADER_CALL_ID, HEADER_MSG_ID, HEADER_TURN_ID};
use toolfleet_common::telemetry;
use toolfleet_common::{CallError, CallResult, CallState, JobEnvelope, Names};
use tracing::{debug, info_span, warn, Instrument};

use crate::tool::{Tool, ToolContext};

/// How long one pull request waits for jobs before it is renewed.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How long a batch may stay silent before it is given up: its expiry plus a margin.
const PULL_ABANDON: Duration = Duration::from_secs(2);
/// Attempts to publish a result before the job is handed back.
const RESULT_PUBLISH_ATTEMPTS: u32 = 3;
/// Delay before an idempotent call that failed with a retryable error runs again.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// What every call of every tool on this worker shares.
pub(crate) struct Shared {
    pub nats: async_nats::Client,
    pub js: jetstream::Context,
    pub names: Names,
    pub worker_id: String,
    pub ack_wait: Duration,
    pub max_result_bytes: usize,
    pub metrics: FleetMetrics,
    /// Cancelled when the shutdown grace ran out: running calls stop and their jobs are
    /// handed back (NAK) for another worker.
    pub abandon: CancellationToken,
}

/// A tool with its compiled output schema.
pub(crate) struct ServedTool {
    pub tool: Tool,
    pub output_validator: Option<jsonschema::Validator>,
}

/// Pulls `tool`'s jobs with at most `concurrency` in flight until `shutdown`; every
/// call runs on `tracker` so the caller can wait for in-flight calls.
pub(crate) async fn serve_tool(
    shared: Arc<Shared>,
    tool: Arc<ServedTool>,
    consumer: PullConsumer,
    concurrency: usize,
    shutdown: CancellationToken,
    tracker: TaskTracker,
) {
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut failures = 0u32;
    while !shutdown.is_cancelled() {
        let mut reserved = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = Arc::clone(&slots).acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        while let Ok(more) = Arc::clone(&slots).try_acquire_owned() {
            reserved.merge(more);
        }
        let wanted = reserved.num_permits();
        let batch = consumer
            .batch()
            .max_messages(wanted)
            .expires(PULL_EXPIRES)
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => {
                failures = 0;
                b
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                warn!(tool = %tool.tool.definition().name, %error, "pull request failed");
                let backoff = Duration::from_millis(50 * u64::from(failures.min(20)));
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => continue,
                }
            }
        };
        // A batch is read to its end even after shutdown: its jobs were handed to this
        // worker, so they run (within the grace period) instead of waiting for redelivery.
        // A pull request the server lost (restarted, consumer recreated) never ends on its
        // own: past its expiry the batch is given up and a new one asked for.
        while let Ok(Some(next)) = tokio::time::timeout(PULL_ABANDON, batch.next()).await {
            match next {
                Ok(message) => {
                    let Some(permit) = reserved.split(1) else {
                        warn!("job beyond the requested batch size; handing it back");
                        let _ = message.ack_with(AckKind::Nak(None)).await;
                        continue;
                    };
                    let shared = Arc::clone(&shared);
                    let tool = Arc::clone(&tool);
                    tracker.spawn(async move {
                        handle_job(shared, tool, message).await;
                        drop(permit);
                    });
                }
                Err(error) => {
                    debug!(%error, "batch ended with an error");
                    break;
                }
            }
        }
    }
}

async fn handle_job(shared: Arc<Shared>, tool: Arc<ServedTool>, message: jetstream::Message) {
    let message = Arc::new(message);
    let attempt = message
        .info()
        .map(|i| u32::try_from(i.delivered).unwrap_or(1))
        .unwrap_or(1);
    let mut job: JobEnvelope = match serde_json::from_slice(&message.payload) {
        Ok(job) => job,
        Err(error) => {
            warn!(subject = %message.subject, %error, "undecodable job; terminating it");
            let _ = message.ack_with(AckKind::Term).await;
            return;
        }
    };
    let def = tool.tool.definition();
    let queue_wait_ms = unix_ms().saturating_sub(job.dispatched_unix_ms);
    let span = info_span!(
        "process",
        otel.name = %format!("{} {}", spans::PROCESS, message.subject),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        messaging.system = "nats",
        messaging.operation.name = spans::PROCESS,
        messaging.operation.type = "process",
        messaging.destination.name = %message.subject,
        messaging.consumer.group.name = %shared.names.tool_consumer(&def.name),
        messaging.message.id = %job.msg_id(),
        gen_ai.tool.name = %def.name,
        gen_ai.tool.call.id = %job.call.id,
        toolfleet.turn.id = %job.turn_id,
        toolfleet.tenant.id = %job.tenant_id,
        toolfleet.attempt = attempt,
        toolfleet.queue_wait_ms = queue_wait_ms,
        toolfleet.worker.id = %shared.worker_id,
        error.type = tracing::field::Empty,
    );
    telemetry::set_remote_parent(&span, message.headers.as_ref());
    // A redelivered attempt waited for the ack wait, not in the queue: it is counted in
    // `toolfleet.jobs.redeliveries` instead.
    if attempt == 1 {
        shared
            .metrics
            .queue_waited(&def.name, queue_wait_ms as f64 / 1000.0);
    }
    async move {
        let def = tool.tool.definition();
        let now = unix_ms();
        if attempt > 1 {
            shared.metrics.job_redelivered(&def.name);
        }
        if now >= job.deadline_unix_ms {
            shared.metrics.job_deadline_dropped(&def.name);
            debug!("turn deadline already passed; not running the call");
            let _ = message.ack().await;
            return;
        }
        if attempt > 1 && !def.retry.idempotent {
            shared.metrics.job_interrupted(&def.name);
            let result = CallResult {
                attempts: attempt,
                worker_id: Some(shared.worker_id.clone()),
                ended_at: Some(now_rfc3339()),
                ..CallResult::failure(
                    &job.call,
                    CallState::Error,
                    CallError::fatal(
                        codes::CALL_INTERRUPTED,
                        "the call's worker stopped mid-call and the tool is not idempotent, so it was not run again",
                    ),
                )
            };
            let current = tracing::Span::current();
            current.record("otel.status_code", "ERROR");
            current.record("error.type", codes::CALL_INTERRUPTED);
            finish(&shared, &message, &job, &result).await;
            return;
        }
        notify_started(&shared, &job, attempt).await;

        // Keeps the job alive until its result is published; aborted when dropped, even
        // if this task unwinds.
        let keepalive = {
            let message = Arc::clone(&message);
            let period = (shared.ack_wait / 3).max(Duration::from_millis(50));
            tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(period).await;
                    if message.ack_with(AckKind::Progress).await.is_err() {
                        break;
                    }
                }
            }))
        };

        let started_at = now_rfc3339();
        let started = Instant::now();
        let tool_budget = Duration::from_millis(job.timeout_ms.min(def.timeout_ms).max(1));
        let turn_budget = Duration::from_millis(job.deadline_unix_ms.saturating_sub(now));
        let (budget, budget_code) = if tool_budget <= turn_budget {
            (tool_budget, codes::TOOL_TIMEOUT)
        } else {
            (turn_budget, codes::DEADLINE_EXCEEDED)
        };
        let ctx = ToolContext {
            tenant_id: job.tenant_id.clone(),
            turn_id: job.turn_id.clone(),
            call_id: job.call.id.clone(),
            session_id: job.session_id.clone(),
            deadline_unix_ms: job.deadline_unix_ms,
            attempt,
            context: job.context.clone(),
        };
        let execute = info_span!(
            "execute_tool",
            otel.name = %format!("{} {}", spans::EXECUTE_TOOL, def.name),
            otel.kind = "internal",
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = spans::EXECUTE_TOOL,
            gen_ai.tool.name = %def.name,
            gen_ai.tool.call.id = %job.call.id,
            gen_ai.tool.type = "function",
            toolfleet.turn.id = %job.turn_id,
            toolfleet.tenant.id = %job.tenant_id,
            error.type = tracing::field::Empty,
        );
        shared.metrics.in_flight(&def.name, 1);
        let arguments = std::mem::take(&mut job.call.arguments);
        let run = AssertUnwindSafe(async { tool.tool.call(ctx, arguments).await }).catch_unwind();
        let outcome = tokio::select! {
            outcome = tokio::time::timeout(budget, run).instrument(execute.clone()) => outcome,
            _ = shared.abandon.cancelled() => {
                shared.metrics.in_flight(&def.name, -1);
                hand_back(&shared, &message, &def.name).await;
                return;
            }
        };
        shared.metrics.in_flight(&def.name, -1);

        let mut result = match outcome {
            Ok(Ok(Ok(output))) => {
                let mut r = CallResult::success(&job.call, output.value);
                r.summary = output.summary;
                r
            }
            Ok(Ok(Err(error))) => {
                if error.retryable
                    && def.retry.idempotent
                    && attempt < def.retry.max_attempts
                    && unix_ms() + 2 * u64::try_from(RETRY_DELAY.as_millis()).unwrap_or(0)
                        < job.deadline_unix_ms
                {
                    shared.metrics.job_retried(&def.name);
                    debug!(code = %error.code, "retryable error; the call runs again");
                    let _ = message.ack_with(AckKind::Nak(Some(RETRY_DELAY))).await;
                    return;
                }
                CallResult::failure(&job.call, CallState::Error, error)
            }
            Ok(Err(panic)) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_string());
                CallResult::failure(
                    &job.call,
                    CallState::Error,
                    CallError::fatal(codes::TOOL_PANICKED, format!("the tool panicked: {what}")),
                )
            }
            Err(_) => CallResult::failure(
                &job.call,
                CallState::Timeout,
                CallError::retryable(
                    budget_code,
                    format!("no result within {} ms", budget.as_millis()),
                ),
            ),
        };
        if let (true, Some(validator), Some(value)) =
            (result.ok, tool.output_validator.as_ref(), result.result.as_ref())
        {
            if let Err(error) = validator.validate(value) {
                result = CallResult::failure(
                    &job.call,
                    CallState::Error,
                    CallError::fatal(
                        codes::INVALID_RESULT,
                        format!("result fails the output schema: {error}"),
                    ),
                );
            }
        }
        result.started_at = Some(started_at);
        result.ended_at = Some(now_rfc3339());
        result.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        result.attempts = attempt;
        result.worker_id = Some(shared.worker_id.clone());
        if let Some(error) = &result.error {
            for span in [&execute, &tracing::Span::current()] {
                span.record("otel.status_code", "ERROR");
                span.record("error.type", error.code.as_str());
            }
        }
        shared.metrics.call_executed(
            &def.name,
            result.state.as_str(),
            started.elapsed().as_secs_f64(),
        );
        finish(&shared, &message, &job, &result).await;
        drop(keepalive);
    }
    .instrument(span)
    .await;
}

/// The shutdown grace ran out mid-call: the job goes back to the stream at once.
async fn hand_back(shared: &Shared, message: &jetstream::Message, tool: &str) {
    shared.metrics.job_handed_back(tool);
    warn!("shutdown grace over; handing the running call back");
    if let Err(error) = message.ack_with(AckKind::Nak(None)).await {
        warn!(%error, "could not hand the job back; it is redelivered after the ack wait");
    }
}

async fn notify_started(shared: &Shared, job: &JobEnvelope, attempt: u32) {
    let notice = ProgressNotice::Started {
        tool_call_id: job.call.id.clone(),
        name: job.call.name.clone(),
        attempt,
        worker_id: shared.worker_id.clone(),
    };
    if let Ok(body) = serde_json::to_vec(&notice) {
        let _ = shared
            .nats
            .publish(shared.names.progress_subject(&job.turn_id), body.into())
            .await;
    }
}

/// Publishes `result` and then acks the job; if the result cannot be published the job
/// is handed back for redelivery.
async fn finish(
    shared: &Shared,
    message: &jetstream::Message,
    job: &JobEnvelope,
    result: &CallResult,
) {
    let mut body = match serde_json::to_vec(result) {
        Ok(b) => b,
        Err(error) => {
            warn!(%error, "result does not serialize");
            let _ = message.ack_with(AckKind::Nak(None)).await;
            return;
        }
    };
    if body.len() > shared.max_result_bytes {
        let mut small = CallResult::failure(
            &job.call,
            CallState::Error,
            CallError::fatal(
                codes::RESULT_TOO_LARGE,
                format!(
                    "result is {} bytes, the limit is {}",
                    body.len(),
                    shared.max_result_bytes
                ),
            ),
        );
        small.started_at.clone_from(&result.started_at);
        small.ended_at.clone_from(&result.ended_at);
        small.duration_ms = result.duration_ms;
        small.attempts = result.attempts;
        small.worker_id.clone_from(&result.worker_id);
        body = serde_json::to_vec(&small).unwrap_or_default();
    }
    let body = bytes::Bytes::from(body);
    for attempt in 1..=RESULT_PUBLISH_ATTEMPTS {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER_TURN_ID, job.turn_id.as_str());
        headers.insert(HEADER_CALL_ID, job.call.id.as_str());
        headers.insert(HEADER_MSG_ID, job.msg_id().as_str());
        telemetry::inject_current(&mut headers);
        let published = match shared
            .js
            .publish_with_headers(
                shared.names.result_subject(&job.turn_id),
                headers,
                body.clone(),
            )
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match published {
            Ok(()) => {
                if let Err(error) = message.ack().await {
                    warn!(%error, "job ack failed after its result was published");
                }
                return;
            }
            Err(error) => {
                warn!(attempt, %error, "publishing the result failed");
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
            }
        }
    }
    let _ = message
        .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
        .await;
}
