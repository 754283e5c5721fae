//! Serving one tool: pulling its jobs, running the handler under its timeout, publishing
//! the result, acking the job.
//!
//! Owns the life of a job on this worker, and its spans: one CONSUMER `process` span
//! per delivery (a child of the turn span named in `Fleet-Turn-Traceparent`, linked to
//! the coordinator's `publish`) holding the handler's `execute_tool` span; every failed
//! attempt, retried ones included, gets `error.type` and its message. It must never ack
//! a job whose result was not published (the job is handed back instead), nor run a
//! handler past the call's time budget.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::{FutureExt, StreamExt};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::call::{codes, now_rfc3339, unix_ms};
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::names::{concat, spans, HEADER_TURN_TRACEPARENT};
use toolfleet_common::telemetry;
use toolfleet_common::tool::provider_tool_name;
use toolfleet_common::{CallError, CallResult, CallState, JobEnvelope, Names};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::consumers::Bound;
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
    /// `server.address` and `server.port` of the NATS server, for spans.
    pub server: (String, i64),
    pub max_result_bytes: usize,
    /// How long a call runs before its `started` notice is sent (zero: at its start).
    pub running_after: Duration,
    pub metrics: FleetMetrics,
    /// Cancelled when the shutdown grace ran out: running calls stop and their jobs are
    /// handed back (NAK) for another worker.
    pub abandon: CancellationToken,
    /// Turns their callers cancelled: running calls' tokens fire, later jobs are skipped.
    pub cancellations: crate::cancel::Cancellations,
    /// Moves the connection to another server of a cluster when pulls go unanswered.
    pub failover: toolfleet_common::failover::Failover,
    /// Sends the progress acks of running jobs.
    pub keepalives: Arc<crate::keepalive::Keepalives>,
}

/// A tool with its compiled output schema and the settings of the consumer it is served
/// from (retries and keep-alives follow those, not the definition).
pub(crate) struct ServedTool {
    pub tool: Tool,
    pub output: crate::output::OutputCheck,
    pub bound: Bound,
}

/// Pulls `tool`'s jobs with at most `concurrency` in flight until `shutdown`; every
/// call runs on `tracker` so the caller can wait for in-flight calls. Each job runs on
/// the tool `tool` holds when the job arrives, so a tool replaced while it is served
/// (same name, same consumer) takes every job from then on.
pub(crate) async fn serve_tool(
    shared: Arc<Shared>,
    tool: watch::Receiver<Arc<ServedTool>>,
    consumer: PullConsumer,
    concurrency: usize,
    shutdown: CancellationToken,
    tracker: TaskTracker,
) {
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut failures = 0u32;
    let mut silent_pulls = 0u32;
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
        let batch = match batch {
            Ok(b) => {
                failures = 0;
                b
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                warn!(tool = %tool.borrow().tool.definition().name, %error, "pull request failed");
                let backoff = Duration::from_millis(50 * u64::from(failures.min(20)));
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => continue,
                }
            }
        };
        // A batch is read to its end even after shutdown: its jobs were handed to this
        // worker, so they run (within the grace period) instead of waiting for redelivery.
        let abandoned = run_batch(&shared, &tool, batch, reserved, &tracker).await;
        silent_pulls = if abandoned { silent_pulls + 1 } else { 0 };
        if silent_pulls >= MOVE_AFTER_SILENT_PULLS && move_if_cut_off(&shared, &tool).await {
            silent_pulls = 0;
        }
    }
}

