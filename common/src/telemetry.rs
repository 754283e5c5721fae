//! Telemetry set-up shared by every binary: `tracing` logs (text or JSON with trace and
//! span ids), OpenTelemetry traces and metrics over OTLP configured by the standard
//! `OTEL_*` variables, a Prometheus text rendering of the same metrics, and W3C trace
//! context carried in NATS headers.
//!
//! Every process's resource names it: `service.name`, `service.version` and a
//! `service.instance.id` stable for the process (from `OTEL_RESOURCE_ATTRIBUTES`, else
//! `TOOLFLEET_INSTANCE_ID`, else the host name and process id); the other
//! `OTEL_RESOURCE_ATTRIBUTES` are kept. Spans carry no `code.*`, `thread.*`, `busy_ns`
//! or `idle_ns` attributes. Error helpers ([`set_error`], [`record_exception`]) put a
//! bounded message in the status description.
//!
//! Without `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! no span is exported and no OpenTelemetry layer is installed; without it (or
//! `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) no metric is pushed. `OTEL_TRACES_EXPORTER=none`
//! and `OTEL_METRICS_EXPORTER=none` turn either off with the endpoint set (a Jaeger
//! takes traces and answers metrics with 404); metrics are served on `/metrics` either
//! way.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::HeaderMap;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, with `trace_id` and `span_id` when inside a span.
    Json,
}

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OtlpProtocol {
    /// HTTP with protobuf bodies (`http/protobuf`, the default).
    #[default]
    HttpProtobuf,
    /// gRPC (`grpc`; needs the `otlp-grpc` feature).
    Grpc,
}

/// Telemetry settings, from the environment.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// `service.name` when `OTEL_SERVICE_NAME` is unset.
    pub default_service_name: String,
    /// Whether spans are exported over OTLP: an endpoint is configured and
    /// `OTEL_TRACES_EXPORTER` is not `none`.
    pub export: bool,
    /// Whether metrics are pushed over OTLP: an endpoint is configured and
    /// `OTEL_METRICS_EXPORTER` is not `none`.
    pub export_metrics: bool,
    /// OTLP transport (`OTEL_EXPORTER_OTLP_PROTOCOL`).
    pub protocol: OtlpProtocol,
    /// Log format (`TOOLFLEET_LOG_FORMAT`: `text` or `json`).
    pub log_format: LogFormat,
    /// Log filter (`RUST_LOG`), `info` by default.
    pub log_filter: String,
    /// Record spans (with trace ids) even when nothing is exported, so a program can
    /// show the trace id of what it did.
    pub always_trace: bool,
    /// Export the traces the sampler drops after all when one of their spans failed
    /// (`TOOLFLEET_TRACES_KEEP_ERRORS`, default `true`; `keep_errors.rs`).
    pub keep_errors: bool,
    /// The span that ends a trace in this process, for [`keep_errors`](Self::keep_errors)
    /// (`turn` on a coordinator); `None`: a span with no parent in the process.
    pub closing_span: Option<&'static str>,
}

/// Telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A setting is malformed.
    #[error("{0}")]
    Config(String),
    /// An exporter could not be built.
    #[error("exporter: {0}")]
    Exporter(String),
    /// A global subscriber is already installed.
    #[error("subscriber: {0}")]
    Subscriber(String),
}

impl TelemetryConfig {
    /// Reads the configuration for a binary whose default service name is `service`.
    pub fn from_env(service: &str) -> Result<Self, TelemetryError> {
        use LogFormat::{Json, Text};
        use OtlpProtocol::{Grpc, HttpProtobuf};
        let protocol_choices = [("http/protobuf", HttpProtobuf), ("grpc", Grpc)];
        let protocol = env_choice("OTEL_EXPORTER_OTLP_PROTOCOL", &protocol_choices)?;
        let export = otlp_signals(|name| std::env::var(name).ok())?;
        let log_format = env_choice("TOOLFLEET_LOG_FORMAT", &[("text", Text), ("json", Json)])?;
        Ok(Self {
            default_service_name: service.to_string(),
            export: export.traces,
            export_metrics: export.metrics,
            protocol,
            log_format,
            log_filter: std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            always_trace: false,
            keep_errors: env_choice(
                "TOOLFLEET_TRACES_KEEP_ERRORS",
                &[("true", KeepErrors::Yes), ("false", KeepErrors::No)],
            )? == KeepErrors::Yes,
            closing_span: None,
        })
    }
}

/// What `OTEL_TRACES_EXPORTER` or `OTEL_METRICS_EXPORTER` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Exporter {
    /// OTLP, when an endpoint is configured (the default).
    #[default]
    Otlp,
    /// Nothing exported.
    None,
}

/// The signals exported over OTLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OtlpSignals {
    traces: bool,
    metrics: bool,
}

