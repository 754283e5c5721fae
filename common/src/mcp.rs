//! What maps to what between fleet tools and the Model Context Protocol, both ways, on
//! the official SDK's types (`rmcp::model`; feature `mcp`).
//!
//! Owns the mapping only: an MCP server's tool as a fleet [`ToolDefinition`] and a fleet
//! definition as an MCP [`McpTool`]; an MCP `tools/call` result as a fleet outcome and a
//! fleet [`CallResult`] as an MCP [`CallToolResult`]. Used by the worker's `mcp` pack
//! (MCP servers served as fleet tools) and by anything that offers the fleet to MCP
//! clients. It never connects anywhere and never decides retries: the worker's runner
//! does, from the [`RetryPolicy`] derived here.
//!
//! | MCP | fleet |
//! |---|---|
//! | tool `name` of server `S` | tool `S.name` |
//! | `description` (else `title`) | `description` |
//! | `inputSchema` / `outputSchema` | `input_schema` / `output_schema` |
//! | `annotations.readOnlyHint` or `idempotentHint` true | `retry: idempotent` (redelivered up to 3 times) |
//! | neither | `retry: not idempotent` (one delivery; an interrupted call is `call_interrupted`) |
//! | result `isError: true` | failed, code `tool_error`, the text blocks as the message |
//! | result `structuredContent` | the result, as JSON |
//! | result text blocks only | the result is the joined text (a JSON string), also the spoken summary |
//! | other blocks (image, audio, resource) | the result is `{"text": .., "content": [blocks]}` |

use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool as McpTool, ToolAnnotations};
use serde_json::{json, Value};

use crate::call::codes;
use crate::tool::{validate_tool_name, CatalogFormat, ToolNameError};
use crate::{CallError, CallResult, RetryPolicy, ToolDefinition};

/// The message of an `isError` result that carries no text.
const NO_ERROR_TEXT: &str = "the MCP tool reported an error without a message";

/// What a successful `tools/call` becomes: the result value and the sentence the
/// narrator may speak (text results only; structured ones are never read out).
#[derive(Debug, Clone, PartialEq)]
pub struct McpOutput {
    /// The JSON result handed to the model.
    pub value: Value,
    /// The joined text blocks, when the result is text only.
    pub summary: Option<String>,
}

/// Server `server`'s tool `tool` as a fleet definition named `<server>.<tool>` (default
/// timeout; no waiting hint). Fails when the joined name cannot be a fleet tool name.
pub fn definition_of(server: &str, tool: &McpTool) -> Result<ToolDefinition, ToolNameError> {
    let name = format!("{server}.{}", tool.name);
    validate_tool_name(&name)?;
    let description = tool
        .description
        .as_deref()
        .map(str::to_string)
        .or_else(|| tool.title.clone())
        .unwrap_or_default();
    let mut definition = ToolDefinition::new(name, description);
    definition.input_schema = Value::Object(tool.input_schema.as_ref().clone());
    definition.output_schema = tool
        .output_schema
        .as_ref()
        .map(|s| Value::Object(s.as_ref().clone()));
    definition.retry = retry_policy_of(tool.annotations.as_ref());
    Ok(definition)
}

/// The fleet's retry policy for a tool with `annotations`: a read-only or idempotent
/// tool may run again after a retryable failure or a lost worker; any other runs once.
pub fn retry_policy_of(annotations: Option<&ToolAnnotations>) -> RetryPolicy {
    let safe = annotations
        .is_some_and(|a| a.read_only_hint.unwrap_or(false) || a.idempotent_hint.unwrap_or(false));
    if safe {
        RetryPolicy::idempotent()
    } else {
        RetryPolicy::default()
    }
}

/// A fleet definition as an MCP tool: the `mcp` catalog entry
/// ([`ToolDefinition::to_catalog_entry`]) in the SDK's type.
pub fn tool_of(definition: &ToolDefinition) -> McpTool {
    let entry = definition.to_catalog_entry(CatalogFormat::Mcp);
    serde_json::from_value(entry).unwrap_or_else(|_| {
        McpTool::new(
            definition.name.clone(),
            definition.description.clone(),
            JsonObject::new(),
        )
    })
}

/// A `tools/call` result as the fleet sees it: `isError` is a `tool_error` failure
/// with the server's text; otherwise the structured content, else the text.
pub fn outcome_of(result: CallToolResult) -> Result<McpOutput, CallError> {
    let text = joined_text(&result.content);
    if result.is_error.unwrap_or(false) {
        let message = if text.is_empty() {
            NO_ERROR_TEXT.to_string()
        } else {
            text
        };
        return Err(CallError::fatal(codes::TOOL_ERROR, message));
    }
    if let Some(structured) = result.structured_content {
        return Ok(McpOutput {
            value: structured,
            summary: None,
        });
    }
    let only_text = result
        .content
        .iter()
        .all(|b| matches!(b, ContentBlock::Text(_)));
    if only_text {
        let summary = (!text.is_empty()).then(|| text.clone());
        return Ok(McpOutput {
            value: Value::String(text),
            summary,
        });
    }
    let blocks = serde_json::to_value(&result.content).unwrap_or(Value::Null);
    Ok(McpOutput {
        value: json!({"text": text, "content": blocks}),
        summary: None,
    })
}

