//! The fleet's metrics, as OpenTelemetry instruments on the global meter provider
//! (exported over OTLP and rendered for Prometheus by [`crate::telemetry`]). Create
//! [`FleetMetrics`] after telemetry is initialized; before, instruments are no-ops.
//!
//! Owns every metric name, unit, description and bucket boundary. Never takes a label
//! value that can grow without bound (tool names come from the registry, codes are
//! stable); callers map unknown tools to one label.

use opentelemetry::metrics::{Counter, Gauge, Histogram};
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
    /// Jobs skipped, or results dropped, because their caller cancelled the turn, by
    /// tool.
    pub const JOBS_CANCELLED: &str = "toolfleet.jobs.cancelled";
    /// Seconds from a cancel request to the cancelled turn's `final` being sent.
    pub const TURN_CANCEL_DURATION: &str = "toolfleet.turn.cancel.duration";
    /// Results that arrived after their turn ended.
    pub const LATE_RESULTS: &str = "toolfleet.results.late";
    /// Results ignored because their call already had one.
    pub const DUPLICATE_RESULTS: &str = "toolfleet.results.duplicate";
    /// Calls executing on a worker right now, by tool.
    pub const JOBS_IN_FLIGHT: &str = "toolfleet.jobs.in_flight";
    /// Jobs a worker handed back for another attempt after a retryable error, by tool.
    pub const JOB_RETRIES: &str = "toolfleet.jobs.retries";
    /// Jobs delivered more than once (attempt > 1), by tool.
    pub const JOB_REDELIVERIES: &str = "toolfleet.jobs.redeliveries";
    /// Redelivered calls of non-idempotent tools reported `call_interrupted`, by tool.
    pub const JOB_INTERRUPTIONS: &str = "toolfleet.jobs.interrupted";
    /// Jobs dropped unrun because their turn's deadline had passed, by tool.
    pub const JOB_DEADLINE_DROPS: &str = "toolfleet.jobs.deadline_dropped";
    /// In-flight jobs handed back (NAK) when a worker's shutdown grace ran out, by tool.
    pub const JOB_HANDED_BACK: &str = "toolfleet.jobs.handed_back";
    /// Jobs waiting in a tool's consumer, not yet delivered, by tool.
    pub const QUEUE_PENDING: &str = "toolfleet.queue.pending";
    /// Jobs delivered to a worker and not yet acked, by tool.
    pub const QUEUE_ACK_PENDING: &str = "toolfleet.queue.ack_pending";
    /// Age in seconds of the oldest job not yet acked, by tool.
    pub const QUEUE_OLDEST_AGE: &str = "toolfleet.queue.oldest_age";
    /// Calls of one tool a worker runs at once, by tool.
    pub const WORKER_CAPACITY: &str = "toolfleet.worker.capacity";
    /// Turns this coordinator owns right now.
    pub const TURNS_IN_FLIGHT: &str = "toolfleet.turns.in_flight";
    /// Ended turns deleted before their retention ran out, by `reason` (`redis_memory`).
    pub const TURNS_TRIMMED: &str = "toolfleet.turns.trimmed";
    /// Gauge: Redis's `used_memory` as a coordinator last sampled it, in bytes.
    pub const REDIS_MEMORY_USED: &str = "toolfleet.redis.memory.used";
    /// Gauge: Redis's `maxmemory` as a coordinator last sampled it, in bytes (0: none).
    pub const REDIS_MEMORY_MAX: &str = "toolfleet.redis.memory.max";
    /// Gauge: calls waiting in the tools' lanes for a slot, by `tenant` (a tenant named
    /// in the tenants file, else `_other`), summed over the tools.
    pub const TENANT_CALLS_WAITING: &str = "toolfleet.tenant.calls.waiting";
    /// Gauge: calls published and not yet answered, by `tenant`, summed over the tools.
    pub const TENANT_CALLS_IN_FLIGHT: &str = "toolfleet.tenant.calls.in_flight";
    /// Seconds a call waited in its tool's lane before its job was published, by
    /// `tenant` (0 for a call that found a free slot).
    pub const TENANT_CALL_WAIT: &str = "toolfleet.tenant.call.wait";
    /// Turns refused with `overloaded` by the tenant's own limits, by `tenant` and
    /// `reason` (`turns_in_flight`, `backlog`).
    pub const TENANT_TURNS_REFUSED: &str = "toolfleet.tenant.turns.refused";
    /// Turns refused whole, by `code` (`invalid_decision`, `duplicate_turn`, ...).
    pub const TURNS_REFUSED: &str = "toolfleet.turns.refused";
    /// Results refused because their tool is not their call's (forged), by `code`.
    pub const RESULTS_REFUSED: &str = "toolfleet.results.refused";
    /// NATS connection events, by `event` (`connected`, `disconnected`, `error`, ...).
    pub const NATS_EVENTS: &str = "toolfleet.nats.events";
    /// Failed Redis operations, by `operation`.
    pub const REDIS_ERRORS: &str = "toolfleet.redis.errors";
    /// JetStream streams and consumers recreated after they disappeared, by `kind`.
    pub const TOPOLOGY_RECREATED: &str = "toolfleet.topology.recreated";
    /// Supervised background tasks that died, by `task`.
    pub const TASKS_DIED: &str = "toolfleet.tasks.died";
    /// Chat completions the gateway answered, by `outcome` (`answered`, `caller_tools`,
    /// `max_rounds`, `upstream_error`).
    pub const CHAT_COMPLETIONS: &str = "toolfleet.chat.completions";
    /// Rounds of fleet calls the chat loop ran, one per fleet turn.
    pub const CHAT_ROUNDS: &str = "toolfleet.chat.rounds";
    /// Fleet calls the chat loop ran.
    pub const CHAT_FLEET_CALLS: &str = "toolfleet.chat.fleet_calls";
    /// Seconds of one upstream model request, by `gen_ai.operation.name`,
    /// `gen_ai.request.model` and `error.type` (the GenAI semantic conventions' client
    /// metric).
    pub const GEN_AI_OPERATION_DURATION: &str = "gen_ai.client.operation.duration";
    /// Tokens the upstream reported, by `gen_ai.token.type` (`input`, `output`) and
    /// `gen_ai.request.model`.
    pub const GEN_AI_TOKEN_USAGE: &str = "gen_ai.client.token.usage";
    /// Results in the results stream not yet recorded by a coordinator (pending and
    /// delivered-not-acked on the shared results consumer, summed over the partitions).
    pub const RESULTS_PENDING: &str = "toolfleet.results.pending";
    /// Time one Redis command, pipeline or script took, from send to reply (or failure).
    pub const REDIS_DURATION: &str = "toolfleet.redis.duration";
    /// Gateway HTTP requests: duration from request to response head, by
    /// `http.request.method`, `http.route` and `http.response.status_code` (OpenTelemetry's
    /// HTTP server semantic conventions; its count is the requests).
    pub const HTTP_SERVER_DURATION: &str = "http.server.request.duration";
    /// Always 1, with the build's `version` and the `service`.
    pub const BUILD_INFO: &str = "toolfleet.build_info";
    /// CPU time used by the process, in seconds.
    pub const PROCESS_CPU: &str = "process.cpu.time";
    /// Resident memory of the process, in bytes.
    pub const PROCESS_MEMORY: &str = "process.memory.usage";
    /// Open file descriptors of the process.
    pub const PROCESS_FDS: &str = "process.open_fds";
}

