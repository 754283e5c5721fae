//! Tool definitions, the catalog formats frontends hand to models, and tool-name rules.
//!
//! Owns `ToolDefinition` as workers announce it, the mapping between fleet names
//! (`crm.getOpenInvoices`) and model-facing names (`crm__getOpenInvoices`), and the
//! catalog renderings (OpenAI, Anthropic, MCP, native). Never registers a tool (the
//! worker SDK does) and never judges a call against a schema (the coordinator does).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Default per-call timeout when a tool names none.
pub const DEFAULT_TOOL_TIMEOUT_MS: u64 = 10_000;
/// Default number of deliveries for an idempotent tool.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// The largest tool definition (its JSON, the `definition` field of
/// `<p>:{registry}:tool:<tool>`) coordinators read, in bytes: a larger one is refused by
/// its length alone, never fetched, and the worker SDK refuses to register it.
pub const MAX_DEFINITION_BYTES: usize = 64 * 1024;
/// The largest `by` field (`<redis user>/<worker id>`) beside a definition coordinators
/// read, in bytes; a definition with a longer one is refused like an oversize one.
pub const MAX_REGISTERED_BY_BYTES: usize = 1024;

/// What a worker announces about one tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ToolDefinition {
    /// Unique name; also a NATS subject suffix (`<prefix>.jobs.<name>`).
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON Schema of the arguments.
    pub input_schema: Value,
    /// JSON Schema of the result, checked by the worker when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Value>,
    /// What the assistant is doing while the tool runs, as a gerund phrase
    /// ("checking your billing"); composed into the acknowledgement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_hint: Option<String>,
    /// What the tool gives, as a noun phrase a person hears ("your order status",
    /// "the weather forecast"); the narrator says it instead of the tool's name
    /// ("I couldn't get your order status right now."), which is never spoken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spoken_name: Option<String>,
    /// Per-call timeout in milliseconds.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// Retry policy.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Whether the tool reads tenant data (the tenant comes from the turn, never from
    /// arguments).
    #[serde(default)]
    pub tenant_scoped: bool,
}

/// A coordinator's refusal of what a worker sent (a definition it cannot read, a result
/// it cannot record), written back to the registry (`Names::rejected_definitions_key`,
/// `Names::rejected_results_key`, field = the tool) so the tool's workers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Rejection {
    /// Why, in words (the decoder's complaint).
    pub reason: String,
    /// When, in Unix milliseconds.
    pub at_unix_ms: u64,
    /// The turn of a refused result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    /// The call of a refused result, when its body named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

fn default_timeout() -> u64 {
    DEFAULT_TOOL_TIMEOUT_MS
}

/// Whether a call may be delivered again after its worker disappeared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RetryPolicy {
    /// Idempotent tools are redelivered to another worker when one dies mid-call;
    /// others get a `call_interrupted` error instead of a second execution.
    #[serde(default)]
    pub idempotent: bool,
    /// Deliveries allowed for an idempotent call (including the first); default 3.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
}

fn default_max_attempts() -> u32 {
    DEFAULT_MAX_ATTEMPTS
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            idempotent: false,
            max_attempts: 1,
        }
    }
}

impl RetryPolicy {
    /// An idempotent tool with [`DEFAULT_MAX_ATTEMPTS`] deliveries.
    pub fn idempotent() -> Self {
        Self {
            idempotent: true,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }
}

/// Why a tool name cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid tool name {name:?}: {reason}")]
pub struct ToolNameError {
    /// The rejected name.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Checks that `name` can be a subject suffix: 1–128 characters of `[A-Za-z0-9_.-]`,
/// no empty dot-separated token.
pub fn validate_tool_name(name: &str) -> Result<(), ToolNameError> {
    let err = |reason| ToolNameError {
        name: name.to_string(),
        reason,
    };
    if name.is_empty() || name.len() > 128 {
        return Err(err("must be 1 to 128 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err(err(
            "only ASCII letters, digits, '_', '-' and '.' are allowed",
        ));
    }
    if name.split('.').any(str::is_empty) {
        return Err(err("dots must separate non-empty parts"));
    }
    Ok(())
}

/// Model providers allow only `[A-Za-z0-9_-]` in function names, so dotted names are
/// exported with `__` in place of each `.`; [`canonical_tool_name`] maps them back.
pub fn provider_tool_name(name: &str) -> String {
    name.replace('.', "__")
}

/// The registry name for a name the model used: `crm__getOpenInvoices` →
/// `crm.getOpenInvoices`.
pub fn canonical_tool_name(name: &str) -> String {
    name.replace("__", ".")
}

/// Catalog formats a frontend can ask for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum CatalogFormat {
    /// OpenAI Chat Completions `tools` entries.
    #[default]
    Openai,
    /// Anthropic Messages `tools` entries.
    Anthropic,
    /// Model Context Protocol `tools/list` entries.
    Mcp,
    /// toolfleet's own `ToolDefinition`s.
    Native,
}

impl std::str::FromStr for CatalogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "openai" => Ok(Self::Openai),
            "anthropic" => Ok(Self::Anthropic),
            "mcp" => Ok(Self::Mcp),
            "native" => Ok(Self::Native),
            other => Err(format!(
                "unknown catalog format {other:?} (openai, anthropic, mcp, native)"
            )),
        }
    }
}