/// Which signals go over OTLP, from the variables `var` looks up: a signal is exported
/// when an endpoint is set for it (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the signal's own
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) and its
/// `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER` is `otlp` (the default) rather than
/// `none`. Any other exporter is an error naming the variable and what it accepts.
fn otlp_signals(var: impl Fn(&str) -> Option<String>) -> Result<OtlpSignals, TelemetryError> {
    let set = |name: &str| var(name).is_some_and(|v| !v.trim().is_empty());
    let exporter = |name: &str, also: &str| {
        let value = var(name).unwrap_or_default();
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "otlp" => Ok(Exporter::Otlp),
            "none" => Ok(Exporter::None),
            _ => Err(TelemetryError::Config(format!(
                "{name}={value:?}: use otlp (the default) or none{also}"
            ))),
        }
    };
    let traces = exporter("OTEL_TRACES_EXPORTER", "")?;
    let metrics = exporter(
        "OTEL_METRICS_EXPORTER",
        " (every process serves its metrics for Prometheus on /metrics either way)",
    )?;
    let endpoint = set("OTEL_EXPORTER_OTLP_ENDPOINT");
    Ok(OtlpSignals {
        traces: traces == Exporter::Otlp && (endpoint || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")),
        metrics: metrics == Exporter::Otlp
            && (endpoint || set("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")),
    })
}

/// `TOOLFLEET_TRACES_KEEP_ERRORS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum KeepErrors {
    #[default]
    Yes,
    No,
}

/// The choice `name` names among `choices`, the default when unset or empty; anything
/// else is an error listing the accepted values.
fn env_choice<T: Copy + Default>(name: &str, choices: &[(&str, T)]) -> Result<T, TelemetryError> {
    let value = std::env::var(name).unwrap_or_default();
    let value = value.trim();
    if value.is_empty() {
        return Ok(T::default());
    }
    if let Some((_, choice)) = choices.iter().find(|(v, _)| *v == value) {
        return Ok(*choice);
    }
    let accepted: Vec<&str> = choices.iter().map(|(v, _)| *v).collect();
    Err(TelemetryError::Config(format!(
        "{name}={value:?}: use {}",
        accepted.join(" or ")
    )))
}

/// Installed telemetry; call [`Telemetry::shutdown`] before exit to flush.
pub struct Telemetry {
    tracer_provider: Option<SdkTracerProvider>,
    meter_provider: Option<SdkMeterProvider>,
    #[cfg(feature = "prometheus")]
    prometheus: prometheus::Registry,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.tracer_provider.is_some())
            .finish()
    }
}

/// The host's name: `$HOSTNAME` when the environment has it (most shells do not export
/// it), else the kernel's host name (`/proc/sys/kernel/hostname`, `/etc/hostname`), else
/// `host`.
pub fn host_name() -> String {
    let non_empty = |v: String| Some(v.trim().to_string()).filter(|v| !v.is_empty());
    std::env::var("HOSTNAME")
        .ok()
        .and_then(non_empty)
        .or_else(|| {
            ["/proc/sys/kernel/hostname", "/etc/hostname"]
                .iter()
                .find_map(|path| std::fs::read_to_string(path).ok().and_then(non_empty))
        })
        .unwrap_or_else(|| "host".into())
}

/// `service.instance.id` when `OTEL_RESOURCE_ATTRIBUTES` does not set one:
/// `TOOLFLEET_INSTANCE_ID`; else, in a container (process id 1), its host name (the
/// container id under Docker, the pod name under Kubernetes); else
/// `<host name>-<process id>`. Fixed for the process's life.
pub fn instance_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let set = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if let Some(id) = set("TOOLFLEET_INSTANCE_ID") {
            return id;
        }
        let host = host_name();
        match std::process::id() {
            1 => host,
            pid => format!("{host}-{pid}"),
        }
    })
}

/// The `service.instance.id` this process's spans carry: the one
/// `OTEL_RESOURCE_ATTRIBUTES` sets, else [`instance_id`]. Fixed for the process's life.
pub fn service_instance_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let env = Resource::builder_empty()
            .with_detector(Box::new(
                opentelemetry_sdk::resource::EnvResourceDetector::new(),
            ))
            .build();
        let key = opentelemetry::Key::from_static_str("service.instance.id");
        match env.get(&key) {
            Some(value) => value.to_string(),
            None => instance_id().to_string(),
        }
    })
}

fn resource(config: &TelemetryConfig) -> Resource {
    use opentelemetry::KeyValue;
    let mut builder = Resource::builder();
    if !std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.trim().is_empty()) {
        builder = builder.with_service_name(config.default_service_name.clone());
    }
    // The environment's attributes win over these defaults.
    let env = Resource::builder_empty()
        .with_detector(Box::new(
            opentelemetry_sdk::resource::EnvResourceDetector::new(),
        ))
        .build();
    let key = opentelemetry::Key::from_static_str("service.instance.id");
    if env.get(&key).is_none() {
        builder = builder.with_attribute(KeyValue::new(key, instance_id().to_string()));
    }
    let version = opentelemetry::Key::from_static_str("service.version");
    if env.get(&version).is_none() {
        builder = builder.with_attribute(KeyValue::new(version, env!("CARGO_PKG_VERSION")));
    }
    builder.build()
}

// ----- ids of deferred spans -------------------------------------------------------

thread_local! {
    /// Ids the next span built on this thread takes instead of random ones.
    static PRESET: Cell<Option<(TraceId, SpanId)>> = const { Cell::new(None) };
}

/// Whether this process installed a tracer provider (set by [`init`]).
static TRACING: AtomicBool = AtomicBool::new(false);