/// The `error.type` label of `code`: a code toolfleet itself uses, else `other`, so a
/// tool's free-form codes cannot grow the number of series.
pub fn error_type(code: &str) -> &'static str {
    crate::call::codes::ALL
        .into_iter()
        .find(|k| *k == code)
        .unwrap_or("other")
}

/// The tool label.
const TOOL: &str = "gen_ai.tool.name";

/// The `code` labels of `toolfleet.turns.refused` other than `other`.
const TURN_REFUSAL_CODES: [&str; 10] = {
    use crate::turn::turn_codes as t;
    [
        t::INVALID_REQUEST,
        t::INVALID_DECISION,
        t::DECISION_TOO_LARGE,
        t::DUPLICATE_TURN,
        t::TURN_ID_CONFLICT,
        t::UNAVAILABLE,
        t::TENANT_NOT_ALLOWED,
        t::REPLY_NOT_ALLOWED,
        t::CONTEXT_TOO_LARGE,
        t::OVERLOADED,
    ]
};

/// The Redis operations whose failures a coordinator counts (`toolfleet.redis.errors`);
/// a new `redis_error` call site of the coordinator adds its operation here, so its
/// series exists at 0 before its first failure.
pub const COORDINATOR_REDIS_OPERATIONS: [&str; 17] = [
    "create_turn",
    "trim_ended",
    "store_final",
    "emit",
    "cancel",
    "registry_refresh",
    "attach",
    "lane_admit",
    "lane_forget",
    "lane_release",
    "tenant_turns",
    "record_result",
    "reject_result",
    "deadline_sweep",
    "end_turn",
    "mark_sent",
    "read_stored",
];

/// The `error.type` labels of `toolfleet.errors` an alert rule reads per tool
/// (deploy/prometheus/alerts.yml: ToolfleetNoLiveWorker): each tool's series start at 0
/// when a coordinator learns the tool ([`FleetMetrics::tool_known`]), so a lone refusal
/// of a quiet tool is an increase `rate()` sees.
pub const TOOL_ALERT_ERROR_TYPES: [&str; 1] = [crate::call::codes::NO_LIVE_WORKER];

/// The `outcome` labels of `toolfleet.calls` that ToolfleetToolErrorRatioHigh reads,
/// beside `done`: each tool's series start at 0 when a coordinator learns the tool.
pub const TOOL_CALL_OUTCOMES: [&str; 3] = ["done", "error", "timeout"];