/// A fleet call's result as an MCP `tools/call` result: a success carries its value as
/// structured content (objects) and as text (the spoken summary, else the JSON); a
/// failure is `isError` with its message.
pub fn call_tool_result_of(result: &CallResult) -> CallToolResult {
    if let Some(error) = &result.error {
        return CallToolResult::error(vec![ContentBlock::text(error.message.clone())]);
    }
    let value = result.result.clone().unwrap_or(Value::Null);
    let text = match (&result.summary, &value) {
        (Some(summary), _) => summary.clone(),
        (None, Value::String(s)) => s.clone(),
        (None, other) => other.to_string(),
    };
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    if value.is_object() {
        out.structured_content = Some(value);
    }
    out
}

/// The text blocks of `content`, one per line.
fn joined_text(content: &[ContentBlock]) -> String {
    content
        .iter()
        .filter_map(ContentBlock::as_text)
        .map(|t| t.text.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::ToolCall;
    use crate::CallState;

    fn mcp_tool(value: Value) -> McpTool {
        serde_json::from_value(value).expect("an MCP tool")
    }

    #[test]
    fn an_mcp_tool_becomes_a_definition_under_its_server() {
        let tool = mcp_tool(json!({
            "name": "forecast",
            "description": "Tomorrow's forecast",
            "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "outputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": true}
        }));
        let def = definition_of("weather", &tool).expect("a definition");
        assert_eq!(def.name, "weather.forecast");
        assert_eq!(def.description, "Tomorrow's forecast");
        assert_eq!(def.input_schema["properties"]["city"]["type"], "string");
        assert_eq!(def.output_schema, Some(json!({"type": "object"})));
        assert_eq!(def.retry, RetryPolicy::idempotent());
        let bad = mcp_tool(json!({"name": "a b", "inputSchema": {"type": "object"}}));
        assert!(definition_of("weather", &bad).is_err());
    }

    #[test]
    fn only_read_only_or_idempotent_tools_run_again() {
        let hints = |v: Value| serde_json::from_value::<ToolAnnotations>(v).ok();
        let idempotent = hints(json!({"idempotentHint": true}));
        let destructive = hints(json!({"readOnlyHint": false, "destructiveHint": true}));
        assert!(retry_policy_of(idempotent.as_ref()).idempotent);
        assert!(!retry_policy_of(destructive.as_ref()).idempotent);
        assert!(!retry_policy_of(None).idempotent);
    }

    #[test]
    fn results_map_to_values_summaries_and_errors() {
        let text = CallToolResult::success(vec![ContentBlock::text("a"), ContentBlock::text("b")]);
        let out = outcome_of(text).expect("success");
        assert_eq!(out.value, json!("a\nb"));
        assert_eq!(out.summary.as_deref(), Some("a\nb"));

        let mut structured = CallToolResult::success(vec![ContentBlock::text("{\"x\":1}")]);
        structured.structured_content = Some(json!({"x": 1}));
        let out = outcome_of(structured).expect("success");
        assert_eq!(out.value, json!({"x": 1}));
        assert_eq!(out.summary, None);

        let image = CallToolResult::success(vec![ContentBlock::image("aGk=", "image/png")]);
        let out = outcome_of(image).expect("success");
        assert_eq!(out.value["content"][0]["type"], "image");

        let failed = CallToolResult::error(vec![ContentBlock::text("refused: no")]);
        let error = outcome_of(failed).expect_err("an error");
        assert_eq!(error.code, codes::TOOL_ERROR);
        assert_eq!(error.message, "refused: no");
        assert!(!error.retryable);
    }

    #[test]
    fn fleet_definitions_and_results_become_mcp_ones() {
        let mut def = ToolDefinition::new("crm.getOpenInvoices", "Open invoices");
        def.output_schema = Some(json!({"type": "object"}));
        let tool = tool_of(&def);
        assert_eq!(tool.name, "crm.getOpenInvoices");
        assert!(tool.output_schema.is_some());

        let call = ToolCall {
            id: "c1".into(),
            name: "crm.getOpenInvoices".into(),
            arguments: json!({}),
            parent_id: None,
        };
        let mut ok = CallResult::success(&call, json!({"open": 2}));
        ok.summary = Some("You have 2 open invoices.".into());
        let mcp = call_tool_result_of(&ok);
        assert_eq!(mcp.structured_content, Some(json!({"open": 2})));
        assert_eq!(joined_text(&mcp.content), "You have 2 open invoices.");

        let failed = CallResult::failure(
            &call,
            CallState::Error,
            CallError::fatal(codes::TOOL_ERROR, "nope"),
        );
        let mcp = call_tool_result_of(&failed);
        assert_eq!(mcp.is_error, Some(true));
        assert_eq!(joined_text(&mcp.content), "nope");
    }
}
