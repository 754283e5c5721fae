//! A tool: one async fn with typed arguments, plus its definition.
//!
//! Owns the SDK's tool types (`Tool`, `ToolBuilder`, `ToolContext`, `ToolOutput`,
//! `ToolError`) and the input schema generated from the argument type. It must never do
//! I/O or know any transport: serving, retries and results belong to the runner.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};
use toolfleet_common::call::codes;
use toolfleet_common::{CallError, RetryPolicy, ToolDefinition};

use crate::schema::input_schema_of;
pub use crate::schema::schema_of;

/// What a tool knows about the call it serves.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// The tenant, from the turn; never from the model's arguments.
    pub tenant_id: String,
    /// The turn id.
    pub turn_id: String,
    /// The call id.
    pub call_id: String,
    /// The frontend's session id.
    pub session_id: Option<String>,
    /// The turn's deadline in Unix milliseconds.
    pub deadline_unix_ms: u64,
    /// Delivery attempt, starting at 1.
    pub attempt: u32,
    /// The turn's free-form context (customer id, caller phone, ...).
    pub context: Map<String, Value>,
    /// Fires when the caller cancels the turn (PROTOCOL §9.6): the call's result is no
    /// longer wanted, so a tool that can stop early should (cooperative; a result still
    /// returned is dropped).
    pub cancellation: CancellationToken,
}

impl ToolContext {
    /// A context for calling a tool directly ([`Tool::call`]: unit tests, local runs):
    /// `tenant_id` with the turn's `context`, turn `t`, call `c`, no session, no deadline,
    /// first attempt. The runner builds its contexts from the job instead.
    pub fn new(tenant_id: impl Into<String>, context: Map<String, Value>) -> Self {
        Self {
            tenant_id: tenant_id.into(),
            turn_id: "t".into(),
            call_id: "c".into(),
            session_id: None,
            deadline_unix_ms: u64::MAX,
            attempt: 1,
            context,
            cancellation: CancellationToken::new(),
        }
    }
}

/// A tool's successful output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// The JSON result handed to the model.
    pub value: Value,
    /// One spoken sentence summarising the result, used by the template narrator.
    pub summary: Option<String>,
}

impl ToolOutput {
    /// A result without a summary.
    pub fn new(value: Value) -> Self {
        Self {
            value,
            summary: None,
        }
    }

    /// Adds a spoken summary.
    pub fn with_summary(mut self, summary: impl Into<String>) -> Self {
        self.summary = Some(summary.into());
        self
    }
}

/// A tool's failure: a stable code, a message, whether a retry could succeed, and
/// optionally the sentence the end user may hear about it.
///
/// `ToolError::fatal(code, message)` fails for good and `ToolError::retryable(code,
/// message)` may pass on another try. When a definite failure has a reason the user can
/// act on, add it with [`CallError::with_user_message`]:
/// `ToolError::fatal("customer_not_found", format!("no customer {id:?}"))
/// .with_user_message("I couldn't find a customer with that id.")`. The narrator speaks
/// that sentence when every call of the turn failed that way (instead of its generic
/// fallback line), so it must be safe to show the user; `message` is never spoken.
pub type ToolError = CallError;

/// The future a tool returns.
pub type ToolFuture = BoxFuture<'static, Result<ToolOutput, ToolError>>;

type Handler = dyn Fn(ToolContext, Value) -> ToolFuture + Send + Sync;

/// A registered tool: its definition and its handler.
#[derive(Clone)]
pub struct Tool {
    definition: ToolDefinition,
    handler: Arc<Handler>,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.definition.name)
            .finish()
    }
}

impl Tool {
    /// Starts a tool definition.
    pub fn builder(name: impl Into<String>, description: impl Into<String>) -> ToolBuilder {
        ToolBuilder {
            definition: ToolDefinition::new(name, description),
            allow_unknown_arguments: false,
        }
    }

    /// A tool from a finished definition and a handler of the raw JSON arguments, for
    /// adapters and wrappers; the definition's input schema is used as given.
    pub fn from_fn<F>(definition: ToolDefinition, handler: F) -> Tool
    where
        F: Fn(ToolContext, Value) -> ToolFuture + Send + Sync + 'static,
    {
        Tool {
            definition,
            handler: Arc::new(handler),
        }
    }