/// The per-tool job counters of a worker, each tool's series at 0 from the moment the
/// worker serves it ([`FleetMetrics::tool_served`]): hand-backs at shutdown and
/// redeliveries are rare, and a counter born at its first value shows no increase.
pub const WORKER_TOOL_COUNTERS: [&str; 6] = [
    names::JOB_RETRIES,
    names::JOB_REDELIVERIES,
    names::JOB_INTERRUPTIONS,
    names::JOB_DEADLINE_DROPS,
    names::JOBS_CANCELLED,
    names::JOB_HANDED_BACK,
];

/// The Redis operations whose failures a worker counts.
pub const WORKER_REDIS_OPERATIONS: [&str; 2] = ["heartbeat", "read_refusals"];

/// Process metrics read from `/proc/self` whenever metrics are collected.
mod process {
    use opentelemetry::metrics::AsyncInstrument;

    /// Registers the observable CPU, memory and open-fd instruments.
    pub(super) fn register() {
        let meter = opentelemetry::global::meter("toolfleet");
        let _cpu = meter
            .f64_observable_counter(super::names::PROCESS_CPU)
            .with_unit("s")
            .with_description("CPU time used by the process")
            .with_callback(|o| observe(o, cpu_seconds()))
            .build();
        let _memory = gauge(
            &meter,
            super::names::PROCESS_MEMORY,
            Some("By"),
            "Resident memory of the process",
            resident_bytes,
        );
        let _fds = gauge(
            &meter,
            super::names::PROCESS_FDS,
            None,
            "Open file descriptors of the process",
            open_fds,
        );
    }

    /// An observable gauge `name` (in `unit`, when it has one) whose value is `read`
    /// whenever metrics are collected; no sample when `read` finds none.
    fn gauge(
        meter: &opentelemetry::metrics::Meter,
        name: &'static str,
        unit: Option<&'static str>,
        description: &'static str,
        read: fn() -> Option<u64>,
    ) -> opentelemetry::metrics::ObservableGauge<u64> {
        let gauge = meter
            .u64_observable_gauge(name)
            .with_description(description)
            .with_callback(move |o| observe(o, read()));
        match unit {
            Some(unit) => gauge.with_unit(unit),
            None => gauge,
        }
        .build()
    }

    fn observe<T>(o: &dyn AsyncInstrument<T>, value: Option<T>) {
        if let Some(v) = value {
            o.observe(v, &[]);
        }
    }

    /// User + system time from `/proc/self/stat` (fields 14 and 15, in clock ticks of
    /// 1/100 s on Linux).
    fn cpu_seconds() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after_name = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some(ticks as f64 / 100.0)
    }

    fn resident_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    fn open_fds() -> Option<u64> {
        Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
    }
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
    cancel_duration: Histogram<f64>,
    late: Counter<u64>,
    duplicates: Counter<u64>,
    tenant_wait: Histogram<f64>,
    tenant_refused: Counter<u64>,
    /// The turns refused lately, so a turn sent again is counted once.
    refused: std::sync::Arc<std::sync::Mutex<RecentTurns>>,
    counters: Vec<(&'static str, Counter<u64>)>,
    gauges: Vec<(&'static str, Gauge<i64>)>,
}

impl std::fmt::Debug for FleetMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetMetrics")
    }
}

/// Latency buckets, up to the longest deadline a turn may have (300 s).
const LATENCY_BOUNDS: [f64; 18] = [
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    180.0, 300.0,
];

/// Queue-wait buckets: measured from millisecond wall clocks of two hosts, so nothing
/// below 5 ms.
const QUEUE_WAIT_BOUNDS: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Counters with one label, created in [`FleetMetrics::new`]: name, description.
const LABELLED_COUNTERS: [(&str, &str); 13] = [
    (
        names::JOBS_CANCELLED,
        "Jobs skipped, or results dropped, because their turn was cancelled",
    ),
    (
        names::JOB_RETRIES,
        "Jobs handed back after a retryable error",
    ),
    (names::JOB_REDELIVERIES, "Jobs delivered more than once"),
    (
        names::JOB_INTERRUPTIONS,
        "Redelivered non-idempotent calls reported interrupted",
    ),
    (
        names::JOB_DEADLINE_DROPS,
        "Jobs dropped unrun past their turn's deadline",
    ),
    (
        names::JOB_HANDED_BACK,
        "In-flight jobs handed back when the shutdown grace ran out",
    ),
    (names::TURNS_REFUSED, "Turns refused whole, by code"),
    (
        names::RESULTS_REFUSED,
        "Results refused as not their call's tool, by code",
    ),
    (names::NATS_EVENTS, "NATS connection events"),
    (names::REDIS_ERRORS, "Failed Redis operations"),
    (
        names::TOPOLOGY_RECREATED,
        "JetStream streams and consumers recreated",
    ),
    (names::TASKS_DIED, "Supervised background tasks that died"),
    (
        names::TURNS_TRIMMED,
        "Ended turns deleted before their retention ran out, by reason",
    ),
];