/// Marks that spans are recorded in this process.
fn set_tracing(on: bool) {
    TRACING.store(on, Ordering::Relaxed);
}

/// Whether spans are recorded in this process.
pub fn tracing_enabled() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// Random ids, except for a span built inside [`with_preset_ids`] (a deferred span
/// ended with the ids fixed when its work began).
#[derive(Debug, Default)]
pub(crate) struct PresetIdGenerator {
    random: RandomIdGenerator,
}

impl IdGenerator for PresetIdGenerator {
    fn new_trace_id(&self) -> TraceId {
        match PRESET.with(Cell::get) {
            Some((trace, _)) => trace,
            None => self.random.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> SpanId {
        match PRESET.with(Cell::get) {
            Some((_, span)) => span,
            None => self.random.new_span_id(),
        }
    }
}

/// `build` run with the ids every span built on this thread takes meanwhile.
pub(crate) fn with_preset_ids<R>(ids: (TraceId, SpanId), build: impl FnOnce() -> R) -> R {
    PRESET.with(|p| p.set(Some(ids)));
    let built = build();
    PRESET.with(|p| p.set(None));
    built
}

/// The semantic conventions version the span attributes follow.
pub const SCHEMA_URL: &str = "https://opentelemetry.io/schemas/1.37.0";

/// The instrumentation scope of every span toolfleet makes: `toolfleet`, the crate's
/// version and [`SCHEMA_URL`].
pub fn scope() -> opentelemetry::InstrumentationScope {
    opentelemetry::InstrumentationScope::builder("toolfleet")
        .with_version(env!("CARGO_PKG_VERSION"))
        .with_schema_url(SCHEMA_URL)
        .build()
}

/// Builds the tracer provider exporting over OTLP (`None` when no endpoint is set).
pub fn tracer_provider(
    config: &TelemetryConfig,
) -> Result<Option<SdkTracerProvider>, TelemetryError> {
    if !config.export {
        return Ok(config.always_trace.then(|| {
            SdkTracerProvider::builder()
                .with_id_generator(PresetIdGenerator::default())
                .with_resource(resource(config))
                .build()
        }));
    }
    let builder = SdkTracerProvider::builder().with_id_generator(PresetIdGenerator::default());
    let builder = with_exporter(builder, config)?;
    Ok(Some(builder.with_resource(resource(config)).build()))
}

/// The OTLP span exporter for `protocol`: HTTP/protobuf through [`crate::otlp`] (bodies
/// written straight from the spans), gRPC through `opentelemetry-otlp`.
#[cfg(feature = "otlp")]
fn span_exporter(protocol: OtlpProtocol) -> Result<SpanExport, TelemetryError> {
    match protocol {
        OtlpProtocol::HttpProtobuf => {
            crate::otlp::HttpSpanExporter::new(crate::otlp::HttpExportConfig::from_env())
                .map(SpanExport::Http)
                .map_err(|e| TelemetryError::Exporter(e.to_string()))
        }
        #[cfg(feature = "otlp-grpc")]
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map(SpanExport::Grpc)
            .map_err(|e| TelemetryError::Exporter(e.to_string())),
        #[cfg(not(feature = "otlp-grpc"))]
        OtlpProtocol::Grpc => Err(TelemetryError::Config(
            "OTLP over gRPC needs the otlp-grpc feature".into(),
        )),
    }
}

/// The span exporter of the configured OTLP transport.
#[cfg(feature = "otlp")]
#[derive(Debug)]
enum SpanExport {
    Http(crate::otlp::HttpSpanExporter),
    #[cfg(feature = "otlp-grpc")]
    Grpc(opentelemetry_otlp::SpanExporter),
}

#[cfg(feature = "otlp")]
impl opentelemetry_sdk::trace::SpanExporter for SpanExport {
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        match self {
            Self::Http(e) => e.export(batch).await,
            #[cfg(feature = "otlp-grpc")]
            Self::Grpc(e) => e.export(batch).await,
        }
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        match self {
            Self::Http(e) => e.shutdown_with_timeout(timeout),
            #[cfg(feature = "otlp-grpc")]
            Self::Grpc(e) => e.shutdown_with_timeout(timeout),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        match self {
            Self::Http(e) => e.set_resource(resource),
            #[cfg(feature = "otlp-grpc")]
            Self::Grpc(e) => e.set_resource(resource),
        }
    }
}

/// Adds the OTLP span exporter of `config` to `builder`: through [`KeepErrors`]
/// (`keep_errors.rs`), with the sampler of `OTEL_TRACES_SAMPLER` recording what it
/// drops, unless `keep_errors` is off.
#[cfg(feature = "otlp")]
fn with_exporter(
    builder: opentelemetry_sdk::trace::TracerProviderBuilder,
    config: &TelemetryConfig,
) -> Result<opentelemetry_sdk::trace::TracerProviderBuilder, TelemetryError> {
    use crate::keep_errors::{KeepErrors, KeepErrorsConfig, RecordDropped};
    let exporter = span_exporter(config.protocol)?;
    let batch = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter).build();
    // A closing span (`turn`) is exported the moment it ends, by an exporter of its own
    // (`prompt_export.rs`): a replica killed after ending a turn has sent its span.
    let batch = match config.closing_span {
        Some(closing) => Processor::Prompt(crate::prompt_export::PromptClosing::new(
            batch,
            span_exporter(config.protocol)?,
            closing,
        )),
        None => Processor::Batch(batch),
    };
    if !config.keep_errors {
        return Ok(builder.with_span_processor(batch));
    }
    // The sampler the OTEL_TRACES_SAMPLER variables configure, as the SDK reads them.
    let sampler = opentelemetry_sdk::trace::Config::default().sampler;
    let keep = KeepErrors::new(
        batch,
        KeepErrorsConfig {
            closing_span: config.closing_span,
            ..KeepErrorsConfig::default()
        },
    );
    Ok(builder
        .with_sampler(RecordDropped(sampler))
        .with_span_processor(keep))
}

/// The batch processor, behind [`crate::prompt_export::PromptClosing`] in a process
/// whose traces have a closing span.
#[cfg(feature = "otlp")]
#[derive(Debug)]
enum Processor {
    Batch(opentelemetry_sdk::trace::BatchSpanProcessor),
    Prompt(crate::prompt_export::PromptClosing<opentelemetry_sdk::trace::BatchSpanProcessor>),
}

#[cfg(feature = "otlp")]
impl opentelemetry_sdk::trace::SpanProcessor for Processor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        match self {
            Self::Batch(p) => p.on_start(span, cx),
            Self::Prompt(p) => p.on_start(span, cx),
        }
    }

    fn on_end(&self, span: opentelemetry_sdk::trace::SpanData) {
        match self {
            Self::Batch(p) => p.on_end(span),
            Self::Prompt(p) => p.on_end(span),
        }
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        match self {
            Self::Batch(p) => p.force_flush(),
            Self::Prompt(p) => p.force_flush(),
        }
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        match self {
            Self::Batch(p) => p.shutdown_with_timeout(timeout),
            Self::Prompt(p) => p.shutdown_with_timeout(timeout),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        match self {
            Self::Batch(p) => p.set_resource(resource),
            Self::Prompt(p) => p.set_resource(resource),
        }
    }
}

