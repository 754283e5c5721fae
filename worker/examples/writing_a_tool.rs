//! A worker serving one tool, written against the SDK alone (docs/TOOLS.md, "Writing a
//! tool"): `cargo run -p toolfleet-worker --example writing_a_tool`. It must never need
//! more than `toolfleet-worker`, serde and schemars: no pack, no database.

use std::fmt;

use toolfleet_worker::prelude::*;

#[derive(Deserialize, JsonSchema)]
struct CustomerArgs {
    #[serde(rename = "customerId")]
    customer_id: String,
}

#[derive(Serialize, JsonSchema)]
struct Invoices {
    customer: String,
    open: Vec<String>,
}

// The summary the assistant speaks: never raw JSON.
impl fmt::Display for Invoices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "You have {} open invoices.", self.open.len())
    }
}

/// Get the customer's open invoices.
#[tool(
    name = "crm.getOpenInvoices",
    waiting_hint = "checking your billing",
    idempotent = 3,
    timeout_ms = 2000
)]
async fn open_invoices(args: CustomerArgs, ctx: &ToolContext) -> Result<Invoices, BillingError> {
    // ctx.tenant_id comes from the turn, never from the model's arguments.
    if ctx.tenant_id.is_empty() {
        return Err(BillingError::NoTenant);
    }
    Ok(Invoices {
        customer: args.customer_id,
        open: Vec::new(),
    })
}

// Each variant is a stable error code (`no_tenant`); the doc comment is the message.
#[derive(Debug, ToolError)]
enum BillingError {
    /// the turn names no tenant
    NoTenant,
    /// the billing system did not answer
    #[tool_error(code = "billing_unavailable", retryable)]
    #[allow(dead_code)]
    Unavailable,
}

// Settings and telemetry from the environment; SIGTERM or Ctrl-C drains and withdraws.
#[toolfleet_worker::main(tools = [open_invoices])]
async fn main() {}
