//! The job cases, one function each, in the order they run: what to publish, what a
//! worker following PROTOCOL §7 sends back, and the findings where it does not.

use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::{json, Value};
use toolfleet_common::call::{codes, unix_ms};
use toolfleet_common::names::{HEADER_CALL_ID, HEADER_MSG_ID, HEADER_TURN_ID};
use toolfleet_common::{CallResult, CallState, JobEnvelope, ToolCall};

use super::probe::Probe;
use super::watch::{Reply, Seen, Watch};
use super::{Case, Settings};

/// The job cases, in the order they run.
pub const NAMES: [&str; 6] = ["echo", "retry", "term", "keepalive", "panic", "shutdown"];

/// Keep-alives more often than this are too often (PROTOCOL §7.6).
const KEEPALIVE_FLOOR: Duration = Duration::from_millis(50);

/// Runs every job case.
pub async fn run_all(probe: &Probe, settings: &Settings) -> Vec<Case> {
    let timeout = settings.timeout;
    vec![
        echo(probe, timeout).await,
        retry(probe, timeout).await,
        term(probe, timeout).await,
        keepalive(probe, timeout).await,
        panic(probe, timeout).await,
        match settings.pid {
            Some(pid) => shutdown(probe, timeout, pid).await,
            None => Case::skipped("shutdown", "needs --pid of the worker process"),
        },
    ]
}

/// A job of the probe for case `case` with `arguments`.
fn job(probe: &Probe, case: &str, arguments: Value, timeout: Duration) -> JobEnvelope {
    let now = unix_ms();
    let budget = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    JobEnvelope {
        turn_id: format!("conformance{}", uuid::Uuid::new_v4().simple()),
        tenant_id: "conformance".into(),
        session_id: None,
        call: ToolCall {
            id: format!("probe-{case}"),
            name: probe.tool.clone(),
            arguments,
            parent_id: None,
        },
        deadline_unix_ms: now + budget,
        timeout_ms: probe.timeout_ms,
        dispatched_unix_ms: now,
        context: Default::default(),
    }
}

/// Publishes `body` with `job`'s headers, watching what the worker sends about it; a
/// `publish_failed` finding when it cannot.
async fn publish(
    probe: &Probe,
    case: &mut Case,
    job: &JobEnvelope,
    body: Vec<u8>,
) -> Option<Watch> {
    let watched = async {
        let mut watch = Watch::start(probe, &job.turn_id).await?;
        let headers = toolfleet_common::headers::call_headers(job);
        watch.publish(probe, headers, body).await?;
        Ok::<_, async_nats::Error>(watch)
    };
    match watched.await {
        Ok(watch) => Some(watch),
        Err(error) => {
            case.fail("publish_failed", format!("publishing the job: {error}"));
            None
        }
    }
}

/// Publishes `job` and watches it until it is done with or `timeout` passes.
async fn send(
    probe: &Probe,
    case: &mut Case,
    job: &JobEnvelope,
    timeout: Duration,
) -> Option<Watch> {
    let body = serde_json::to_vec(job).unwrap_or_default();
    let mut watch = publish(probe, case, job, body).await?;
    if !watch.until_done(timeout).await {
        case.fail(
            "not_acked",
            format!("the job was neither acked nor terminated within {timeout:?}"),
        );
    }
    Some(watch)
}

/// The one result of `job`, checked against PROTOCOL §3.4 and §7.8.
fn result(case: &mut Case, watch: &Watch, job: &JobEnvelope, probe: &Probe) -> Option<CallResult> {
    let results: Vec<_> = watch.results().collect();
    let Some((at, subject, headers, body)) = results.first().copied() else {
        case.fail("no_result", "no result was published (PROTOCOL §7.8)");
        return None;
    };
    if results.len() > 1 {
        case.warn(
            "several_results",
            format!("{} results for one call", results.len()),
        );
    }
    let wanted = probe.names.tool_result_subject(&job.turn_id, &probe.tool);
    if *subject == probe.names.result_subject(&job.turn_id) {
        case.warn(
            "old_result_subject",
            format!("result on {subject}; publish on {wanted} (PROTOCOL §7.8)"),
        );
    } else if *subject != wanted {
        case.fail(
            "result_subject",
            format!("result on {subject}, not {wanted}"),
        );
    }
    check_headers(case, headers.as_ref(), job);
    let acked = watch
        .replies()
        .find(|(_, _, r)| **r == Reply::Ack)
        .map(|(after, _, _)| after);
    if acked.is_some_and(|acked| acked < at) {
        case.fail(
            "acked_before_result",
            "the job was acked before its result was published (PROTOCOL §7.8)",
        );
    }
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        case.fail("result_not_json", "the result is not JSON");
        return None;
    };
    check_counts(case, &value);
    let result = match serde_json::from_value::<CallResult>(value) {
        Ok(result) => result,
        Err(error) => {
            case.fail("result_undecodable", format!("coordinators cannot read the result ({error}): the call ends deadline_exceeded"));
            return None;
        }
    };
    if result.tool_call_id != job.call.id || result.name != probe.tool {
        case.fail(
            "result_ids",
            format!(
                "the result names call {:?} of {:?}, not {:?} of {:?}",
                result.tool_call_id, result.name, job.call.id, probe.tool
            ),
        );
    }
    if result.ok != (result.state == CallState::Done) {
        case.fail(
            "result_ok",
            "ok must be true exactly when state is done (PROTOCOL §3.4)",
        );
    }
    if result.worker_id.is_none() {
        case.warn("no_worker_id", "the result has no worker_id");
    }
    if result.state != CallState::Skipped
        && (result.started_at.is_none() || result.ended_at.is_none())
    {
        case.warn(
            "no_times",
            "started_at and ended_at should be set (PROTOCOL §3.4)",
        );
    }
    Some(result)
}