/// Hands every job of `batch` to a task of its own on `tracker`, each with one permit of
/// `reserved`, until the batch ends. A pull request the server lost (restarted, consumer
/// recreated) never ends on its own: past [`PULL_ABANDON`] the batch is given up.
/// Whether it was given up so (no server answered the pull, not even with its expiry).
async fn run_batch(
    shared: &Arc<Shared>,
    tool: &watch::Receiver<Arc<ServedTool>>,
    mut batch: async_nats::jetstream::consumer::pull::Batch,
    mut reserved: tokio::sync::OwnedSemaphorePermit,
    tracker: &TaskTracker,
) -> bool {
    loop {
        let next = match tokio::time::timeout(PULL_ABANDON, batch.next()).await {
            Ok(Some(next)) => next,
            Ok(None) => return false,
            Err(_) => return true,
        };
        match next {
            Ok(message) => {
                let Some(permit) = reserved.split(1) else {
                    warn!("job beyond the requested batch size; handing it back");
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    continue;
                };
                let shared = Arc::clone(shared);
                let tool = Arc::clone(&tool.borrow());
                // Boxed: the task then moves a pointer, not the job's whole state
                // machine, each time it is spawned, polled to its end and dropped.
                tracker.spawn(Box::pin(async move {
                    handle_job(shared, tool, message).await;
                    drop(permit);
                }));
            }
            Err(error) => {
                debug!(%error, "batch ended with an error");
                return false;
            }
        }
    }
}

/// After pulls that no server answered, one after another: this worker's NATS server
/// may be cut off from the cluster (it keeps the connection and swallows the requests).
/// Moves the connection to another server of the cluster, unless the streams are still
/// described through it (the consumer's leader is being elected again: every server
/// would be as silent). Whether it moved.
async fn move_if_cut_off(shared: &Shared, tool: &watch::Receiver<Arc<ServedTool>>) -> bool {
    if !shared
        .failover
        .claim_if_cut_off(&shared.js, &shared.names.all_streams())
        .await
    {
        return false;
    }
    info!(
        tool = %tool.borrow().tool.definition().name,
        "no NATS server answers this worker's pulls; moving to another server"
    );
    if let Err(error) = shared.nats.force_reconnect().await {
        warn!(%error, "could not move to another NATS server");
    }
    true
}

/// Pull requests in a row that no server answered (each given up after
/// [`PULL_ABANDON`]) after which a worker on a cluster moves to another NATS server: more
/// than a consumer leader's change swallows (a request held by a leader that steps down).
const MOVE_AFTER_SILENT_PULLS: u32 = 3;

async fn handle_job(shared: Arc<Shared>, tool: Arc<ServedTool>, message: jetstream::Message) {
    let message = Arc::new(message);
    let attempt = message
        .info()
        .map(|i| u32::try_from(i.delivered).unwrap_or(1))
        .unwrap_or(1);
    let job: JobEnvelope = match serde_json::from_slice(&message.payload) {
        Ok(job) => job,
        Err(error) => {
            warn!(subject = %message.subject, %error, "undecodable job; terminating it");
            let _ = message.ack_with(AckKind::Term).await;
            return;
        }
    };
    let def = tool.tool.definition();
    let queue_wait_ms = unix_ms().saturating_sub(job.dispatched_unix_ms);
    let span = process_span(&shared, def, &job, &message, attempt, queue_wait_ms);
    // A redelivered attempt waited for the ack wait, not in the queue: it is counted in
    // `toolfleet.jobs.redeliveries` instead.
    if attempt == 1 {
        shared
            .metrics
            .queue_waited(&def.name, queue_wait_ms as f64 / 1000.0);
    } else {
        shared.metrics.job_redelivered(&def.name);
    }
    run_job(shared, tool, message, job, attempt)
        .instrument(span)
        .await;
}