/// Gauges, created in [`FleetMetrics::new`]: name, unit, description.
const GAUGES: [(&str, &str, &str); 8] = [
    (
        names::TENANT_CALLS_WAITING,
        "",
        "Calls waiting in the tools' lanes, by tenant",
    ),
    (
        names::TENANT_CALLS_IN_FLIGHT,
        "",
        "Calls published and not yet answered, by tenant",
    ),
    (
        names::RESULTS_PENDING,
        "",
        "Results not yet recorded by a coordinator",
    ),
    (
        names::WORKER_CAPACITY,
        "",
        "Calls of one tool this worker runs at once",
    ),
    (names::TURNS_IN_FLIGHT, "", "Turns this coordinator owns"),
    (
        names::REDIS_MEMORY_USED,
        "By",
        "Redis used_memory as a coordinator last sampled it",
    ),
    (
        names::REDIS_MEMORY_MAX,
        "By",
        "Redis maxmemory as a coordinator last sampled it (0: none)",
    ),
    (names::BUILD_INFO, "", "Build information"),
];

/// Defines, for each `method => COUNTER`, a public [`FleetMetrics`] method that counts
/// one event of a tool's job in `names::COUNTER` (one of [`LABELLED_COUNTERS`]),
/// labelled by the tool.
macro_rules! tool_job_counters {
    ($($(#[doc = $doc:literal])* $method:ident => $counter:ident;)*) => {
        impl FleetMetrics {
            $(
                $(#[doc = $doc])*
                pub fn $method(&self, tool: &str) {
                    self.count(names::$counter, TOOL, tool);
                }
            )*
        }
    };
}

tool_job_counters! {
    /// A worker handed `tool`'s job back for another attempt after a retryable error.
    job_retried => JOB_RETRIES;
    /// A job of `tool` arrived for the second time or later.
    job_redelivered => JOB_REDELIVERIES;
    /// A redelivered call of the non-idempotent `tool` was reported interrupted.
    job_interrupted => JOB_INTERRUPTIONS;
    /// A job of `tool` was dropped unrun: its turn's deadline had passed.
    job_deadline_dropped => JOB_DEADLINE_DROPS;
    /// A job of `tool` was skipped, or its result dropped, because its turn was
    /// cancelled.
    job_cancelled => JOBS_CANCELLED;
    /// An in-flight job of `tool` was handed back when the shutdown grace ran out.
    job_handed_back => JOB_HANDED_BACK;
}

/// A counter `name` of `meter`, described for the exporters.
fn counter_on(
    meter: &opentelemetry::metrics::Meter,
    name: &'static str,
    description: &'static str,
) -> Counter<u64> {
    meter
        .u64_counter(name)
        .with_description(description)
        .build()
}

impl FleetMetrics {
    /// Instruments on the global meter provider.
    pub fn new() -> Self {
        in_flight::register();
        queue::register();
        let meter = opentelemetry::global::meter("toolfleet");
        let counter = |name, description| counter_on(&meter, name, description);
        let seconds_in = |bounds: &[f64], name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(bounds.to_vec())
                .build()
        };
        let seconds = |name, description| seconds_in(&LATENCY_BOUNDS, name, description);
        Self {
            calls: counter(names::CALLS, "Calls ended, by tool and outcome"),
            call_duration: seconds(names::CALL_DURATION, "Tool execution time"),
            queue_wait: seconds_in(
                &QUEUE_WAIT_BOUNDS,
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
            cancel_duration: seconds(
                names::TURN_CANCEL_DURATION,
                "Time from a cancel request to the cancelled turn's final",
            ),
            late: counter(names::LATE_RESULTS, "Results after their turn ended"),
            duplicates: counter(names::DUPLICATE_RESULTS, "Results ignored as duplicates"),
            tenant_wait: seconds(
                names::TENANT_CALL_WAIT,
                "Time a call waited in its tool's lane for a slot",
            ),
            tenant_refused: counter(
                names::TENANT_TURNS_REFUSED,
                "Turns refused by the tenant's own limits",
            ),
            refused: Default::default(),
            counters: LABELLED_COUNTERS
                .iter()
                .map(|(name, description)| (*name, counter(name, description)))
                .collect(),
            gauges: GAUGES
                .iter()
                .map(|(name, unit, description)| {
                    let gauge = meter.i64_gauge(*name).with_description(*description);
                    let gauge = match unit.is_empty() {
                        true => gauge,
                        false => gauge.with_unit(*unit),
                    };
                    (*name, gauge.build())
                })
                .collect(),
        }
    }

    fn count(&self, name: &str, label: &'static str, value: &str) {
        self.add(name, label, value, 1);
    }

    /// Makes the series `name{label=value}` exist (at 0 until its first event), so the
    /// first event is an increase Prometheus sees: a counter born at its first value has
    /// no earlier sample, and `increase()` or `rate()` over it stays 0.
    fn start_at_zero(&self, name: &str, label: &'static str, value: &str) {
        self.add(name, label, value, 0);
    }

    fn add(&self, name: &str, label: &'static str, value: &str, n: u64) {
        if let Some((_, c)) = self.counters.iter().find(|(n, _)| *n == name) {
            c.add(n, &[KeyValue::new(label, value.to_string())]);
        }
    }

    fn gauge(&self, name: &str, value: i64, labels: &[KeyValue]) {
        if let Some((_, g)) = self.gauges.iter().find(|(n, _)| *n == name) {
            g.record(value, labels);
        }
    }

    /// A turn was refused whole with `code` (a `turn_codes` constant, else `other`).
    pub fn turn_refused(&self, code: &str) {
        let code = TURN_REFUSAL_CODES
            .into_iter()
            .find(|k| *k == code)
            .unwrap_or("other");
        self.count(names::TURNS_REFUSED, "code", code);
    }

    /// Turn `turn_id` was refused whole with `code`: counted as [`FleetMetrics::turn_refused`]
    /// the first time only, so a frontend sending the same turn again (a retryable
    /// refusal) does not count it again. Without a turn id, every refusal counts.
    pub fn turn_refused_once(&self, turn_id: Option<&str>, code: &str) {
        let first = match turn_id {
            Some(id) => self
                .refused
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(id),
            None => true,
        };
        if first {
            self.turn_refused(code);
        }
    }

    /// A result refused because its tool is not its call's (or its subject's).
    pub fn forged_result(&self) {
        self.count(names::RESULTS_REFUSED, "code", "wrong_tool");
    }

    /// A NATS connection event (`connected`, `disconnected`, `error`, ...).
    pub fn nats_event(&self, event: &'static str) {
        self.count(names::NATS_EVENTS, "event", event);
    }

    /// A Redis `operation` failed (one of [`COORDINATOR_REDIS_OPERATIONS`] or
    /// [`WORKER_REDIS_OPERATIONS`], whose series start at 0).
    pub fn redis_error(&self, operation: &'static str) {
        self.count(names::REDIS_ERRORS, "operation", operation);
    }

    /// A JetStream `kind` (`stream`, `consumer`) was recreated after it disappeared.
    pub fn topology_recreated(&self, kind: &'static str) {
        self.count(names::TOPOLOGY_RECREATED, "kind", kind);
    }

    /// The supervised background `task` died.
    pub fn task_died(&self, task: &str) {
        self.count(names::TASKS_DIED, "task", task);
    }

    /// The background `task` runs under supervision: its `toolfleet.tasks.died` series
    /// exists, at 0, from now on.
    pub fn task_supervised(&self, task: &str) {
        self.start_at_zero(names::TASKS_DIED, "task", task);
    }

    /// The NATS connection `events` (the labels [`FleetMetrics::nats_event`] counts) are
    /// observed: each series exists, at 0, from now on.
    pub fn nats_events_observed(&self, events: &[&'static str]) {
        for event in events {
            self.start_at_zero(names::NATS_EVENTS, "event", event);
        }
    }

    /// JetStream objects of `kind` are watched and recreated when they disappear: the
    /// kind's `toolfleet.topology.recreated` series exists, at 0, from now on.
    pub fn topology_watched(&self, kind: &'static str) {
        self.start_at_zero(names::TOPOLOGY_RECREATED, "kind", kind);
    }

    /// The coordinator learned `tool` (a registry refresh found it; call once per tool,
    /// not per turn): its [`TOOL_ALERT_ERROR_TYPES`] failures and
    /// [`TOOL_CALL_OUTCOMES`] calls exist, at 0, from now on.
    pub fn tool_known(&self, tool: &str) {
        for error_type in TOOL_ALERT_ERROR_TYPES {
            let labels = [
                KeyValue::new("error.type", error_type),
                KeyValue::new(TOOL, tool.to_string()),
            ];
            self.errors.add(0, &labels);
        }
        for outcome in TOOL_CALL_OUTCOMES {
            let labels = [
                KeyValue::new(TOOL, tool.to_string()),
                KeyValue::new("outcome", outcome),
            ];
            self.calls.add(0, &labels);
        }
    }

    /// This worker serves `tool`: its [`WORKER_TOOL_COUNTERS`] exist, at 0, from now on.
    pub fn tool_served(&self, tool: &str) {
        for counter in WORKER_TOOL_COUNTERS {
            self.start_at_zero(counter, TOOL, tool);
        }
    }

    /// Every tool's consumer as last sampled: jobs not yet delivered, delivered and not
    /// acked, and the age of the oldest not acked. Replaces the previous sample whole, so
    /// a tool that left the registry leaves the queue gauges with it.
    pub fn queue_lags(&self, lags: Vec<QueueLag>) {
        queue::set(lags);
    }

    /// Results in the results stream not yet recorded by a coordinator.
    pub fn results_pending(&self, results: u64) {
        let results = i64::try_from(results).unwrap_or(i64::MAX);
        self.gauge(names::RESULTS_PENDING, results, &[]);
    }

    /// This worker runs at most `slots` calls of `tool` at once.
    pub fn worker_capacity(&self, tool: &str, slots: usize) {
        let slots = i64::try_from(slots).unwrap_or(i64::MAX);
        self.gauge(
            names::WORKER_CAPACITY,
            slots,
            &[KeyValue::new(TOOL, tool.to_string())],
        );
    }

    /// `turns` ended turns were deleted to make room in Redis.
    pub fn turns_trimmed(&self, turns: usize) {
        let turns = u64::try_from(turns).unwrap_or(u64::MAX);
        self.add(names::TURNS_TRIMMED, "reason", "redis_memory", turns);
    }

    /// Redis holds `used` bytes of at most `max` (0: no limit).
    pub fn redis_memory(&self, used: u64, max: u64) {
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.gauge(names::REDIS_MEMORY_USED, clamp(used), &[]);
        self.gauge(names::REDIS_MEMORY_MAX, clamp(max), &[]);
    }

    /// This coordinator owns `turns` turns.
    pub fn turns_in_flight(&self, turns: usize) {
        let turns = i64::try_from(turns).unwrap_or(i64::MAX);
        self.gauge(names::TURNS_IN_FLIGHT, turns, &[]);
    }

    /// Records `toolfleet_build_info{service, version} 1`, registers the process
    /// metrics (CPU, memory, open fds, read from `/proc` at each collection), once per
    /// process, and starts at 0 the counters whose labels the `service`
    /// (`toolfleet-coordinator`, `toolfleet-worker`) knows from its start: refused turns
    /// and results, failed Redis operations, and the coordinator's consumer settings put
    /// back. An alert on `increase()` of one of them then fires on its first event.
    pub fn process_started(&self, service: &str) {
        match service {
            "toolfleet-coordinator" => {
                for code in TURN_REFUSAL_CODES.into_iter().chain(["other"]) {
                    self.start_at_zero(names::TURNS_REFUSED, "code", code);
                }
                self.start_at_zero(names::RESULTS_REFUSED, "code", "wrong_tool");
                for operation in COORDINATOR_REDIS_OPERATIONS {
                    self.start_at_zero(names::REDIS_ERRORS, "operation", operation);
                }
                self.topology_watched("consumer_settings");
                self.start_at_zero(names::TURNS_TRIMMED, "reason", "redis_memory");
            }
            "toolfleet-worker" => {
                for operation in WORKER_REDIS_OPERATIONS {
                    self.start_at_zero(names::REDIS_ERRORS, "operation", operation);
                }
            }
            _ => {}
        }
        self.gauge(
            names::BUILD_INFO,
            1,
            &[
                KeyValue::new("service", service.to_string()),
                KeyValue::new("version", env!("CARGO_PKG_VERSION")),
            ],
        );
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(crate::metrics::process::register);
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
                    KeyValue::new("error.type", error_type(code)),
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

    /// A cancel request ended a turn; `seconds` from the request to its `final`.
    pub fn turn_cancelled(&self, seconds: f64) {
        self.cancel_duration.record(seconds, &[]);
    }

    /// A result arrived after its turn ended.
    pub fn late_result(&self) {
        self.late.add(1, &[]);
    }

    /// A result was ignored as a duplicate.
    pub fn duplicate_result(&self) {
        self.duplicates.add(1, &[]);
    }

    /// A call of `tenant` (a bounded label: see [`names::TENANT_CALL_WAIT`]) waited
    /// `seconds` in its tool's lane before its job was published.
    pub fn lane_waited(&self, tenant: &str, seconds: f64) {
        self.tenant_wait
            .record(seconds, &[KeyValue::new("tenant", tenant.to_string())]);
    }

    /// `tenant`'s calls waiting in the lanes and in flight, summed over the tools.
    pub fn tenant_calls(&self, tenant: &str, waiting: u64, in_flight: u64) {
        let labels = [KeyValue::new("tenant", tenant.to_string())];
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.gauge(names::TENANT_CALLS_WAITING, clamp(waiting), &labels);
        self.gauge(names::TENANT_CALLS_IN_FLIGHT, clamp(in_flight), &labels);
    }

    /// A turn of `tenant` was refused by the tenant's own limit `reason`
    /// (`turns_in_flight`, `backlog`).
    pub fn tenant_refused(&self, tenant: &str, reason: &'static str) {
        self.tenant_refused.add(
            1,
            &[
                KeyValue::new("tenant", tenant.to_string()),
                KeyValue::new("reason", reason),
            ],
        );
    }

    /// A call started (`+1`) or stopped (`-1`) executing on this worker.
    pub fn in_flight(&self, tool: &str, delta: i64) {
        in_flight::add(tool, delta);
    }
}

/// One tool's queue as sampled from its consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueLag {
    /// The tool.
    pub tool: String,
    /// Jobs not yet delivered.
    pub pending: u64,
    /// Jobs delivered and not yet acked.
    pub ack_pending: u64,
    /// Age of the oldest job not yet acked, in seconds.
    pub oldest_age_s: i64,
}

/// The turn ids refused lately, oldest first, at most [`RecentTurns::KEPT`] of them.
#[derive(Debug, Default)]
struct RecentTurns {
    order: std::collections::VecDeque<String>,
    ids: std::collections::HashSet<String>,
}

impl RecentTurns {
    /// Enough for every turn a frontend may send again while its refusal lasts.
    const KEPT: usize = 16_384;

    /// Whether `id` is new (and now kept).
    fn insert(&mut self, id: &str) -> bool {
        if self.ids.contains(id) {
            return false;
        }
        if self.order.len() == Self::KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.ids.remove(&oldest);
            }
        }
        self.order.push_back(id.to_string());
        self.ids.insert(id.to_string());
        true
    }
}

/// The queue gauges (`toolfleet.queue.*`): the last sample of every tool's consumer,
/// reported by callbacks at each collection, so a tool missing from a sample has no
/// series from then on (a synchronous gauge would keep its last value forever).
mod queue {
    use std::sync::{Once, PoisonError, RwLock};

    use opentelemetry::KeyValue;

    use super::QueueLag;

    /// The last sample.
    static LAGS: RwLock<Vec<QueueLag>> = RwLock::new(Vec::new());

    /// Replaces the sample.
    pub(super) fn set(lags: Vec<QueueLag>) {
        *LAGS.write().unwrap_or_else(PoisonError::into_inner) = lags;
    }

    fn observe(
        observer: &dyn opentelemetry::metrics::AsyncInstrument<i64>,
        of: fn(&QueueLag) -> i64,
    ) {
        let lags = LAGS.read().unwrap_or_else(PoisonError::into_inner);
        for lag in lags.iter() {
            observer.observe(of(lag), &[KeyValue::new(super::TOOL, lag.tool.clone())]);
        }
    }

    fn clamp(v: u64) -> i64 {
        i64::try_from(v).unwrap_or(i64::MAX)
    }

    /// Registers the three gauges on the global meter provider, once per process.
    pub(super) fn register() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let meter = opentelemetry::global::meter("toolfleet");
            let _pending = meter
                .i64_observable_gauge(super::names::QUEUE_PENDING)
                .with_description("Jobs not yet delivered")
                .with_callback(|o| observe(o, |l| clamp(l.pending)))
                .build();
            let _ack_pending = meter
                .i64_observable_gauge(super::names::QUEUE_ACK_PENDING)
                .with_description("Jobs delivered and not yet acked")
                .with_callback(|o| observe(o, |l| clamp(l.ack_pending)))
                .build();
            let _oldest = meter
                .i64_observable_gauge(super::names::QUEUE_OLDEST_AGE)
                .with_unit("s")
                .with_description("Age of the oldest job not yet acked")
                .with_callback(|o| observe(o, |l| l.oldest_age_s))
                .build();
        });
    }
}