/// The result's headers: the message id de-duplicates, the ids name the call (§2.5).
fn check_headers(case: &mut Case, headers: Option<&HeaderMap>, job: &JobEnvelope) {
    let get = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.to_string());
    for (name, wanted) in [
        (HEADER_MSG_ID, job.msg_id()),
        (HEADER_TURN_ID, job.turn_id.clone()),
        (HEADER_CALL_ID, job.call.id.clone()),
    ] {
        match get(name) {
            Some(value) if value == wanted => {}
            Some(value) => case.fail(
                "result_headers",
                format!("{name} is {value:?}, not {wanted:?} (PROTOCOL §2.5)"),
            ),
            None => case.fail(
                "result_headers",
                format!("no {name} header (PROTOCOL §2.5)"),
            ),
        }
    }
}

/// Counts written as anything but integers: coordinators read them leniently (§3.4),
/// so a warning; not a number at all is a failure.
fn check_counts(case: &mut Case, result: &Value) {
    for field in ["duration_ms", "attempts"] {
        match &result[field] {
            Value::Null => {}
            v if v.is_u64() => {}
            v if v.is_number() => case.warn(
                "non_integer_field",
                format!("{field} is {v}, not an integer: coordinators round it (PROTOCOL §3.4); write an integer"),
            ),
            v => case.fail("result_type", format!("{field} is {v}, not a number")),
        }
    }
}

/// Fails `case` with `code` unless `result` is `done` on delivery `attempts` (`which`
/// says why that delivery is the one that answers).
fn done_on(case: &mut Case, result: &CallResult, attempts: u32, code: &'static str, which: &str) {
    if result.state != CallState::Done || result.attempts != attempts {
        case.fail(
            code,
            format!(
                "state {:?} after {} attempts; {which}",
                result.state, result.attempts
            ),
        );
    }
}

/// Whether a NAK came before the job was done with.
fn naked(watch: &Watch) -> bool {
    watch
        .replies()
        .any(|(_, _, r)| matches!(r, Reply::Nak { .. }))
}

/// `echo`: answered once, done, the value back. An instant call needs no `started`
/// notice (§7.5): `keepalive` checks it on a long call.
async fn echo(probe: &Probe, timeout: Duration) -> Case {
    let mut case = Case::new("echo");
    let value = uuid::Uuid::new_v4().simple().to_string();
    let job = job(
        probe,
        "echo",
        json!({"behave": "echo", "value": value}),
        timeout,
    );
    let Some(watch) = send(probe, &mut case, &job, timeout).await else {
        return case;
    };
    if let Some(result) = result(&mut case, &watch, &job, probe) {
        if result.state != CallState::Done {
            case.fail(
                "not_done",
                format!("state {:?}, error {:?}", result.state, result.error),
            );
        } else if result.result.as_ref().map(|r| &r["value"]) != Some(&json!(value)) {
            case.fail(
                "wrong_value",
                format!("the probe answered {:?}", result.result),
            );
        }
        if result.attempts != 1 {
            case.fail(
                "attempts",
                format!("attempts is {}, the delivery count is 1", result.attempts),
            );
        }
    }
    if naked(&watch) {
        case.fail("unexpected_nak", "a job that succeeded was NAKed");
    }
    case
}