    /// The tool's definition.
    pub fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    /// Whether `other` is this very tool: the same definition and the same handler (a
    /// clone is; a tool built again from the same parts is not).
    pub(crate) fn same_as(&self, other: &Tool) -> bool {
        self.definition == other.definition && Arc::ptr_eq(&self.handler, &other.handler)
    }

    /// Calls the tool as the fleet would (unit tests, local runs): `arguments` are first
    /// checked against the input schema, as the coordinator checks every call, and
    /// arguments it would refuse fail with `invalid_arguments` without running the
    /// handler (see [`crate::schema::check_arguments`] for what is checked).
    pub fn call(&self, ctx: ToolContext, arguments: Value) -> ToolFuture {
        if let Err(reason) =
            crate::schema::check_arguments(&self.definition.input_schema, &arguments)
        {
            let error = CallError::fatal(codes::INVALID_ARGUMENTS, reason);
            return Box::pin(std::future::ready(Err(error)));
        }
        self.run(ctx, arguments)
    }

    /// Runs the handler on arguments the coordinator has already checked.
    pub(crate) fn run(&self, ctx: ToolContext, arguments: Value) -> ToolFuture {
        (self.handler)(ctx, arguments)
    }
}

/// Builds a [`Tool`].
#[derive(Debug, Clone)]
pub struct ToolBuilder {
    definition: ToolDefinition,
    allow_unknown_arguments: bool,
}

impl ToolBuilder {
    /// What the assistant is doing while the tool runs ("checking your billing").
    pub fn waiting_hint(mut self, hint: impl Into<String>) -> Self {
        self.definition.waiting_hint = Some(hint.into());
        self
    }

    /// What the tool gives, as the user hears it ("your order status"); the narrator
    /// says it where it would otherwise have nothing to call the tool by.
    pub fn spoken_name(mut self, name: impl Into<String>) -> Self {
        self.definition.spoken_name = Some(name.into());
        self
    }

    /// Per-call timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.definition.timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// Marks the tool idempotent: a call is redelivered to another worker when its
    /// worker dies, up to `max_attempts` deliveries.
    pub fn idempotent(mut self, max_attempts: u32) -> Self {
        self.definition.retry = RetryPolicy {
            idempotent: true,
            max_attempts: max_attempts.max(1),
        };
        self
    }

    /// Marks the tool as reading tenant data.
    pub fn tenant_scoped(mut self) -> Self {
        self.definition.tenant_scoped = true;
        self
    }

    /// Accepts arguments the argument type does not name (refused by default: the
    /// input schema says `additionalProperties: false`, so the coordinator answers
    /// `invalid_arguments` before the call reaches a worker).
    pub fn allow_unknown_arguments(mut self) -> Self {
        self.allow_unknown_arguments = true;
        self
    }

    /// Sets the JSON Schema of the result, checked before the result is published.
    pub fn output_schema(mut self, schema: Value) -> Self {
        self.definition.output_schema = Some(schema);
        self
    }

