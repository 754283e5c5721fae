//! A worker serving one tool, written against the SDK alone (the README's "Writing a
//! tool"): `cargo run -p toolfleet-worker --example writing_a_tool`. It must never need
//! more than `toolfleet-worker` and `toolfleet-common`: no pack, no database.

use std::time::Duration;

use serde_json::json;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_worker::{Tool, ToolContext, ToolOutput, WorkerConfig};

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct CustomerArgs {
    #[serde(rename = "customerId")]
    customer_id: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let telemetry = telemetry::init(&TelemetryConfig::from_env("my-worker")?)?;
    // Cancelled at SIGTERM or Ctrl-C; `run` then drains in-flight calls and returns.
    let shutdown = toolfleet_common::shutdown::on_signal();

    let tool = Tool::builder("crm.getOpenInvoices", "Get the customer's open invoices")
        .waiting_hint("checking your billing")
        .idempotent(3)
        .timeout(Duration::from_secs(2))
        .handler(|ctx: ToolContext, args: CustomerArgs| async move {
            // ctx.tenant_id comes from the turn, never from the model's arguments.
            Ok(ToolOutput::new(json!({
                "tenant": ctx.tenant_id,
                "customer": args.customer_id,
            }))
            .with_summary("You have no open invoices."))
        });
    let outcome = toolfleet_worker::run(WorkerConfig::from_env()?, vec![tool], shutdown).await;

    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(outcome?)
}