/// `toolfleet.redis.duration`, recorded by every Redis connection
/// (`redis_client::RedisConnection`) once a meter provider is installed.
pub fn redis_command_took(seconds: f64) {
    static DURATION: std::sync::OnceLock<Histogram<f64>> = std::sync::OnceLock::new();
    DURATION
        .get_or_init(|| {
            opentelemetry::global::meter("toolfleet")
                .f64_histogram(names::REDIS_DURATION)
                .with_unit("s")
                .with_description("Time a Redis command, pipeline or script took")
                .with_boundaries(REDIS_BOUNDS.to_vec())
                .build()
        })
        .record(seconds, &[]);
}

/// Redis command buckets: 50 µs to the 5 s response timeout.
const REDIS_BOUNDS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0,
];

/// `toolfleet.jobs.in_flight`: a count per tool in this process, moved by each call's
/// start and end without building an attribute set, and reported by a callback at each
/// collection (a non-monotonic sum, as an up-down counter is).
mod in_flight {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::{Arc, Once, PoisonError, RwLock};

    use opentelemetry::KeyValue;

    /// The count of every tool this process serves or has run.
    static COUNTS: RwLock<Option<HashMap<String, Arc<AtomicI64>>>> = RwLock::new(None);

    /// Moves `tool`'s count by `delta`, adding the tool at its first mention.
    pub(super) fn add(tool: &str, delta: i64) {
        // Only counts are kept under the lock, so one poisoned by a panic is still whole.
        let known = COUNTS
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|counts| counts.get(tool).cloned());
        if let Some(count) = known {
            count.fetch_add(delta, Ordering::Relaxed);
            return;
        }
        COUNTS
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(HashMap::new)
            .entry(tool.to_string())
            .or_default()
            .fetch_add(delta, Ordering::Relaxed);
    }

    /// Registers the instrument on the global meter provider, once per process: the
    /// provider installed then (the binaries install theirs before any `FleetMetrics`)
    /// reports it, as it does the process metrics.
    pub(super) fn register() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let _in_flight = opentelemetry::global::meter("toolfleet")
                .i64_observable_up_down_counter(super::names::JOBS_IN_FLIGHT)
                .with_description("Calls executing on this worker")
                .with_callback(|observer| {
                    let counts = COUNTS.read().unwrap_or_else(PoisonError::into_inner);
                    for (tool, count) in counts.iter().flatten() {
                        observer.observe(
                            count.load(Ordering::Relaxed),
                            &[KeyValue::new(super::TOOL, tool.clone())],
                        );
                    }
                })
                .build();
        });
    }
}

