//! The test pack (`test`): tools that sleep, fail or panic on request, for tests, fault
//! drills and benchmarks; and the `conformance` pack: the probe tool that
//! `toolfleet conformance` drives (PROTOCOL §7.11), which every worker SDK ships.
//!
//! Owns `test.behave`, `test.behave_once`, `test.noop` and `conformance.probe`. It must
//! never touch anything outside the call: no network, no files; its only shared state
//! is the record of calls that saw their turn cancelled ([`saw_cancellation`]), which
//! tests running the worker in their own process read.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use toolfleet_worker::tool::{Tool, ToolContext, ToolError, ToolOutput};

/// What `test.behave` should do.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BehaveArgs {
    /// Milliseconds to sleep before answering.
    #[serde(default)]
    pub sleep_ms: u64,
    /// Fail with this error code instead of answering.
    #[serde(default)]
    pub fail: Option<String>,
    /// Whether the failure is retryable.
    #[serde(default)]
    pub retryable: bool,
    /// Panic instead of answering.
    #[serde(default)]
    pub panic: bool,
    /// Value echoed back in the result.
    #[serde(default)]
    pub value: Option<Value>,
}

/// Arguments of `test.noop`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct NoopArgs {}

/// The last stretch of a sleep, left to a blocking thread's timer.
const FINE_SLEEP: Duration = Duration::from_millis(2);

/// Sleeps for `duration`, accurate to a fraction of a millisecond. The runtime's timer
/// has millisecond ticks and typically wakes 1-2 ms late, which would blur benchmark
/// figures; the last couple of milliseconds are slept on a blocking thread instead.
async fn sleep_precisely(duration: Duration) {
    let until = std::time::Instant::now() + duration;
    if duration > FINE_SLEEP {
        tokio::time::sleep(duration - FINE_SLEEP).await;
    }
    if until > std::time::Instant::now() {
        // The rest is measured on the blocking thread, so the hand-off to it is slept
        // through, not added.
        let _ = tokio::task::spawn_blocking(move || {
            precise_timers();
            std::thread::sleep(until.saturating_duration_since(std::time::Instant::now()));
        })
        .await;
    }
}

/// Lets this thread's sleeps end when they are due: Linux otherwise lets a sleeping
/// thread's timer fire up to 50 µs late (the default timer slack), to batch wake-ups.
fn precise_timers() {
    #[cfg(target_os = "linux")]
    let _ = nix::sys::prctl::set_timerslack(1);
}

/// Calls (`turn/call`) whose sleep the turn's cancellation cut short.
static CANCELLED_CALLS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Whether call `call_id` of turn `turn_id` stopped its sleep because the turn was
/// cancelled (in this process).
pub fn saw_cancellation(turn_id: &str, call_id: &str) -> bool {
    CANCELLED_CALLS
        .lock()
        .map(|calls| calls.contains(&format!("{turn_id}/{call_id}")))
        .unwrap_or(false)
}

async fn behave(ctx: ToolContext, args: BehaveArgs) -> Result<ToolOutput, ToolError> {
    if args.sleep_ms > 0 {
        tokio::select! {
            () = sleep_precisely(Duration::from_millis(args.sleep_ms)) => {}
            () = ctx.cancellation.cancelled() => {
                if let Ok(mut calls) = CANCELLED_CALLS.lock() {
                    calls.insert(format!("{}/{}", ctx.turn_id, ctx.call_id));
                }
                return Err(ToolError::fatal("cancelled", "the turn was cancelled"));
            }
        }
    }
    if args.panic {
        panic!("test.behave was asked to panic");
    }
    if let Some(code) = args.fail {
        let message = format!("test.behave was asked to fail with {code}");
        return Err(if args.retryable {
            ToolError::retryable(code, message)
        } else {
            ToolError::fatal(code, message)
        });
    }
    Ok(ToolOutput::new(json!({
        "slept_ms": args.sleep_ms,
        "value": args.value,
        "attempt": ctx.attempt,
        "tenant_id": ctx.tenant_id,
    })))
}

/// The conformance probe lives in the SDK, so every worker can serve it.
pub use toolfleet_worker::conformance::{Probe, ProbeArgs, CONFORMANCE_TOOL};

/// The conformance probe under `name` (the SDK's [`toolfleet_worker::conformance`]).
pub fn conformance_tool(name: &str) -> Tool {
    toolfleet_worker::conformance::probe_tool(name)
}

/// `test.behave` (idempotent), `test.behave_once` (not idempotent) and `test.noop`.
pub fn tools() -> Vec<Tool> {
    vec![
        Tool::builder(
            "test.behave",
            "Sleeps, fails or panics on request; idempotent",
        )
        .waiting_hint("running the test tool")
        .timeout(Duration::from_secs(30))
        .idempotent(3)
        .handler(behave),
        Tool::builder(
            "test.behave_once",
            "Sleeps, fails or panics on request; never run twice",
        )
        .waiting_hint("running the one-shot test tool")
        .timeout(Duration::from_secs(30))
        .handler(behave),
        Tool::builder("test.noop", "Answers at once")
            .idempotent(3)
            .handler(|_ctx: ToolContext, _args: NoopArgs| async move {
                Ok::<_, ToolError>(ToolOutput::new(json!({"ok": true})))
            }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sleeps_are_precise() {
        for ms in [1u64, 5, 20] {
            let start = std::time::Instant::now();
            sleep_precisely(Duration::from_millis(ms)).await;
            let slept = start.elapsed();
            assert!(slept >= Duration::from_millis(ms), "{ms} ms: {slept:?}");
            assert!(
                slept < Duration::from_millis(ms) + Duration::from_millis(50),
                "{ms} ms: {slept:?}"
            );
        }
    }
}