/// `retry`: a retryable failure of an idempotent tool below max_deliver is NAKed with a
/// delay, not published; the redelivery answers with attempts 2 (§7.7).
async fn retry(probe: &Probe, timeout: Duration) -> Case {
    let mut case = Case::new("retry");
    let args = json!({"behave": "fail_retryable", "succeed_on_attempt": 2});
    let job = job(probe, "retry", args, timeout);
    let Some(watch) = send(probe, &mut case, &job, timeout).await else {
        return case;
    };
    let first_nak = watch
        .replies()
        .find(|(_, delivered, r)| *delivered == 1 && matches!(r, Reply::Nak { .. }));
    match first_nak {
        None => case.fail(
            "no_retry_nak",
            "the retryable failure of delivery 1 was not NAKed (PROTOCOL §7.7)",
        ),
        Some((_, _, Reply::Nak { delay: false })) => case.warn(
            "nak_without_delay",
            "the retry NAK has no delay; PROTOCOL §7.7 asks for 100 ms",
        ),
        Some(_) => {}
    }
    if let Some(result) = result(&mut case, &watch, &job, probe) {
        if result.state == CallState::Error && result.attempts <= 1 {
            case.fail(
                "retry_published",
                "the retryable error of delivery 1 was published instead of NAKed (PROTOCOL §7.7)",
            );
        } else {
            done_on(
                &mut case,
                &result,
                2,
                "retry_outcome",
                "the redelivery (attempt 2) answers",
            );
        }
    }
    case
}

/// `term`: a job that does not decode is terminated, never acked or NAKed (§7.2).
async fn term(probe: &Probe, timeout: Duration) -> Case {
    let mut case = Case::new("term");
    let job = job(probe, "term", json!({}), timeout);
    let body = b"{\"turn_id\": not a job".to_vec();
    let Some(mut watch) = publish(probe, &mut case, &job, body).await else {
        return case;
    };
    let wait = timeout.min(probe.ack_wait * 2);
    watch.until_done(wait).await;
    let replies: Vec<_> = watch.replies().map(|(_, _, r)| r.clone()).collect();
    if !replies.contains(&Reply::Term) {
        let seen = if replies.is_empty() {
            "nothing".to_string()
        } else {
            format!("{replies:?}")
        };
        case.fail(
            "no_term",
            format!("an undecodable job got {seen} instead of +TERM (PROTOCOL §7.2)"),
        );
    }
    if watch.results().next().is_some() {
        case.fail(
            "result_for_undecodable",
            "a result was published for a job that does not decode",
        );
    }
    case
}

/// `keepalive`: a call longer than the consumer's ack wait is kept alive with `+WPI`
/// at least once per ack wait (and not more often than every 50 ms), so it is never
/// redelivered while it runs (§7.6).
async fn keepalive(probe: &Probe, timeout: Duration) -> Case {
    let ack_wait = probe.ack_wait;
    let sleep = ack_wait * 3 / 2;
    let budget = Duration::from_millis(probe.timeout_ms);
    if sleep + Duration::from_millis(500) > budget || sleep * 2 > timeout {
        return Case::skipped("keepalive", format!("the consumer's ack wait ({ack_wait:?}) is too long for the probe's timeout or --timeout"));
    }
    let mut case = Case::new("keepalive");
    let ms = u64::try_from(sleep.as_millis()).unwrap_or(u64::MAX);
    let job = job(
        probe,
        "keepalive",
        json!({"behave": "sleep", "sleep_ms": ms}),
        timeout,
    );
    let Some(watch) = send(probe, &mut case, &job, timeout).await else {
        return case;
    };
    if watch.replies().any(|(_, delivered, _)| delivered > 1) {
        case.fail("redelivered_during_call", format!("the job was delivered again while its call ran: no keep-alive within the ack wait ({ack_wait:?})"));
    }
    let mut marks = vec![Duration::ZERO];
    marks.extend(
        watch
            .replies()
            .filter(|(_, d, r)| *d == 1 && matches!(r, Reply::Progress | Reply::Ack))
            .map(|(after, _, _)| after),
    );
    let progress = watch
        .replies()
        .filter(|(_, _, r)| **r == Reply::Progress)
        .count();
    if watch.started().next().is_none() {
        case.warn(
            "no_started_notice",
            format!("no started notice on the turn's progress subject during a {sleep:?} call (PROTOCOL §7.5)"),
        );
    }
    if progress == 0 {
        case.fail(
            "no_keepalive",
            format!("no +WPI during a {sleep:?} call with ack wait {ack_wait:?} (PROTOCOL §7.6)"),
        );
    }
    let gaps: Vec<Duration> = marks
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]))
        .collect();
    if let Some(longest) = gaps.iter().max().filter(|g| **g >= ack_wait) {
        case.fail(
            "keepalive_late",
            format!("{longest:?} without a sign of life, the ack wait is {ack_wait:?}"),
        );
    }
    if gaps
        .iter()
        .take(gaps.len().saturating_sub(1))
        .any(|g| *g < KEEPALIVE_FLOOR)
        && progress > 1
    {
        case.warn(
            "keepalive_too_often",
            "+WPI more often than every 50 ms (PROTOCOL §7.6)",
        );
    }
    if let Some(result) = result(&mut case, &watch, &job, probe) {
        done_on(
            &mut case,
            &result,
            1,
            "keepalive_outcome",
            "the call answers on its first delivery",
        );
    }
    case
}