/// Model names kept as label values; later ones count as `other`.
const MAX_MODEL_LABELS: usize = 32;

/// The instruments of the gateway's chat-completions loop. The model label is taken from
/// requests, so it is bounded: the first [`MAX_MODEL_LABELS`] well-formed names, then
/// `other`.
#[derive(Clone)]
pub struct ChatMetrics {
    completions: Counter<u64>,
    rounds: Counter<u64>,
    fleet_calls: Counter<u64>,
    operation: Histogram<f64>,
    tokens: Histogram<u64>,
    models: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl std::fmt::Debug for ChatMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatMetrics")
    }
}

impl ChatMetrics {
    /// Instruments on the global meter provider.
    pub fn new() -> Self {
        let meter = opentelemetry::global::meter("toolfleet");
        let counter = |name, description| counter_on(&meter, name, description);
        Self {
            completions: counter(
                names::CHAT_COMPLETIONS,
                "Chat completions answered, by outcome",
            ),
            rounds: counter(
                names::CHAT_ROUNDS,
                "Rounds of fleet calls the chat loop ran",
            ),
            fleet_calls: counter(names::CHAT_FLEET_CALLS, "Fleet calls the chat loop ran"),
            operation: meter
                .f64_histogram(names::GEN_AI_OPERATION_DURATION)
                .with_unit("s")
                .with_description("GenAI operation duration")
                .with_boundaries(vec![
                    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92,
                ])
                .build(),
            tokens: meter
                .u64_histogram(names::GEN_AI_TOKEN_USAGE)
                .with_unit("{token}")
                .with_description("Number of input and output tokens used")
                .with_boundaries(vec![
                    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
                    1048576.0,
                ])
                .build(),
            models: Default::default(),
        }
    }