/// Without the `otlp` feature there is no exporter: asking for export is an error, not a
/// silent loss of every span.
#[cfg(not(feature = "otlp"))]
fn with_exporter(
    _builder: opentelemetry_sdk::trace::TracerProviderBuilder,
    _config: &TelemetryConfig,
) -> Result<opentelemetry_sdk::trace::TracerProviderBuilder, TelemetryError> {
    Err(TelemetryError::Config(
        "OTEL_EXPORTER_OTLP_ENDPOINT is set but this build has no OTLP exporter: enable the \
         `otlp` feature (toolfleet-worker/otlp or toolfleet-common/otlp)"
            .into(),
    ))
}

/// The meter provider with the readers this build and configuration have (Prometheus,
/// OTLP), or `None` when there is none: a provider without a reader refuses every
/// instrument (`InstrumentCreationFailed`, an ERROR line each), so without one the
/// global no-op provider stays, whose instruments cost nothing and log nothing.
fn meter_provider(config: &TelemetryConfig) -> Result<Option<SdkMeterProvider>, TelemetryError> {
    let builder = SdkMeterProvider::builder().with_resource(resource(config));
    #[allow(unused_mut)]
    let mut readers = 0;
    #[cfg(feature = "prometheus")]
    let builder = {
        let registry = prometheus::Registry::new();
        let reader = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        let _ = PROMETHEUS.set(registry);
        readers += 1;
        builder.with_reader(reader)
    };
    #[cfg(feature = "otlp")]
    let builder = if config.export_metrics && config.protocol == OtlpProtocol::HttpProtobuf {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        readers += 1;
        builder.with_periodic_exporter(exporter)
    } else {
        builder
    };
    Ok((readers > 0).then(|| builder.build()))
}

