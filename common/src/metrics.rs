//! The fleet's metrics, as OpenTelemetry instruments on the global meter provider
//! (exported over OTLP and rendered for Prometheus by [`crate::telemetry`]). Create
//! [`FleetMetrics`] after telemetry is initialized; before, instruments are no-ops.
//!
//! Owns every metric name, unit, description and bucket boundary. Never takes a label
//! value that can grow without bound (tool names come from the registry, codes are
//! stable); callers map unknown tools to one label.

use opentelemetry::metrics::{Counter, Histogram, UpDownCounter};
use opentelemetry::KeyValue;

/// Metric names.
pub mod names {
    /// Calls ended, by `gen_ai.tool.name` and `outcome` (the call's final state).
    pub const CALLS: &str = "toolfleet.calls";
    /// Tool execution time in seconds, by tool and outcome (worker side).
    pub const CALL_DURATION: &str = "toolfleet.call.duration";
    /// Time from dispatch to execution start in seconds, by tool (worker side).
    pub const CALL_QUEUE_WAIT: &str = "toolfleet.call.queue_wait";
    /// Failed calls by `error.type` (the error code) and tool.
    pub const ERRORS: &str = "toolfleet.errors";
    /// Calls per turn.
    pub const TURN_CALLS: &str = "toolfleet.turn.calls";
    /// Turn latency in seconds, from intake to `final`, by how the turn ended.
    pub const TURN_DURATION: &str = "toolfleet.turn.duration";
    /// Results that arrived after their turn ended.
    pub const LATE_RESULTS: &str = "toolfleet.results.late";
    /// Results ignored because their call already had one.
    pub const DUPLICATE_RESULTS: &str = "toolfleet.results.duplicate";
    /// Calls executing on a worker right now, by tool.
    pub const JOBS_IN_FLIGHT: &str = "toolfleet.jobs.in_flight";
}

/// Every instrument the fleet records.
#[derive(Clone)]
pub struct FleetMetrics {
    calls: Counter<u64>,
    call_duration: Histogram<f64>,
    queue_wait: Histogram<f64>,
    errors: Counter<u64>,
    turn_calls: Histogram<u64>,
    turn_duration: Histogram<f64>,
    late: Counter<u64>,
    duplicates: Counter<u64>,
    in_flight: UpDownCounter<i64>,
}

impl std::fmt::Debug for FleetMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetMetrics")
    }
}

const LATENCY_BOUNDS: [f64; 16] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl FleetMetrics {
    /// Instruments on the global meter provider.
    pub fn new() -> Self {
        let meter = opentelemetry::global::meter("toolfleet");
        let counter = |name: &'static str, description: &'static str| {
            meter
                .u64_counter(name)
                .with_description(description)
                .build()
        };
        let seconds = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(LATENCY_BOUNDS.to_vec())
                .build()
        };
        Self {
            calls: counter(names::CALLS, "Calls ended, by tool and outcome"),
            call_duration: seconds(names::CALL_DURATION, "Tool execution time"),
            queue_wait: seconds(
                names::CALL_QUEUE_WAIT,
                "Time a job waited between dispatch and execution",
            ),
            errors: counter(names::ERRORS, "Failed calls by error code"),
            turn_calls: meter
                .u64_histogram(names::TURN_CALLS)
                .with_description("Calls per turn")
                .with_boundaries(vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0])
                .build(),
            turn_duration: seconds(names::TURN_DURATION, "Turn latency from intake to final"),
            late: counter(names::LATE_RESULTS, "Results after their turn ended"),
            duplicates: counter(names::DUPLICATE_RESULTS, "Results ignored as duplicates"),
            in_flight: meter
                .i64_up_down_counter(names::JOBS_IN_FLIGHT)
                .with_description("Calls executing on this worker")
                .build(),
        }
    }

    /// A call ended with `result`, counted under the `tool` label (its outcome is the
    /// result's state: `done`, `error`, `timeout`, `skipped`).
    pub fn call_result(&self, tool: &str, result: &crate::CallResult) {
        let error_code = result.error.as_ref().map(|e| e.code.as_str());
        self.call_ended(tool, result.state.as_str(), error_code);
    }

    /// A call ended in `outcome` (`done`, `error`, `timeout`, `skipped`).
    pub fn call_ended(&self, tool: &str, outcome: &str, error_code: Option<&str>) {
        self.calls.add(
            1,
            &[
                KeyValue::new("gen_ai.tool.name", tool.to_string()),
                KeyValue::new("outcome", outcome.to_string()),
            ],
        );
        if let Some(code) = error_code {
            self.errors.add(
                1,
                &[
                    KeyValue::new("error.type", code.to_string()),
                    KeyValue::new("gen_ai.tool.name", tool.to_string()),
                ],
            );
        }
    }

    /// A worker finished executing a call.
    pub fn call_executed(&self, tool: &str, outcome: &str, seconds: f64) {
        self.call_duration.record(
            seconds,
            &[
                KeyValue::new("gen_ai.tool.name", tool.to_string()),
                KeyValue::new("outcome", outcome.to_string()),
            ],
        );
    }

    /// A job waited `seconds` between dispatch and execution.
    pub fn queue_waited(&self, tool: &str, seconds: f64) {
        self.queue_wait.record(
            seconds,
            &[KeyValue::new("gen_ai.tool.name", tool.to_string())],
        );
    }

    /// A turn was taken with `calls` calls.
    pub fn turn_started(&self, calls: usize) {
        self.turn_calls
            .record(u64::try_from(calls).unwrap_or(u64::MAX), &[]);
    }

    /// A turn ended after `seconds`, `complete` or at its `deadline`.
    pub fn turn_ended(&self, how: &'static str, seconds: f64) {
        self.turn_duration
            .record(seconds, &[KeyValue::new("outcome", how)]);
    }

    /// A result arrived after its turn ended.
    pub fn late_result(&self) {
        self.late.add(1, &[]);
    }

    /// A result was ignored as a duplicate.
    pub fn duplicate_result(&self) {
        self.duplicates.add(1, &[]);
    }

    /// A call started (`+1`) or stopped (`-1`) executing on this worker.
    pub fn in_flight(&self, tool: &str, delta: i64) {
        self.in_flight.add(
            delta,
            &[KeyValue::new("gen_ai.tool.name", tool.to_string())],
        );
    }
}

impl Default for FleetMetrics {
    fn default() -> Self {
        Self::new()
    }
}
