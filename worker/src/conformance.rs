//! The conformance probe (PROTOCOL §7.11): the tool `toolfleet conformance` drives to
//! check a worker, which every worker SDK ships. A tool crate serves it beside its own
//! tools (`conformance::probe_tool(conformance::CONFORMANCE_TOOL)`) to check its binary
//! with `toolfleet conformance --tool conformance.probe --pid PID`. Owns the probe's
//! behaviour only; serving is the runner's.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::{Tool, ToolContext, ToolError, ToolOutput};

/// The conformance probe's default name.
pub const CONFORMANCE_TOOL: &str = "conformance.probe";

/// What the conformance probe is asked to do (PROTOCOL §7.11).
#[derive(Debug, Clone, Copy, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Probe {
    /// Answer at once with the value.
    #[default]
    Echo,
    /// Fail with the retryable error `conformance_retry` until the delivery attempt
    /// reaches `succeed_on_attempt`, then answer.
    FailRetryable,
    /// Sleep `sleep_ms`, then answer.
    Sleep,
    /// Crash (panic).
    Panic,
}

/// Arguments of the conformance probe.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProbeArgs {
    /// What to do.
    #[serde(default)]
    pub behave: Probe,
    /// Echoed back as `value`.
    #[serde(default)]
    pub value: Option<Value>,
    /// Milliseconds to sleep (`sleep`).
    #[serde(default)]
    pub sleep_ms: u64,
    /// The first attempt that answers (`fail_retryable`; default 2).
    #[serde(default)]
    pub succeed_on_attempt: Option<u32>,
}

async fn probe(ctx: ToolContext, args: ProbeArgs) -> Result<ToolOutput, ToolError> {
    match args.behave {
        Probe::Echo => {}
        Probe::Sleep => tokio::time::sleep(Duration::from_millis(args.sleep_ms)).await,
        Probe::Panic => panic!("conformance probe asked to panic"),
        Probe::FailRetryable => {
            if ctx.attempt < args.succeed_on_attempt.unwrap_or(2) {
                let message = format!("attempt {} fails on request", ctx.attempt);
                return Err(ToolError::retryable("conformance_retry", message));
            }
        }
    }
    let value = json!({"value": args.value, "attempt": ctx.attempt, "tenant_id": ctx.tenant_id});
    Ok(ToolOutput::new(value).with_summary("The probe answered."))
}

/// The conformance probe under `name`: idempotent with 3 deliveries, a 10 s timeout
/// (PROTOCOL §7.11 gives the same definition for every language).
pub fn probe_tool(name: &str) -> Tool {
    Tool::builder(name, "Echoes, fails retryably, sleeps or panics on request")
        .waiting_hint("running the conformance probe")
        .timeout(Duration::from_secs(10))
        .idempotent(3)
        .handler(probe)
}