/// The CONSUMER span of one job delivery (one per attempt): under the turn span,
/// linked to the coordinator's publish span.
fn process_span(
    shared: &Shared,
    def: &toolfleet_common::ToolDefinition,
    job: &JobEnvelope,
    message: &jetstream::Message,
    attempt: u32,
    queue_wait_ms: u64,
) -> tracing::Span {
    let span = info_span!(
        "process",
        otel.name = concat(&[spans::PROCESS, " ", &message.subject]).as_str(),
        otel.kind = "consumer",
        messaging.system = "nats",
        messaging.operation.name = spans::PROCESS,
        messaging.operation.type = "process",
        messaging.destination.name = message.subject.as_str(),
        messaging.consumer.group.name = shared.names.tool_consumer(&def.name).as_str(),
        server.address = shared.server.0.as_str(),
        server.port = shared.server.1,
        messaging.message.id = job.msg_id().as_str(),
        gen_ai.tool.name = def.name.as_str(),
        gen_ai.tool.call.id = job.call.id.as_str(),
        toolfleet.turn.id = job.turn_id.as_str(),
        toolfleet.tenant.id = job.tenant_id.as_str(),
        toolfleet.attempt = i64::from(attempt),
        toolfleet.queue_wait_ms = i64::try_from(queue_wait_ms).unwrap_or(i64::MAX),
        toolfleet.worker.id = shared.worker_id.as_str(),
        toolfleet.retried = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    telemetry::set_consumer_parent(&span, message.headers.as_ref());
    span
}

/// One delivery of a job, inside its `process` span: refuse what must not run, run
/// the handler, publish the result (or hand the job back for a retry).
async fn run_job(
    shared: Arc<Shared>,
    tool: Arc<ServedTool>,
    message: Arc<jetstream::Message>,
    mut job: JobEnvelope,
    attempt: u32,
) {
    let def = tool.tool.definition();
    if unix_ms() >= job.deadline_unix_ms {
        shared.metrics.job_deadline_dropped(&def.name);
        debug!("turn deadline already passed; not running the call");
        let why = "the turn's deadline passed before the call started";
        telemetry::set_error(&tracing::Span::current(), codes::DEADLINE_EXCEEDED, why);
        let _ = message.ack().await;
        return;
    }
    if attempt > 1 && !def.retry.idempotent {
        shared.metrics.job_interrupted(&def.name);
        let error = CallError::fatal(
            codes::CALL_INTERRUPTED,
            "the call's worker stopped mid-call and the tool is not idempotent, so it was not run again",
        );
        telemetry::set_error(&tracing::Span::current(), &error.code, &error.message);
        let result = CallResult {
            attempts: attempt,
            worker_id: Some(shared.worker_id.clone()),
            ended_at: Some(now_rfc3339()),
            ..CallResult::failure(&job.call, CallState::Error, error)
        };
        finish(&shared, &message, &job, &result).await;
        return;
    }
    let Some(running) = shared.cancellations.enter(&job.turn_id) else {
        shared.metrics.job_cancelled(&def.name);
        debug!("turn cancelled by its caller; not running the call");
        let _ = message.ack().await;
        return;
    };
    // Keeps the job alive until its result is published or it is handed back; given up
    // when dropped, even if this task unwinds.
    let period = (tool.bound.ack_wait / 3).max(Duration::from_millis(50));
    let kept = shared.keepalives.keep(Arc::clone(&message), period);
    match execute(&shared, &tool, &mut job, attempt, running.token()).await {
        // The turn ended with its final when it was cancelled: nobody waits for this.
        Executed::Done(_) if running.token().is_cancelled() => {
            shared.metrics.job_cancelled(&tool.tool.definition().name);
            debug!("turn cancelled while the call ran; its result is dropped");
            let _ = message.ack().await;
        }
        Executed::Done(result) => finish(&shared, &message, &job, &result).await,
        Executed::Retry => {
            let _ = message.ack_with(AckKind::Nak(Some(RETRY_DELAY))).await;
        }
        Executed::Abandoned => hand_back(&shared, &message, &tool.tool.definition().name).await,
    }
    drop(kept);
}

/// What running a handler once came to.
enum Executed {
    /// The call's result, to publish.
    Done(Box<CallResult>),
    /// A retryable failure of an idempotent tool with attempts and time left: the job
    /// is handed back and runs again.
    Retry,
    /// The shutdown grace ran out while the handler ran: the job goes back at once.
    Abandoned,
}

/// Runs the handler once under the call's time budget, inside its `execute_tool` span;
/// both spans get the failure's `error.type` and message, retried attempts included.
async fn execute(
    shared: &Shared,
    tool: &ServedTool,
    job: &mut JobEnvelope,
    attempt: u32,
    cancellation: &CancellationToken,
) -> Executed {
    let def = tool.tool.definition();
    let now = unix_ms();
    let started_at = now_rfc3339();
    let started = Instant::now();
    let (budget, budget_code) = budget(job, def, now);
    let ctx = ToolContext {
        tenant_id: job.tenant_id.clone(),
        turn_id: job.turn_id.clone(),
        call_id: job.call.id.clone(),
        session_id: job.session_id.clone(),
        deadline_unix_ms: job.deadline_unix_ms,
        attempt,
        context: job.context.clone(),
        cancellation: cancellation.clone(),
    };
    let execute = execute_span(def, job);
    shared.metrics.in_flight(&def.name, 1);
    let arguments = std::mem::take(&mut job.call.arguments);
    let run = AssertUnwindSafe(async { tool.tool.run(ctx, arguments).await }).catch_unwind();
    let run = announced(shared, job, attempt, run);
    let outcome = tokio::select! {
        outcome = tokio::time::timeout(budget, run).instrument(execute.clone()) => outcome,
        _ = shared.abandon.cancelled() => {
            shared.metrics.in_flight(&def.name, -1);
            return Executed::Abandoned;
        }
    };
    shared.metrics.in_flight(&def.name, -1);

    let spans = [&execute, &tracing::Span::current()];
    let mut result = match outcome {
        Ok(Ok(Ok(output))) => {
            let mut r = CallResult::success(&job.call, output.value);
            r.summary = output.summary;
            r
        }
        Ok(Ok(Err(error))) => {
            if error.retryable
                && def.retry.idempotent
                && attempt < tool.bound.max_deliver
                && unix_ms() + 2 * u64::try_from(RETRY_DELAY.as_millis()).unwrap_or(0)
                    < job.deadline_unix_ms
            {
                shared.metrics.job_retried(&def.name);
                debug!(code = %error.code, "retryable error; the call runs again");
                for span in spans {
                    telemetry::set_error(span, &error.code, &error.message);
                }
                tracing::Span::current().record("toolfleet.retried", true);
                return Executed::Retry;
            }
            CallResult::failure(&job.call, CallState::Error, error)
        }
        Ok(Err(panic)) => {
            let what = panic_message(panic.as_ref());
            telemetry::record_exception(&execute, "panic", &what);
            let message = format!("the tool panicked: {what}");
            let error = CallError::fatal(codes::TOOL_PANICKED, message);
            CallResult::failure(&job.call, CallState::Error, error)
        }
        Err(_) => {
            let message = format!("no result within {} ms", budget.as_millis());
            let error = CallError::retryable(budget_code, message);
            CallResult::failure(&job.call, CallState::Timeout, error)
        }
    };
    if let Some(invalid) = invalid_output(tool, &result, job) {
        result = invalid;
    }
    result.started_at = Some(started_at);
    result.ended_at = Some(now_rfc3339());
    result.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    result.attempts = attempt;
    result.worker_id = Some(shared.worker_id.clone());
    if let Some(error) = &result.error {
        for span in spans {
            telemetry::set_error(span, &error.code, &error.message);
        }
        let reason = telemetry::bounded_message(&error.message);
        // One short line: the job's spans (a dozen fields each) are left out of it; the
        // trace id ties it to them when spans are exported.
        let trace_id = spans.first().and_then(|span| telemetry::trace_id(span));
        info!(
            parent: None,
            tool = %def.name,
            call = %job.call.id,
            turn = %job.turn_id,
            attempt,
            trace_id = trace_id.as_deref().unwrap_or(""),
            code = %error.code,
            %reason,
            "call failed"
        );
    }
    shared.metrics.call_executed(
        &def.name,
        result.state.as_str(),
        started.elapsed().as_secs_f64(),
    );
    Executed::Done(Box::new(result))
}

/// The call's time budget and the code of its timeout: the tool's (capped by the
/// job) or what is left of the turn's, whichever ends first.
fn budget(
    job: &JobEnvelope,
    def: &toolfleet_common::ToolDefinition,
    now: u64,
) -> (Duration, &'static str) {
    let tool_budget = Duration::from_millis(job.timeout_ms.min(def.timeout_ms).max(1));
    let turn_budget = Duration::from_millis(job.deadline_unix_ms.saturating_sub(now));
    if tool_budget <= turn_budget {
        (tool_budget, codes::TOOL_TIMEOUT)
    } else {
        (turn_budget, codes::DEADLINE_EXCEEDED)
    }
}

/// The `invalid_result` failure replacing a successful `result` that fails the tool's
/// output schema.
fn invalid_output(tool: &ServedTool, result: &CallResult, job: &JobEnvelope) -> Option<CallResult> {
    let (true, Some(value)) = (result.ok, result.result.as_ref()) else {
        return None;
    };
    let error = tool.output.violation(value)?;
    let message = format!("result fails the output schema: {error}");
    let error = CallError::fatal(codes::INVALID_RESULT, message);
    Some(CallResult::failure(&job.call, CallState::Error, error))
}

/// The text a panic was raised with.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// The `execute_tool` span of one call, after the GenAI conventions.
fn execute_span(def: &toolfleet_common::ToolDefinition, job: &JobEnvelope) -> tracing::Span {
    let span = info_span!(
        "execute_tool",
        otel.name = concat(&[spans::EXECUTE_TOOL, " ", &def.name]).as_str(),
        otel.kind = "internal",
        gen_ai.operation.name = spans::EXECUTE_TOOL,
        gen_ai.tool.name = def.name.as_str(),
        gen_ai.tool.call.id = job.call.id.as_str(),
        gen_ai.tool.type = "function",
        gen_ai.tool.description = def.description.as_str(),
        toolfleet.tool.provider_name = provider_tool_name(&def.name).as_str(),
        toolfleet.turn.id = job.turn_id.as_str(),
        toolfleet.tenant.id = job.tenant_id.as_str(),
        toolfleet.session.id = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if let Some(session) = &job.session_id {
        span.record("toolfleet.session.id", session.as_str());
    }
    span
}

/// Runs `call`, sending the call's `started` notice once it has run for
/// [`Shared::running_after`] (at once when that is zero). A call that ends sooner sends
/// none: the notice would only race its own result to the coordinator, which relays a
/// `running` only for a call without a result.
async fn announced<F: std::future::Future>(
    shared: &Shared,
    job: &JobEnvelope,
    attempt: u32,
    call: F,
) -> F::Output {
    let started_unix_ms = toolfleet_common::call::unix_ms();
    if shared.running_after.is_zero() {
        notify_started(shared, job, attempt, started_unix_ms).await;
        return call.await;
    }
    let mut call = std::pin::pin!(call);
    tokio::select! {
        biased;
        output = &mut call => output,
        () = tokio::time::sleep(shared.running_after) => {
            // The call goes on while the notice is handed to the connection.
            let notice = notify_started(shared, job, attempt, started_unix_ms);
            let ((), output) = tokio::join!(notice, call);
            output
        }
    }
}

async fn notify_started(shared: &Shared, job: &JobEnvelope, attempt: u32, started_unix_ms: u64) {
    let notice = ProgressNotice::Started {
        tool_call_id: job.call.id.clone(),
        name: job.call.name.clone(),
        attempt,
        worker_id: shared.worker_id.clone(),
        started_unix_ms: Some(started_unix_ms),
    };
    if let Ok(body) = serde_json::to_vec(&notice) {
        let _ = shared
            .nats
            .publish(
                shared
                    .names
                    .tool_progress_subject(&job.turn_id, &job.call.name),
                body.into(),
            )
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
    let job_headers = message.headers.as_ref();
    for attempt in 1..=RESULT_PUBLISH_ATTEMPTS {
        let mut headers = toolfleet_common::headers::call_headers(job);
        if let Some(turn) = job_headers
            .and_then(|h| h.get(toolfleet_common::headers::name(HEADER_TURN_TRACEPARENT)))
        {
            toolfleet_common::headers::set(&mut headers, HEADER_TURN_TRACEPARENT, turn.as_str());
        }
        telemetry::inject_current(&mut headers);
        let published = match shared
            .js
            .publish_with_headers(
                // In the stream partition the job came from.
                shared.names.tool_result_subject_in(
                    shared
                        .names
                        .job_subject_partition(&message.subject)
                        .unwrap_or(0),
                    &job.turn_id,
                    &job.call.name,
                ),
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

/// The shutdown grace ran out mid-call: the job goes back to the stream at once.
async fn hand_back(shared: &Shared, message: &jetstream::Message, tool: &str) {
    shared.metrics.job_handed_back(tool);
    warn!("shutdown grace over; handing the running call back");
    if let Err(error) = message.ack_with(AckKind::Nak(None)).await {
        warn!(%error, "could not hand the job back; it is redelivered after the ack wait");
    }
}