    /// The label value of `model`.
    fn model(&self, model: &str) -> String {
        let well_formed = !model.is_empty()
            && model.len() <= 64
            && model
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:/-@".contains(&b));
        if !well_formed {
            return "other".into();
        }
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if models.contains(model) || models.len() < MAX_MODEL_LABELS {
            models.insert(model.to_string());
            return model.to_string();
        }
        "other".into()
    }

    /// One completion ended in `outcome`.
    pub fn completion(&self, outcome: &'static str) {
        self.completions
            .add(1, &[KeyValue::new("outcome", outcome)]);
    }

    /// One round of the loop ran `calls` fleet calls.
    pub fn round(&self, calls: usize) {
        self.rounds.add(1, &[]);
        self.fleet_calls
            .add(u64::try_from(calls).unwrap_or(u64::MAX), &[]);
    }

    /// One upstream request for `model` took `seconds`; `error` is its error class
    /// (an HTTP status or `unavailable`) when it failed.
    pub fn upstream_request(&self, model: &str, seconds: f64, error: Option<&str>) {
        let mut labels = vec![
            KeyValue::new("gen_ai.operation.name", "chat"),
            KeyValue::new("gen_ai.request.model", self.model(model)),
        ];
        if let Some(error) = error {
            labels.push(KeyValue::new("error.type", error.to_string()));
        }
        self.operation.record(seconds, &labels);
    }