/// `panic`: a crash of the handler is `tool_panicked`, not retried, acked (§4.1, §7.7).
async fn panic(probe: &Probe, timeout: Duration) -> Case {
    let mut case = Case::new("panic");
    let job = job(probe, "panic", json!({"behave": "panic"}), timeout);
    let Some(watch) = send(probe, &mut case, &job, timeout).await else {
        return case;
    };
    if let Some(result) = result(&mut case, &watch, &job, probe) {
        let code = result
            .error
            .as_ref()
            .map(|e| (e.code.as_str(), e.retryable));
        match code {
            Some((codes::TOOL_PANICKED, false)) if result.state == CallState::Error => {}
            Some((codes::TOOL_PANICKED, true)) => case.fail("panic_retryable", "tool_panicked is not retryable (PROTOCOL §4.1)"),
            other => case.fail("panic_code", format!("a crash of the handler ended {:?} with {other:?}, not error tool_panicked (PROTOCOL §4.1, §7.7)", result.state)),
        }
    }
    if naked(&watch) {
        case.fail(
            "panic_retried",
            "a crashed call was NAKed for another attempt",
        );
    }
    case
}

/// `shutdown`: on SIGTERM during a call the worker finishes the call (publishes, acks),
/// withdraws its liveness entry, announces the change and exits (§7.9).
async fn shutdown(probe: &Probe, timeout: Duration, pid: i32) -> Case {
    let mut case = Case::new("shutdown");
    let sleep = Duration::from_millis(1000.min(probe.timeout_ms / 2));
    let ms = u64::try_from(sleep.as_millis()).unwrap_or(u64::MAX);
    let job = job(
        probe,
        "shutdown",
        json!({"behave": "sleep", "sleep_ms": ms}),
        timeout,
    );
    let changed = probe.nats.subscribe(probe.names.registry_changed()).await;
    let body = serde_json::to_vec(&job).unwrap_or_default();
    let Some(mut watch) = publish(probe, &mut case, &job, body).await else {
        return case;
    };
    let running = watch
        .until(timeout, |s| {
            matches!(s, Seen::Started { .. } | Seen::Reply { .. })
        })
        .await;
    if !running {
        case.fail("not_started", "the call never started");
        return case;
    }
    if let Err(error) = terminate(pid) {
        case.fail("signal_failed", format!("SIGTERM to {pid}: {error}"));
        return case;
    }
    if !watch.until_done(timeout).await {
        case.fail(
            "not_drained",
            "the call running at SIGTERM was neither finished nor acked (PROTOCOL §7.9)",
        );
    }
    if naked(&watch) {
        case.fail("not_drained", "the call running at SIGTERM was handed back instead of finished (PROTOCOL §7.9 step 2)");
    }
    let worker = result(&mut case, &watch, &job, probe).and_then(|r| r.worker_id);
    if let Some(worker) = worker {
        if !withdrawn(probe, &worker, timeout).await {
            case.fail(
                "not_withdrawn",
                format!(
                    "{worker} is still in {} (PROTOCOL §7.9 step 3)",
                    probe.names.tool_workers_key(&probe.tool)
                ),
            );
        }
    }
    if let Ok(mut changed) = changed {
        use futures::StreamExt;
        if tokio::time::timeout(timeout, changed.next()).await.is_err() {
            case.warn("no_registry_changed", "no message on the registry-changed subject after withdrawing (PROTOCOL §7.9 step 4)");
        }
    }
    if !exited(pid, timeout).await {
        case.fail(
            "did_not_exit",
            format!("process {pid} still runs {timeout:?} after SIGTERM"),
        );
    }
    case
}

fn terminate(pid: i32) -> nix::Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
}

/// Whether `worker`'s liveness entry is gone within `timeout`.
async fn withdrawn(probe: &Probe, worker: &str, timeout: Duration) -> bool {
    let key = probe.names.tool_workers_key(&probe.tool);
    let end = tokio::time::Instant::now() + timeout;
    let mut redis = probe.redis.clone();
    while tokio::time::Instant::now() < end {
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(&key)
            .arg(worker)
            .query_async(&mut redis)
            .await
            .unwrap_or(Some(0.0));
        if score.is_none() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Whether process `pid` is gone (or a zombie) within `timeout`.
async fn exited(pid: i32, timeout: Duration) -> bool {
    let end = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < end {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next());
        if matches!(state, None | Some("Z" | "X")) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
