//! One fleet call of an MCP server's tool: a `tools/call` request on the server's
//! current connection, its answer mapped to a fleet result.
//!
//! Owns the request (arguments, `_meta` with the call's trace context and ids) and the
//! mapping of failures to codes: an `isError` result or a JSON-RPC error is `tool_error`
//! (final, with the server's message); a server that is down or whose connection broke
//! mid-call is `mcp_server_unavailable` (retryable: an idempotent tool runs again on the
//! restarted server). It never times out on its own: the runner drops the call at its
//! budget, and dropping an unanswered request sends `notifications/cancelled`.

use rmcp::model::{CallToolRequestParams, RequestParamsMeta};
use rmcp::service::{Peer, RoleClient};
use rmcp::ServiceError;
use serde_json::Value;
use toolfleet_common::call::codes;
use toolfleet_common::mcp::outcome_of;
use toolfleet_common::telemetry;
use toolfleet_worker::tool::{ToolContext, ToolError, ToolOutput};

/// A call could not reach its MCP server (down, restarting, or the connection broke
/// mid-call); retryable.
pub const MCP_SERVER_UNAVAILABLE: &str = "mcp_server_unavailable";

/// `_meta` keys carrying the fleet's ids of the call, for servers that want them.
const META_TENANT: &str = "io.toolfleet/tenantId";
const META_TURN: &str = "io.toolfleet/turnId";
const META_CALL: &str = "io.toolfleet/callId";

/// Calls `tool` of the server named `server` on its current connection `peer` (`None`
/// while the server is down) with `arguments`, for the call described by `ctx`.
pub(crate) async fn call(
    peer: Option<Peer<RoleClient>>,
    server: &str,
    tool: &str,
    ctx: ToolContext,
    arguments: Value,
) -> Result<ToolOutput, ToolError> {
    let Some(peer) = peer else {
        return Err(ToolError::retryable(
            MCP_SERVER_UNAVAILABLE,
            format!("MCP server {server} is not running"),
        ));
    };
    let params = request(tool, &ctx, arguments)?;
    match peer.call_tool(params).await {
        Ok(result) => outcome_of(result).map(|out| ToolOutput {
            value: out.value,
            summary: out.summary,
        }),
        Err(error) => Err(failure(server, error)),
    }
}

/// The `tools/call` parameters: the arguments (an object, or none) and `_meta` with the
/// current span's `traceparent` and the call's ids.
fn request(
    tool: &str,
    ctx: &ToolContext,
    arguments: Value,
) -> Result<CallToolRequestParams, ToolError> {
    let mut params = CallToolRequestParams::new(tool.to_string());
    params.arguments = match arguments {
        Value::Object(map) => Some(map),
        Value::Null => None,
        _ => {
            return Err(ToolError::fatal(
                codes::BAD_ARGUMENTS,
                "the arguments of an MCP tool must be a JSON object",
            ))
        }
    };
    if let Some(traceparent) = telemetry::traceparent(&tracing::Span::current()) {
        params.set_traceparent(&traceparent);
    }
    let meta = params.meta_or_default();
    for (key, value) in [
        (META_TENANT, &ctx.tenant_id),
        (META_TURN, &ctx.turn_id),
        (META_CALL, &ctx.call_id),
    ] {
        meta.0
             .0
            .insert(key.to_string(), Value::String(value.clone()));
    }
    Ok(params)
}

/// A failed request as a fleet error: the server's own refusal is final; a lost or
/// missing connection may pass once the server is back.
fn failure(server: &str, error: ServiceError) -> ToolError {
    match error {
        ServiceError::McpError(error) => ToolError::fatal(codes::TOOL_ERROR, error.message),
        ServiceError::TransportClosed | ServiceError::TransportSend(_) => ToolError::retryable(
            MCP_SERVER_UNAVAILABLE,
            format!("MCP server {server}: {error}"),
        ),
        other => ToolError::fatal(codes::TOOL_ERROR, format!("MCP server {server}: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_carry_the_arguments_and_the_call_ids() {
        let mut ctx = ToolContext::new("acme", serde_json::Map::new());
        ctx.call_id = "call_1".into();
        let params = request("forecast", &ctx, json!({"city": "Oslo"})).expect("params");
        assert_eq!(params.name, "forecast");
        assert_eq!(
            params.arguments,
            json!({"city": "Oslo"}).as_object().cloned()
        );
        let meta = params.meta().expect("meta");
        assert_eq!(meta.0 .0.get(META_TENANT), Some(&json!("acme")));
        assert_eq!(meta.0 .0.get(META_CALL), Some(&json!("call_1")));
        let refused = request("forecast", &ctx, json!([1])).expect_err("not an object");
        assert_eq!(refused.code, codes::BAD_ARGUMENTS);
    }

    #[test]
    fn lost_connections_are_retryable_and_refusals_final() {
        let lost = failure("s", ServiceError::TransportClosed);
        assert_eq!(lost.code, MCP_SERVER_UNAVAILABLE);
        assert!(lost.retryable);
        let refused = failure(
            "s",
            ServiceError::McpError(rmcp::ErrorData::invalid_params("no such city", None)),
        );
        assert_eq!(refused.code, codes::TOOL_ERROR);
        assert_eq!(refused.message, "no such city");
        assert!(!refused.retryable);
    }
}