    /// The upstream reported `usage` (an OpenAI usage object) for `model`.
    pub fn usage(&self, model: &str, usage: &serde_json::Value) {
        let model = self.model(model);
        for (field, kind) in [("prompt_tokens", "input"), ("completion_tokens", "output")] {
            if let Some(tokens) = usage.get(field).and_then(serde_json::Value::as_u64) {
                self.tokens.record(
                    tokens,
                    &[
                        KeyValue::new("gen_ai.operation.name", "chat"),
                        KeyValue::new("gen_ai.request.model", model.clone()),
                        KeyValue::new("gen_ai.token.type", kind),
                    ],
                );
            }
        }
    }
}

impl Default for ChatMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Default for FleetMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_sent_again_is_refused_once_and_old_turns_are_forgotten() {
        let mut recent = RecentTurns::default();
        assert!(recent.insert("t1"));
        assert!(!recent.insert("t1"));
        for n in 0..RecentTurns::KEPT {
            assert!(recent.insert(&format!("other-{n}")));
        }
        assert_eq!(recent.order.len(), RecentTurns::KEPT);
        assert_eq!(recent.ids.len(), RecentTurns::KEPT);
        assert!(recent.insert("t1"), "the oldest id gave way");
    }

    #[test]
    fn chat_model_labels_are_bounded() {
        let metrics = ChatMetrics::new();
        assert_eq!(metrics.model("gpt-4o-mini"), "gpt-4o-mini");
        assert_eq!(metrics.model("bad model\n"), "other");
        assert_eq!(metrics.model(&"m".repeat(65)), "other");
        for i in 0..MAX_MODEL_LABELS {
            metrics.model(&format!("model-{i}"));
        }
        assert_eq!(metrics.model("one-too-many"), "other");
        assert_eq!(metrics.model("gpt-4o-mini"), "gpt-4o-mini");
    }

    #[test]
    fn error_types_are_toolfleet_codes_or_other() {
        assert_eq!(error_type("tool_timeout"), "tool_timeout");
        assert_eq!(error_type("no_live_worker"), "no_live_worker");
        assert_eq!(error_type("cancelled"), "cancelled");
        assert_eq!(error_type("boom"), "other");
        assert_eq!(error_type(""), "other");
    }
}
