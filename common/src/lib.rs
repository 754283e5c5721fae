//! # toolfleet-common
//!
//! The wire protocol of toolfleet and what every binary shares.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | [`args`] | the command line of the server binaries: `--help`, `--version`, anything else refused |
//! | [`config`] | where a process finds the fleet: default URLs, prefix, `Endpoints` |
//! | [`env`] | typed settings from environment variables (`env_*`, `ConfigError`) |
//! | [`deferred`] | spans whose ids and start are fixed early and exported by whoever ends the work |
//! | [`failover`] | moving a NATS connection to another server of a cluster |
//! | [`keep_errors`] | head sampling that still exports every trace with a failed span |
//! | [`prompt_export`] | a trace's closing span exported the moment it ends, local subtrees handed on whole |
//! | [`credentials`] | NATS user, password, inbox prefix and TLS files of one role |
//! | [`metrics`] | the fleet's OpenTelemetry instruments and metric names |
//! | [`names`] | every subject, stream, consumer, header and Redis key name |
//! | [`turn`] | `TurnRequest`, `TurnEvent` (`ack`, `tool_state`, `narration`, `final`, `error`) |
//! | [`history`] | a turn's results as OpenAI and Anthropic history (`render_history`) |
//! | [`call`] | `ToolCall`, `CallState`, `CallError` and its codes, `CallResult`, `Summary` |
//! | [`tool`] | `ToolDefinition`, retry policy, catalog formats (OpenAI, Anthropic, MCP) |
//! | `mcp` | fleet tools and results to and from the Model Context Protocol's types (feature `mcp`) |
//! | [`http`] | the operational HTTP endpoint server (`/healthz`, `/readyz`, `/metrics`) |
//! | [`job`] | `JobEnvelope` (what a worker receives) and progress notices |
//! | `ready` | the `/readyz` check of the coordinator and worker (feature `redis`) |
//! | `redis_client` | the Redis connection of every process: one server or a Redis Cluster (feature `redis`) |
//! | [`schemas`] | JSON Schemas of the wire messages (published in `docs/schemas/`) |
//! | [`shutdown`] | SIGTERM / Ctrl-C as a cancellation token |
//! | [`streams`] | creating the jobs and results JetStream streams |
//! | [`timetable`] | keys due at a time, waited for by one task (turn deadlines, job keep-alives) |
//! | [`tls`] | the TLS files (root CA, client certificate) of the NATS and Redis connections |
//! | [`topology`] | streams and consumers recreated when they disappear |
//! | [`host`] | this machine: a server's executable (`find_binary`), a free loopback port |
//! | [`health`] | liveness (supervised tasks), drain and start-up phase of a process |
//! | [`telemetry`] | logs, OTLP traces and metrics, Prometheus text, trace context in NATS headers |
//! | [`client`] | `FleetClient`: submit a turn, stream its events, list the catalog |

pub mod args;
pub mod call;
pub mod client;
pub mod config;
pub mod credentials;
pub mod deferred;
pub mod env;
pub mod failover;
pub mod headers;
pub mod health;
pub mod history;
pub mod host;
pub mod http;
pub mod job;
pub mod keep_errors;
#[cfg(feature = "mcp")]
pub mod mcp;
pub mod metrics;
pub mod names;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod oversize;
pub mod prompt_export;
#[cfg(feature = "redis")]
pub mod ready;
#[cfg(feature = "redis")]
pub mod redis_client;
pub mod schemas;
pub mod shutdown;
pub mod streams;
pub mod telemetry;
#[cfg(test)]
mod test_spans;
pub mod timetable;
pub mod tls;
pub mod tool;
pub mod topology;
pub mod turn;

/// mimalloc serves every allocation of a process built with the `mimalloc` feature (the
/// fleet's binaries): glibc `malloc` and `free` were a quarter of the coordinator's and
/// the worker's CPU (docs/BENCHMARKS.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub use call::{CallError, CallResult, CallState, Summary, ToolCall};
pub use client::FleetClient;
pub use job::JobEnvelope;
pub use names::Names;
pub use tool::{CatalogFormat, RetryPolicy, ToolDefinition};
pub use turn::{FinalEvent, History, TurnEvent, TurnOptions, TurnRequest};