/// Installs logging, tracing export and metrics for this process.
pub fn init(config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    let filter = EnvFilter::try_new(&config.log_filter)
        .map_err(|e| TelemetryError::Config(format!("RUST_LOG: {e}")))?;
    let tracer_provider = tracer_provider(config)?;
    // Spans are exported at `info` and above whatever RUST_LOG says about log lines.
    // While RUST_LOG enables nothing finer than `info` (its default, or `warn`), one
    // global `info` filter keeps finer spans from both layers and the OpenTelemetry
    // layer needs no filter of its own: a per-layer filter is consulted at every
    // span's creation, entry, exit, record and close.
    // Without an exporter nothing needs spans finer than RUST_LOG, and no global filter
    // is added: it would let `info` spans be built only for the log layer to drop them.
    let info_at_most = filter
        .max_level_hint()
        .is_some_and(|level| level <= LevelFilter::INFO);
    let global = (info_at_most && tracer_provider.is_some()).then_some(LevelFilter::INFO);
    let otel_layer = tracer_provider.as_ref().map(|p| {
        let layer = tracing_opentelemetry::layer()
            .with_tracer(p.tracer_with_scope(scope()))
            .with_location(false)
            // The module path of a `tracing` span is no attribute of the conventions.
            .with_target(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            // Parents and trace context are taken from the tracing spans themselves;
            // nothing reads `opentelemetry::Context::current()`, so entering a span
            // does not attach its context.
            .with_context_activation(false);
        if info_at_most {
            layer.boxed()
        } else {
            layer.with_filter(LevelFilter::INFO).boxed()
        }
    });
    let meter_provider = meter_provider(config)?;
    if let Some(provider) = &meter_provider {
        opentelemetry::global::set_meter_provider(provider.clone());
    }
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    if let Some(p) = &tracer_provider {
        opentelemetry::global::set_tracer_provider(p.clone());
        set_tracing(true);
    }

    let fmt_layer = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => TraceIdLayer::default()
            .and_then(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .event_format(JsonWithTrace),
            )
            .with_filter(filter)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(global)
        .with(otel_layer)
        .with(fmt_layer)
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    Ok(Telemetry {
        tracer_provider,
        meter_provider,
        #[cfg(feature = "prometheus")]
        prometheus: PROMETHEUS.get().cloned().unwrap_or_default(),
    })
}

use tracing_subscriber::Layer as _;

impl Telemetry {
    /// The metrics in Prometheus text exposition format.
    #[cfg(feature = "prometheus")]
    pub fn prometheus_text(&self) -> String {
        render_prometheus(&self.prometheus)
    }

    /// A cheap handle for rendering metrics from an HTTP handler.
    #[cfg(feature = "prometheus")]
    pub fn prometheus_registry(&self) -> prometheus::Registry {
        self.prometheus.clone()
    }

    /// Flushes and stops the exporters. Blocks; call it from a blocking context or at the
    /// very end of `main`.
    pub fn shutdown(self) {
        if let Some(p) = self.tracer_provider {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
        if let Some(p) = self.meter_provider {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

#[cfg(feature = "prometheus")]
static PROMETHEUS: std::sync::OnceLock<prometheus::Registry> = std::sync::OnceLock::new();

/// This process's metrics in Prometheus text format (empty before [`init`], and always
/// without the `prometheus` feature).
pub fn prometheus_text() -> String {
    #[cfg(feature = "prometheus")]
    return PROMETHEUS.get().map(render_prometheus).unwrap_or_default();
    #[cfg(not(feature = "prometheus"))]
    String::new()
}

/// Renders a Prometheus registry as text.
#[cfg(feature = "prometheus")]
pub fn render_prometheus(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8(out).unwrap_or_default()
}

// ----- trace context in NATS headers ------------------------------------------------

fn traceparent_name() -> async_nats::header::HeaderName {
    async_nats::header::HeaderName::from_static(crate::names::HEADER_TRACEPARENT)
}

fn tracestate_name() -> async_nats::header::HeaderName {
    async_nats::header::HeaderName::from_static(crate::names::HEADER_TRACESTATE)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn push_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
}

/// The W3C `traceparent` value (version `00`) of `sc`: only the sampled flag is kept.
fn traceparent_value(sc: &SpanContext) -> String {
    let mut out = String::with_capacity(55);
    out.push_str("00-");
    push_hex(&mut out, &sc.trace_id().to_bytes());
    out.push('-');
    push_hex(&mut out, &sc.span_id().to_bytes());
    out.push('-');
    push_hex(
        &mut out,
        &[(sc.trace_flags() & TraceFlags::SAMPLED).to_u8()],
    );
    out
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// Lowercase hex digits into bytes.
fn parse_hex<const N: usize>(hex: &[u8]) -> Option<[u8; N]> {
    if hex.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        out[i] = hex_value(pair[0])? << 4 | hex_value(pair[1])?;
    }
    Some(out)
}

/// Parses a W3C `traceparent` (trace context level 1): `version-trace_id-parent_id-flags`
/// in lowercase hex, version `ff` invalid, version `00` exactly 55 characters, a later
/// version at least 55 with a `-` after the flags; an all-zero trace or span id is
/// invalid. Flags other than sampled are dropped.
pub fn parse_traceparent(value: &str) -> Option<(TraceId, SpanId, TraceFlags)> {
    let b = value.trim().as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let [version] = parse_hex::<1>(&b[..2])?;
    match version {
        0xff => return None,
        0 if b.len() != 55 => return None,
        _ if b.len() > 55 && b[55] != b'-' => return None,
        _ => {}
    }
    let trace = TraceId::from_bytes(parse_hex::<16>(&b[3..35])?);
    let span = SpanId::from_bytes(parse_hex::<8>(&b[36..52])?);
    let [flags] = parse_hex::<1>(&b[53..55])?;
    if trace == TraceId::INVALID || span == SpanId::INVALID {
        return None;
    }
    Some((trace, span, TraceFlags::new(flags) & TraceFlags::SAMPLED))
}

/// The remote context a `traceparent` (and `tracestate`) describe, if valid.
fn remote_context(traceparent: &str, tracestate: Option<&str>) -> Option<opentelemetry::Context> {
    let (trace, span, flags) = parse_traceparent(traceparent)?;
    let state = tracestate
        .filter(|s| !s.trim().is_empty())
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let sc = SpanContext::new(trace, span, flags, true, state);
    Some(opentelemetry::Context::new().with_remote_span_context(sc))
}

/// Writes `span`'s W3C trace context (`traceparent`, and `tracestate` when it has
/// entries) into `headers`. Does nothing when the span is not recorded by
/// OpenTelemetry.
pub fn inject_span(span: &tracing::Span, headers: &mut HeaderMap) {
    let cx = span.context();
    let otel_span = cx.span();
    let sc = otel_span.span_context();
    if !sc.is_valid() {
        return;
    }
    headers.insert(traceparent_name(), traceparent_value(sc));
    let state = sc.trace_state().header();
    if !state.is_empty() {
        if let Ok(value) = state.parse::<async_nats::header::HeaderValue>() {
            headers.insert(tracestate_name(), value);
        }
    }
}

/// Writes the current span's trace context into `headers`.
pub fn inject_current(headers: &mut HeaderMap) {
    inject_span(&tracing::Span::current(), headers);
}

/// The remote parent carried in `headers` (an empty context when absent or invalid).
pub fn extract(headers: Option<&HeaderMap>) -> opentelemetry::Context {
    headers
        .and_then(|h| {
            let parent = h.get(traceparent_name())?;
            let state = h.get(tracestate_name()).map(|v| v.as_str());
            remote_context(parent.as_str(), state)
        })
        .unwrap_or_default()
}

/// Parents `span` under the context carried in `headers`, when there is one.
pub fn set_remote_parent(span: &tracing::Span, headers: Option<&HeaderMap>) {
    let cx = extract(headers);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// The trace id of `span` as 32 hex digits, when it is recorded.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// The W3C `traceparent` of `span`, when it is recorded.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let otel_span = cx.span();
    let sc = otel_span.span_context();
    sc.is_valid().then(|| traceparent_value(sc))
}

/// Parents the consumer span `span` of a message: under the turn span named in
/// `Fleet-Turn-Traceparent` when the message carries one, linked to the producer's
/// context in `traceparent`; under the producer's context otherwise. A producer span
/// lost with its process (a coordinator killed before exporting) then leaves no
/// consumer without its parent.
pub fn set_consumer_parent(span: &tracing::Span, headers: Option<&HeaderMap>) {
    let Some(headers) = headers else {
        return;
    };
    let producer_cx = extract(Some(headers));
    let producer = producer_cx.span().span_context().clone();
    let turn = headers
        .get(async_nats::header::HeaderName::from_static(
            crate::names::HEADER_TURN_TRACEPARENT,
        ))
        .and_then(|v| remote_context(v.as_str(), None));
    match turn {
        Some(turn) => {
            let _ = span.set_parent(turn);
            if producer.is_valid() {
                span.add_link(producer);
            }
        }
        None if producer.is_valid() => {
            let _ = span.set_parent(producer_cx);
        }
        None => {}
    }
}

/// `server.address` and `server.port` of the first server in a NATS URL list
/// (`nats://user:pass@host:4222,nats://other:4222`); the port defaults to 4222.
pub fn server_of(url: &str) -> (String, i64) {
    let first = url.split(',').next().unwrap_or_default().trim();
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let hostport = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let hostport = hostport.split('/').next().unwrap_or_default();
    match hostport.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => match port.parse() {
            Ok(port) => (host.to_string(), port),
            Err(_) => (hostport.to_string(), 4222),
        },
        _ => (hostport.to_string(), 4222),
    }
}

/// Longest status description or exception message, in characters.
pub const MAX_ERROR_MESSAGE: usize = 256;

/// `message` on one line, cut to [`MAX_ERROR_MESSAGE`] characters.
pub fn bounded_message(message: &str) -> String {
    let line: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_ERROR_MESSAGE + 1)
        .collect();
    if line.chars().count() > MAX_ERROR_MESSAGE {
        let cut: String = line.chars().take(MAX_ERROR_MESSAGE - 1).collect();
        format!("{cut}…")
    } else {
        line
    }
}

/// Marks `span` failed: status ERROR with `message` (bounded) as its description and
/// `error.type` = `code` (the span must declare `error.type`).
pub fn set_error(span: &tracing::Span, code: &str, message: &str) {
    span.record("error.type", code);
    span.set_status(opentelemetry::trace::Status::error(bounded_message(
        message,
    )));
}

/// Adds an `exception` event (`exception.type`, `exception.message`) to `span`.
pub fn record_exception(span: &tracing::Span, kind: &str, message: &str) {
    span.add_event(
        "exception",
        vec![
            opentelemetry::KeyValue::new("exception.type", kind.to_string()),
            opentelemetry::KeyValue::new("exception.message", bounded_message(message)),
        ],
    );
}

/// Parents `span` under a stored `traceparent` (an invalid one parents nothing).
pub fn set_parent_from_traceparent(span: &tracing::Span, traceparent: &str) {
    if let Some(cx) = remote_context(traceparent, None) {
        let _ = span.set_parent(cx);
    }
}

// ----- JSON log lines with trace ids ------------------------------------------------

/// The OpenTelemetry ids of a span, kept in its extensions for log lines.
struct TraceIds {
    trace_id: String,
    span_id: String,
}

/// Records each span's OpenTelemetry ids on its first entry (placed after the
/// OpenTelemetry layer).
#[derive(Default)]
struct TraceIdLayer {
    dispatch: std::sync::OnceLock<tracing::dispatcher::WeakDispatch>,
}

impl<S> tracing_subscriber::Layer<S> for TraceIdLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        let _ = self.dispatch.set(subscriber.downgrade());
    }

    // Looked up on first entry, not at creation: a remote parent is set between the two,
    // and reading the context starts the OpenTelemetry span, fixing its parent.
    fn on_enter(&self, id: &tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let known = ctx
            .span(id)
            .is_none_or(|span| span.extensions().get::<TraceIds>().is_some());
        if known {
            return;
        }
        let Some(dispatch) = self.dispatch.get().and_then(|d| d.upgrade()) else {
            return;
        };
        let Some(cx) = tracing_opentelemetry::get_otel_context(id, &dispatch) else {
            return;
        };
        let sc = cx.span().span_context().clone();
        if let (true, Some(span)) = (sc.is_valid(), ctx.span(id)) {
            span.extensions_mut().insert(TraceIds {
                trace_id: sc.trace_id().to_string(),
                span_id: sc.span_id().to_string(),
            });
        }
    }
}

struct JsonWithTrace;

struct FieldVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for FieldVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .insert(field.name().into(), Value::String(value.into()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), Value::String(format!("{value:?}")));
    }
}

