//! `#[tool]` on a plain async fn: the definition comes from the attributes and the doc
//! comment, the schemas from the argument and output types, the summary from the
//! output's `Display`, and the fn's own error converts into a `ToolError` through
//! `#[derive(ToolError)]` (codes, retryability and user messages per variant). Calls
//! the tools directly; never starts a worker.

use std::fmt;

use toolfleet_worker::prelude::*;

#[derive(Deserialize, JsonSchema)]
struct AddArgs {
    a: f64,
    b: f64,
}

#[derive(Serialize, JsonSchema)]
struct Sum {
    sum: f64,
}

impl fmt::Display for Sum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "The sum is {}.", self.sum)
    }
}

#[derive(Debug, ToolError)]
enum MathError {
    /// the sum is not finite
    Overflow,
}

/// An upstream failure, spoken through `Display`.
#[derive(Debug, ToolError)]
#[tool_error(display)]
enum UpstreamError {
    #[tool_error(code = "upstream_down", retryable)]
    Down { after_ms: u64 },
    #[tool_error(user_message = "That account is closed.")]
    AccountClosed(#[allow(dead_code)] String),
}

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Down { after_ms } => write!(f, "no answer after {after_ms} ms"),
            Self::AccountClosed(id) => write!(f, "account {id} is closed"),
        }
    }
}

/// Adds two numbers.
/// Both must be finite.
#[tool(
    name = "math.add",
    idempotent = 3,
    timeout_ms = 1500,
    waiting_hint = "adding",
    spoken_name = "the sum"
)]
async fn add(args: AddArgs, ctx: &ToolContext) -> Result<Sum, MathError> {
    assert_eq!(ctx.tenant_id, "acme");
    let sum = args.a + args.b;
    if sum.is_finite() {
        Ok(Sum { sum })
    } else {
        Err(MathError::Overflow)
    }
}

/// Echoes anything.
#[tool(allow_unknown_arguments)]
async fn echo(args: AddArgs) -> Result<Sum, ToolError> {
    Ok(Sum { sum: args.a })
}

fn ctx() -> ToolContext {
    ToolContext::new("acme", Default::default())
}

#[test]
fn the_definition_comes_from_attributes_doc_and_types() {
    let tool = add_tool();
    let def = tool.definition();
    assert_eq!(def.name, "math.add");
    assert_eq!(def.description, "Adds two numbers. Both must be finite.");
    assert_eq!(def.waiting_hint.as_deref(), Some("adding"));
    assert_eq!(def.spoken_name.as_deref(), Some("the sum"));
    assert_eq!(def.timeout_ms, 1500);
    assert!(def.retry.idempotent);
    assert_eq!(def.retry.max_attempts, 3);
    assert_eq!(
        def.input_schema,
        json!({
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
            "additionalProperties": false,
        })
    );
    assert_eq!(
        def.output_schema,
        Some(json!({
            "type": "object",
            "properties": {"sum": {"type": "number"}},
            "required": ["sum"],
        }))
    );
    let echo = echo_tool();
    assert_eq!(echo.definition().name, "echo");
    assert!(echo
        .definition()
        .input_schema
        .get("additionalProperties")
        .is_none());
}

#[tokio::test]
async fn output_display_is_the_summary_and_errors_convert() {
    let out = add_tool()
        .call(ctx(), json!({"a": 40, "b": 2}))
        .await
        .expect("a sum");
    assert_eq!(out.value, json!({"sum": 42.0}));
    assert_eq!(out.summary.as_deref(), Some("The sum is 42."));

    let error = add_tool()
        .call(ctx(), json!({"a": f64::MAX, "b": f64::MAX}))
        .await
        .expect_err("overflow");
    assert_eq!(error.code, "overflow");
    assert!(!error.retryable);
}

#[test]
fn derived_tool_errors_carry_code_retryability_message_and_user_message() {
    let overflow = ToolError::from(MathError::Overflow);
    assert_eq!(
        (
            overflow.code.as_str(),
            overflow.message.as_str(),
            overflow.retryable
        ),
        ("overflow", "the sum is not finite", false)
    );
    let down = ToolError::from(UpstreamError::Down { after_ms: 300 });
    assert_eq!(
        (down.code.as_str(), down.message.as_str(), down.retryable),
        ("upstream_down", "no answer after 300 ms", true)
    );
    assert_eq!(down.user_message, None);
    let closed = ToolError::from(UpstreamError::AccountClosed("a-1".into()));
    assert_eq!(closed.code, "account_closed");
    assert_eq!(closed.message, "account a-1 is closed");
    assert_eq!(
        closed.user_message.as_deref(),
        Some("That account is closed.")
    );
}
