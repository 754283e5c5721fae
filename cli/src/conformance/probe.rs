//! The definition case: the probe's registry entry read as JSON, integer fields checked
//! to be integers, the whole decoded as coordinators decode it, a coordinator's
//! rejection read back, live workers counted and the consumer's delivery settings
//! compared with the definition (PROTOCOL §3.8, §7.1). What it learns is the [`Probe`]
//! the job cases drive.

use std::time::Duration;

use async_nats::jetstream;
use serde_json::Value;
use toolfleet_common::call::unix_ms;
use toolfleet_common::redis_client::RedisConnection;
use toolfleet_common::{Names, ToolDefinition};

use super::{Case, Settings};

/// What the job cases need to know about the probe and its fleet.
pub struct Probe {
    /// NATS, for jobs, results, notices and acknowledgements.
    pub nats: async_nats::Client,
    /// JetStream, for publishing jobs.
    pub js: jetstream::Context,
    /// Redis, for the registry (the shutdown case's withdrawal).
    pub redis: RedisConnection,
    /// The fleet's names.
    pub names: Names,
    /// The tool.
    pub tool: String,
    /// The definition's timeout (read leniently).
    pub timeout_ms: u64,
    /// The bound consumer's ack wait.
    pub ack_wait: Duration,
    /// The bound consumer's max deliver.
    pub max_deliver: i64,
}

/// The definition case, and the probe when the job cases can run.
pub async fn check(
    nats: &async_nats::Client,
    mut redis: RedisConnection,
    names: &Names,
    settings: &Settings,
) -> (Case, Option<Probe>) {
    let mut case = Case::new("definition");
    let tool = settings.tool.as_str();
    let raw: Option<String> = redis::cmd("HGET")
        .arg(names.tool_definition_key(tool))
        .arg("definition")
        .query_async(&mut redis)
        .await
        .unwrap_or(None);
    let Some(raw) = raw else {
        case.fail(
            "not_registered",
            format!(
                "no definition of {tool} in {} (PROTOCOL §7.1 step 3)",
                names.tool_definition_key(tool)
            ),
        );
        return (case, None);
    };
    let Ok(value) = serde_json::from_str::<Value>(&raw) else {
        case.fail(
            "definition_not_json",
            "the registered definition is not JSON",
        );
        return (case, None);
    };
    check_types(&value, &mut case);
    if let Err(error) = serde_json::from_value::<ToolDefinition>(value.clone()) {
        case.fail(
            "definition_undecodable",
            format!("coordinators cannot read the definition ({error}): they ignore the tool and its calls get unknown_tool"),
        );
    }
    rejection(&mut redis, names, tool, &mut case).await;
    let retry = &value["retry"];
    let idempotent = retry["idempotent"].as_bool().unwrap_or(false);
    let max_attempts = retry["max_attempts"].as_f64().unwrap_or(1.0);
    if !idempotent || max_attempts < 2.0 {
        case.fail(
            "not_the_probe",
            "the conformance probe is idempotent with 3 deliveries (PROTOCOL §7.11)",
        );
        return (case, None);
    }
    let live: usize = redis::cmd("ZCOUNT")
        .arg(names.tool_workers_key(tool))
        .arg(unix_ms())
        .arg("+inf")
        .query_async(&mut redis)
        .await
        .unwrap_or(0);
    if live == 0 {
        case.fail(
            "no_live_worker",
            format!("no live worker in {}", names.tool_workers_key(tool)),
        );
        return (case, None);
    }
    let js = jetstream::new(nats.clone());
    let Some((ack_wait, max_deliver)) = consumer(&js, names, tool, &value, &mut case).await else {
        return (case, None);
    };
    let timeout_ms = value["timeout_ms"]
        .as_f64()
        .map_or(10_000, |ms| ms.max(1.0) as u64);
    let probe = Probe {
        nats: nats.clone(),
        js,
        redis,
        names: names.clone(),
        tool: tool.to_string(),
        timeout_ms,
        ack_wait,
        max_deliver,
    };
    (case, Some(probe))
}

/// Integer fields of the definition written as anything but integers (`2000.0`).
fn check_types(definition: &Value, case: &mut Case) {
    for (path, field) in [
        ("timeout_ms", &definition["timeout_ms"]),
        ("retry.max_attempts", &definition["retry"]["max_attempts"]),
    ] {
        if field.is_number() && !field.is_u64() {
            case.fail(
                "definition_type",
                format!("{path} is {field}, not an integer (PROTOCOL §3.8): coordinators refuse the definition"),
            );
        }
    }
    for field in ["name", "description"] {
        if !definition[field].is_string() {
            case.fail("definition_type", format!("{field} is not a string"));
        }
    }
    if !definition["input_schema"].is_object() {
        case.fail("definition_type", "input_schema is not an object");
    }
}

/// A coordinator's rejection of the definition, as written back to the registry.
async fn rejection(redis: &mut RedisConnection, names: &Names, tool: &str, case: &mut Case) {
    let rejected: Option<String> = redis::cmd("HGET")
        .arg(names.rejected_definitions_key())
        .arg(tool)
        .query_async(redis)
        .await
        .unwrap_or(None);
    if let Some(rejected) = rejected {
        case.fail(
            "definition_rejected",
            format!("a coordinator rejected the definition: {rejected}"),
        );
    }
}

/// The tool consumer's ack wait and max deliver, checked against the definition (§7.1).
async fn consumer(
    js: &jetstream::Context,
    names: &Names,
    tool: &str,
    definition: &Value,
    case: &mut Case,
) -> Option<(Duration, i64)> {
    let durable = names.tool_consumer(tool);
    let stream = match js.get_stream(names.jobs_stream()).await {
        Ok(stream) => stream,
        Err(error) => {
            case.fail(
                "no_stream",
                format!("stream {}: {error}", names.jobs_stream()),
            );
            return None;
        }
    };
    let info = match stream.consumer_info(&durable).await {
        Ok(info) => info,
        Err(error) => {
            case.fail(
                "no_consumer",
                format!("consumer {durable}: {error} (PROTOCOL §7.1 step 2)"),
            );
            return None;
        }
    };
    if info.config.filter_subject != names.job_subject(tool) {
        case.fail(
            "consumer_filter",
            format!(
                "consumer {durable} filters {}, not {}",
                info.config.filter_subject,
                names.job_subject(tool)
            ),
        );
    }
    let wanted = definition["retry"]["max_attempts"].as_f64().unwrap_or(1.0) as i64;
    if info.config.max_deliver != wanted {
        case.fail(
            "consumer_drift",
            format!(
                "consumer {durable} has max_deliver {}, the definition {wanted} (PROTOCOL §7.1)",
                info.config.max_deliver
            ),
        );
    }
    Some((info.config.ack_wait, info.config.max_deliver))
}