impl<S, N> FormatEvent<S, N> for JsonWithTrace
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            Value::String(crate::call::now_rfc3339()),
        );
        line.insert(
            "level".into(),
            Value::String(event.metadata().level().to_string()),
        );
        line.insert(
            "target".into(),
            Value::String(event.metadata().target().into()),
        );
        let mut fields = Map::new();
        event.record(&mut FieldVisitor(&mut fields));
        if let Some(span) = ctx.lookup_current() {
            line.insert("span".into(), Value::String(span.name().into()));
            if let Some(ids) = span.extensions().get::<TraceIds>() {
                line.insert("trace_id".into(), Value::String(ids.trace_id.clone()));
                line.insert("span_id".into(), Value::String(ids.span_id.clone()));
            }
        }
        for (k, v) in fields {
            line.entry(k).or_insert(v);
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// The signals `vars` (name, value) export over OTLP.
    fn signals(vars: &[(&str, &str)]) -> Result<OtlpSignals, TelemetryError> {
        otlp_signals(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn each_signal_is_exported_unless_its_exporter_is_none() {
        let both = OtlpSignals {
            traces: true,
            metrics: true,
        };
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318");
        let none = OtlpSignals {
            traces: false,
            metrics: false,
        };
        // No endpoint: nothing, whatever the exporters say.
        assert_eq!(signals(&[]).ok(), Some(none));
        assert_eq!(
            signals(&[("OTEL_METRICS_EXPORTER", "otlp")]).ok(),
            Some(none)
        );
        // An endpoint: both, unset, empty or `otlp` alike.
        assert_eq!(signals(&[endpoint]).ok(), Some(both));
        for value in ["", " ", "otlp", "OTLP"] {
            let vars = [
                endpoint,
                ("OTEL_TRACES_EXPORTER", value),
                ("OTEL_METRICS_EXPORTER", value),
            ];
            assert_eq!(signals(&vars).ok(), Some(both), "{value:?}");
        }
        // `none` turns off one signal and leaves the other.
        for value in ["none", " None "] {
            let vars = [endpoint, ("OTEL_METRICS_EXPORTER", value)];
            let traces_only = OtlpSignals {
                traces: true,
                metrics: false,
            };
            assert_eq!(signals(&vars).ok(), Some(traces_only), "{value:?}");
            let vars = [endpoint, ("OTEL_TRACES_EXPORTER", value)];
            let metrics_only = OtlpSignals {
                traces: false,
                metrics: true,
            };
            assert_eq!(signals(&vars).ok(), Some(metrics_only), "{value:?}");
        }
        // A signal's own endpoint exports that signal only.
        let traces = [(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://j:4318/v1/traces",
        )];
        assert_eq!(
            signals(&traces).ok(),
            Some(OtlpSignals {
                traces: true,
                metrics: false
            })
        );
        let metrics = [(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "http://c:4318/v1/metrics",
        )];
        assert_eq!(
            signals(&metrics).ok(),
            Some(OtlpSignals {
                traces: false,
                metrics: true
            })
        );
    }

    #[test]
    fn an_exporter_other_than_otlp_or_none_is_an_error_naming_the_variable() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318");
        for (name, value) in [
            ("OTEL_METRICS_EXPORTER", "prometheus"),
            ("OTEL_METRICS_EXPORTER", "otlp,console"),
            ("OTEL_TRACES_EXPORTER", "jaeger"),
        ] {
            let message = match signals(&[endpoint, (name, value)]) {
                Err(TelemetryError::Config(message)) => message,
                other => panic!("{name}={value}: {other:?}"),
            };
            assert!(
                message.starts_with(&format!("{name}={value:?}")),
                "{message}"
            );
            assert!(
                message.contains("otlp") && message.contains("none"),
                "{message}"
            );
        }
        // Without an endpoint too: the setting is wrong whether or not it matters now.
        assert!(signals(&[("OTEL_METRICS_EXPORTER", "nope")]).is_err());
    }

    #[test]
    fn host_name_is_the_environment_or_the_kernel_name() {
        let name = host_name();
        assert!(!name.is_empty() && name == name.trim());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
        match std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.trim().is_empty())
        {
            Some(env) => assert_eq!(name, env.trim()),
            None => {
                if let Some(kernel) = kernel {
                    assert_eq!(name, kernel.trim());
                }
            }
        }
    }

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut b) = self.0.lock() {
                b.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn json_lines_carry_trace_and_span_ids() {
        let provider = SdkTracerProvider::builder().build();
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
            .with(TraceIdLayer::default())
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(move || writer.clone())
                    .event_format(JsonWithTrace),
            );
        let mut expected_trace = None;
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("work");
            let mut headers = HeaderMap::new();
            headers.insert(
                crate::names::HEADER_TRACEPARENT,
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            );
            set_remote_parent(&span, Some(&headers));
            let _entered = span.enter();
            expected_trace = trace_id(&span);
            tracing::info!(call = "c1", "tool ran");
        });
        assert_eq!(
            expected_trace.as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        let text = buffer.0.lock().map(|b| b.clone()).unwrap_or_default();
        let line: Value = serde_json::from_slice(&text).unwrap_or(Value::Null);
        assert_eq!(line["message"], "tool ran");
        assert_eq!(line["call"], "c1");
        assert_eq!(line["span"], "work");
        assert_eq!(line["trace_id"].as_str(), expected_trace.as_deref());
        assert_eq!(line["span_id"].as_str().map(str::len), Some(16));
    }

    #[test]
    fn server_address_and_port_come_from_the_first_url() {
        let at = |url: &str| server_of(url);
        assert_eq!(at("nats://127.0.0.1:4222"), ("127.0.0.1".into(), 4222));
        assert_eq!(
            at("nats://u:p@nats.svc:4333,nats://b:1"),
            ("nats.svc".into(), 4333)
        );
        assert_eq!(at("localhost"), ("localhost".into(), 4222));
    }

    #[test]
    fn error_messages_are_bounded_single_lines() {
        assert_eq!(bounded_message("a\nb"), "a b");
        let long = "x".repeat(1000);
        assert_eq!(bounded_message(&long).chars().count(), MAX_ERROR_MESSAGE);
    }

    #[test]
    fn trace_context_round_trips_through_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            crate::names::HEADER_TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        let cx = extract(Some(&headers));
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(!extract(None).span().span_context().is_valid());
    }

    #[test]
    fn traceparent_parsing_follows_the_w3c_rules_as_the_sdk_does() {
        use opentelemetry::propagation::TextMapPropagator;
        let sdk = |tp: &str, ts: Option<&str>| {
            let mut map = std::collections::HashMap::new();
            map.insert("traceparent".to_string(), tp.to_string());
            if let Some(ts) = ts {
                map.insert("tracestate".to_string(), ts.to_string());
            }
            let cx = TraceContextPropagator::new().extract(&map);
            let sc = cx.span().span_context().clone();
            sc.is_valid().then_some(sc)
        };
        let ours = |tp: &str, ts: Option<&str>| {
            remote_context(tp, ts).map(|cx| cx.span().span_context().clone())
        };
        for tp in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "",
        ] {
            for ts in [None, Some("vendor=abc,other=x-1"), Some("")] {
                assert_eq!(ours(tp, ts), sdk(tp, ts), "{tp:?} {ts:?}");
            }
        }
        // The SDK accepts ids and flags shorter than the standard's; they are refused here.
        assert!(ours("00-4bf92f-00f067aa0ba902b7-01", None).is_none());
        assert!(ours(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\r",
            None
        )
        .is_none());
    }

    #[test]
    fn injected_context_is_the_span_context_and_reads_back() {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt;
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("producer");
            let mut headers = HeaderMap::new();
            inject_span(&span, &mut headers);
            let cx = span.context();
            let otel_span = cx.span();
            let sc = otel_span.span_context();
            let expected = format!("00-{}-{}-01", sc.trace_id(), sc.span_id());
            assert_eq!(
                headers
                    .get(crate::names::HEADER_TRACEPARENT)
                    .map(|v| v.as_str()),
                Some(expected.as_str())
            );
            assert_eq!(traceparent(&span).as_deref(), Some(expected.as_str()));
            // An empty trace state is not sent.
            assert!(headers.get(crate::names::HEADER_TRACESTATE).is_none());
            let back = extract(Some(&headers));
            assert_eq!(back.span().span_context().span_id(), sc.span_id());
            assert!(back.span().span_context().is_remote());
        });
    }

    #[test]
    fn preset_ids_are_taken_only_while_set() {
        let ids = PresetIdGenerator::default();
        let trace =
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap_or(TraceId::INVALID);
        let span = SpanId::from_hex("00f067aa0ba902b7").unwrap_or(SpanId::INVALID);
        let taken = with_preset_ids((trace, span), || (ids.new_trace_id(), ids.new_span_id()));
        assert_eq!(taken, (trace, span));
        assert_ne!(ids.new_span_id(), span);
    }
}