/// A catalog request (core NATS request on `<prefix>.catalog`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CatalogRequest {
    /// The format wanted.
    #[serde(default)]
    pub format: CatalogFormat,
    /// Restrict to the tools this tenant may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
}

/// The catalog reply: the tools in the requested format.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CatalogResponse {
    /// The format of `tools`.
    pub format: CatalogFormat,
    /// One entry per tool, sorted by name.
    pub tools: Vec<Value>,
    /// Set, with no tools, when the request could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<crate::call::CallError>,
}

impl ToolDefinition {
    /// A definition with the given name and description, an empty-object schema and
    /// default timeout and retry policy.
    pub fn new(name: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            input_schema: json!({"type": "object"}),
            output_schema: None,
            waiting_hint: None,
            spoken_name: None,
            timeout_ms: DEFAULT_TOOL_TIMEOUT_MS,
            retry: RetryPolicy::default(),
            tenant_scoped: false,
        }
    }

    /// This definition as one catalog entry in `format`.
    pub fn to_catalog_entry(&self, format: CatalogFormat) -> Value {
        match format {
            CatalogFormat::Openai => json!({
                "type": "function",
                "function": {
                    "name": provider_tool_name(&self.name),
                    "description": self.description,
                    "parameters": self.input_schema,
                }
            }),
            CatalogFormat::Anthropic => json!({
                "name": provider_tool_name(&self.name),
                "description": self.description,
                "input_schema": self.input_schema,
            }),
            CatalogFormat::Mcp => {
                let mut entry = json!({
                    "name": self.name,
                    "description": self.description,
                    "inputSchema": self.input_schema,
                    "annotations": {
                        "idempotentHint": self.retry.idempotent,
                    }
                });
                if let (Some(schema), Some(obj)) = (&self.output_schema, entry.as_object_mut()) {
                    obj.insert("outputSchema".into(), schema.clone());
                }
                entry
            }
            CatalogFormat::Native => serde_json::to_value(self).unwrap_or(Value::Null),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_names() {
        for good in ["crm.getOpenInvoices", "get_faqs"] {
            assert!(validate_tool_name(good).is_ok(), "{good}");
        }
        for bad in ["a..b", "a b", "a.>", ""] {
            assert!(validate_tool_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            provider_tool_name("crm.getOpenInvoices"),
            "crm__getOpenInvoices"
        );
        assert_eq!(
            canonical_tool_name("crm__getOpenInvoices"),
            "crm.getOpenInvoices"
        );
    }

    #[test]
    fn retry_policy_fields_default() {
        let p: RetryPolicy = serde_json::from_str(r#"{"idempotent": true}"#).unwrap_or_default();
        assert_eq!(p, RetryPolicy::idempotent());
    }

    #[test]
    fn catalog_entries() {
        let d = ToolDefinition::new("crm.getOpenInvoices", "Open invoices");
        let o = d.to_catalog_entry(CatalogFormat::Openai);
        assert_eq!(o["function"]["name"], "crm__getOpenInvoices");
        let a = d.to_catalog_entry(CatalogFormat::Anthropic);
        assert_eq!(a["input_schema"]["type"], "object");
        let m = d.to_catalog_entry(CatalogFormat::Mcp);
        assert_eq!(m["inputSchema"]["type"], "object");
        assert_eq!(m["name"], "crm.getOpenInvoices");
    }
}