    /// Finishes the tool with `handler`; the input schema is generated from `A`. A tool
    /// without arguments takes `()`: its input schema is the empty object, and a call
    /// with `{}` (or no arguments) runs it.
    pub fn handler<A, F, Fut>(mut self, handler: F) -> Tool
    where
        A: DeserializeOwned + schemars::JsonSchema + Send + 'static,
        F: Fn(ToolContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<ToolOutput, ToolError>> + Send + 'static,
    {
        let schema = input_schema_of::<A>(self.allow_unknown_arguments);
        let no_arguments = crate::schema::is_unit(&schema);
        self.definition.input_schema = if no_arguments {
            crate::schema::no_arguments(self.allow_unknown_arguments)
        } else {
            schema
        };
        let handler = Arc::new(handler);
        let erased = move |ctx: ToolContext, arguments: Value| -> ToolFuture {
            let handler = Arc::clone(&handler);
            let arguments = if no_arguments { Value::Null } else { arguments };
            Box::pin(async move {
                let args: A = serde_json::from_value(arguments).map_err(|e| {
                    CallError::fatal(codes::BAD_ARGUMENTS, format!("arguments: {e}"))
                })?;
                handler(ctx, args).await
            })
        };
        Tool {
            definition: self.definition,
            handler: Arc::new(erased),
        }
    }

    /// Finishes the tool with a handler of typed arguments and output: the input and
    /// output schemas are generated from `A` and `O`, the output's `Display` is the
    /// spoken summary (so narration never reads out JSON), and the handler's error
    /// converts into a [`ToolError`]. The `#[tool]` attribute expands to this.
    pub fn typed<A, O, E, F, Fut>(mut self, handler: F) -> Tool
    where
        A: DeserializeOwned + schemars::JsonSchema + Send + 'static,
        O: Serialize + schemars::JsonSchema + std::fmt::Display,
        E: Into<ToolError>,
        F: Fn(ToolContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, E>> + Send + 'static,
    {
        self.definition.output_schema = Some(schema_of::<O>());
        self.handler(move |ctx: ToolContext, args: A| {
            let run = handler(ctx, args);
            async move {
                let output = run.await.map_err(Into::into)?;
                let value = serde_json::to_value(&output)
                    .map_err(|e| CallError::fatal(codes::INVALID_RESULT, format!("output: {e}")))?;
                Ok(ToolOutput::new(value).with_summary(output.to_string()))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct Range {
        #[schemars(range(min = 1, max = 10))]
        n: u32,
    }

    #[tokio::test]
    async fn call_refuses_what_the_coordinator_refuses() {
        let tool =
            Tool::builder("n.echo", "").handler(|_ctx: ToolContext, args: Range| async move {
                Ok(ToolOutput::new(json!(args.n)))
            });
        let ctx = || ToolContext::new("acme", Map::new());
        for refused in [
            json!({"n": 0}),
            json!({"n": 3, "x": 1}),
            json!({}),
            json!({"n": "3"}),
        ] {
            let error = tool.call(ctx(), refused.clone()).await.err();
            assert_eq!(
                error.map(|e| e.code),
                Some(codes::INVALID_ARGUMENTS.to_string()),
                "{refused}"
            );
        }
        let ok = tool.call(ctx(), json!({"n": 10})).await.ok();
        assert_eq!(ok.map(|o| o.value), Some(json!(10)));
    }

    #[tokio::test]
    async fn a_tool_without_arguments_takes_the_empty_object() {
        let tool = Tool::builder("clock.now", "")
            .handler(|_ctx: ToolContext, (): ()| async move { Ok(ToolOutput::new(json!("noon"))) });
        assert_eq!(
            tool.definition().input_schema,
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        );
        let ctx = || ToolContext::new("acme", Map::new());
        let ok = tool.call(ctx(), json!({})).await.ok();
        assert_eq!(ok.map(|o| o.value), Some(json!("noon")));
        let extra = tool.call(ctx(), json!({"at": 1})).await.err();
        assert_eq!(
            extra.map(|e| e.code),
            Some(codes::INVALID_ARGUMENTS.to_string())
        );
    }

    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct Args {
        id: String,
    }

    #[tokio::test]
    async fn a_tool_error_carries_its_user_message() {
        let tool =
            Tool::builder("crm.lookup", "").handler(|_ctx: ToolContext, args: Args| async move {
                Err::<ToolOutput, _>(
                    ToolError::fatal("customer_not_found", format!("no customer {:?}", args.id))
                        .with_user_message("I couldn't find a customer with that id."),
                )
            });
        let ctx = ToolContext::new("acme", Map::new());
        let error = tool
            .call(ctx, serde_json::json!({"id": "nobody"}))
            .await
            .err();
        assert_eq!(
            error,
            Some(CallError {
                code: "customer_not_found".into(),
                message: "no customer \"nobody\"".into(),
                retryable: false,
                user_message: Some("I couldn't find a customer with that id.".into()),
                retry_after_ms: None,
            })
        );
    }
}
