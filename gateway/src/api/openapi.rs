//! The parts of the OpenAPI document that no handler's own types describe: the OpenAI
//! Chat Completions request and answer of `/v1/chat/completions`, the MCP transport at
//! `/mcp` (served by the MCP SDK, not by a handler of ours), the health and document
//! routes, the live page, and the request examples, each a request that runs as written
//! against a fleet serving the demo pack.
//!
//! Owns what the document says about those routes; never answers a request. The router
//! (its parent, `api`) registers these docs beside the routes themselves.

use std::borrow::Cow;
use std::sync::Arc;

use aide::axum::routing::ApiMethodDocs;
use aide::axum::ApiRouter;
use aide::generate::{in_context, GenContext};
use aide::openapi::{
    MediaType, Operation, Parameter, ParameterData, ParameterSchemaOrContent, ReferenceOr,
    RequestBody, Response, Responses, SchemaObject, StatusCode as DocStatus,
};
use aide::transform::TransformOperation;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::{Caller, SECURITY_SCHEME};
use crate::error::{described, error_response, string_header};
use crate::extract::ApiJson;
use crate::sse::{sse_event, EVENT_STREAM};
use crate::turns::example_decision;
use crate::Gateway;

/// `JsonSchema` for a type no derive can describe (a body kept as sent JSON, or a marker
/// for what the model server or the MCP SDK writes), its schema written here by hand:
/// the type's own name in the document, and `schema`.
macro_rules! hand_written_schema {
    ($type:ident, $schema:tt) => {
        impl JsonSchema for $type {
            fn schema_name() -> Cow<'static, str> {
                stringify!($type).into()
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                schemars::json_schema!($schema)
            }
        }
    };
}

/// A whole `POST /v1/turns` body that runs as written against the demo pack.
pub fn example_turn() -> Value {
    json!({
        "user_message": "Show me my appointments and my billing",
        "decision": example_decision(),
        "deadline_ms": 5000,
        "context": {"customer_id": "cust_002"}
    })
}

/// A `POST /v1/chat/completions` body: the conversation so far; the gateway offers the
/// tenant's fleet tools and runs the model's calls of them.
pub fn example_chat() -> Value {
    json!({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are the front desk. Customer id: cust_002."},
            {"role": "user", "content": "Show me my appointments and my billing"}
        ],
        "toolfleet": {"max_rounds": 2, "deadline_ms": 5000}
    })
}

/// An MCP `initialize` request, the first message of every session.
fn example_initialize() -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "example-client", "version": "1.0.0"}
        }
    })
}

/// The body of `POST /v1/chat/completions`: an OpenAI Chat Completions request, kept as
/// JSON (every field the caller sends goes to the model server but `toolfleet`).
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct ChatCompletionRequest(pub Value);

hand_written_schema!(ChatCompletionRequest, {
    "description": "An OpenAI Chat Completions request. Every field but `toolfleet` \
        goes to the model server as sent (`model` replaced when the gateway names \
        one); the tenant's fleet tools are offered beside the caller's own `tools`.",
    "type": "object",
    "required": ["messages"],
    "properties": {
        "model": {"type": "string", "description": "The model."},
        "messages": {
            "type": "array",
            "description": "The conversation so far.",
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string",
                             "enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": {"type": ["string", "null"]},
                    "tool_call_id": {"type": "string"}
                }
            }
        },
        "stream": {"type": "boolean",
                   "description": "Answer as Server-Sent Events chunks."},
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}}
        },
        "tools": {
            "type": "array",
            "description": "The caller's own tools (OpenAI function tools); a call of \
                one ends the loop with `finish_reason: \"tool_calls\"`.",
            "items": {"type": "object"}
        },
        "toolfleet": {
            "type": "object",
            "description": "Limits of the tool loop (the tightest of these, the API \
                key's and the gateway's apply); removed before the request goes \
                upstream.",
            "additionalProperties": false,
            "properties": {
                "max_rounds": {"type": "integer", "minimum": 0, "maximum": 1000},
                "max_calls_per_round": {"type": "integer", "minimum": 0, "maximum": 1000},
                "stop_after": {"type": "string", "enum": ["first", "burst"]},
                "deadline_ms": {"type": "integer", "minimum": 1, "maximum": 3600000}
            }
        }
    },
    "examples": [example_chat()]
});

/// An OpenAI chat completion as the gateway answers it.
struct ChatCompletion;

hand_written_schema!(ChatCompletion, {
    "description": "The model's answer (`object` `chat.completion`), its `usage` summed \
        over every round; `toolfleet` says what the loop did.",
    "type": "object",
    "required": ["choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": ["object", "null"]},
        "toolfleet": {"type": "object"}
    }
});

/// A JSON-RPC 2.0 message of the MCP transport.
struct JsonRpcMessage;

hand_written_schema!(JsonRpcMessage, {
    "description": "A JSON-RPC 2.0 message (MCP): a request (`id`, `method`), a \
        notification (`method`, no `id`) or a response (`id`, `result` or `error`).",
    "type": "object",
    "required": ["jsonrpc"],
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": {"type": ["string", "integer"]},
        "method": {"type": "string"},
        "params": {"type": "object"},
        "result": {},
        "error": {"type": "object"}
    }
});

/// The answer of `POST /v1/chat/completions`, documented.
pub struct ChatAnswer(axum::response::Response);

impl IntoResponse for ChatAnswer {
    fn into_response(self) -> axum::response::Response {
        self.0
    }
}

/// `POST /v1/chat/completions` with its documented body and answer.
pub async fn chat_completions(
    state: State<Arc<Gateway>>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ChatCompletionRequest>,
) -> ChatAnswer {
    ChatAnswer(crate::openai::chat_completions(state, caller, headers, ApiJson(body.0)).await)
}

fn media(json_schema: Schema, example: Option<Value>) -> MediaType {
    MediaType {
        example,
        ..crate::error::media(json_schema)
    }
}

fn event_stream_media() -> MediaType {
    media(sse_event(), None)
}

impl aide::OperationOutput for ChatAnswer {
    type Inner = ();

    fn operation_response(ctx: &mut GenContext, _: &mut Operation) -> Option<Response> {
        let schema = ctx.schema.subschema_for::<ChatCompletion>();
        let mut response = Response {
            description: "The model's final answer, or its message calling a tool of the \
                caller's own (`finish_reason` `tool_calls`, the fleet calls' ids in \
                `toolfleet`). With `stream: true`, chat completion chunks as Server-Sent \
                Events, ending with `data: [DONE]`."
                .into(),
            ..Default::default()
        };
        response
            .content
            .insert("application/json".into(), media(schema, None));
        response
            .content
            .insert(EVENT_STREAM.into(), event_stream_media());
        Some(response)
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        let mut out: Vec<(Option<DocStatus>, Response)> = Self::operation_response(ctx, operation)
            .map(|ok| (Some(DocStatus::Code(200)), ok))
            .into_iter()
            .collect();
        for (status, what) in [
            (
                400,
                "The request is malformed (`invalid_request`): `messages` not an array, \
                   a bad `toolfleet` object or `X-Toolfleet-Tools` value.",
            ),
            (
                429,
                "The key's rate is exhausted (`rate_limited`); see `Retry-After`.",
            ),
            (
                503,
                "No model server is configured (`upstream_not_configured`), or the fleet or \
                   the gateway cannot take the request now (`unavailable`, `overloaded`); \
                   see `Retry-After`.",
            ),
        ] {
            out.push((
                Some(DocStatus::Code(status)),
                error_response(ctx, status, what),
            ));
        }
        let upstream = Response {
            description: "The model server's own error, passed through with its status and \
                body (an OpenAI error object `{\"error\": {\"message\", \"type\", \"code\"}}`; \
                502 `upstream_unavailable` and 504 `upstream_timeout` when the gateway \
                could not reach it or it did not answer in time)."
                .into(),
            content: [(
                "application/json".to_string(),
                media(schemars::json_schema!({"type": "object"}), None),
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        for status in [502, 504] {
            out.push((Some(DocStatus::Code(status)), upstream.clone()));
        }
        out
    }
}

/// A documented header parameter.
fn header_parameter(name: &str, description: &str, required: bool, schema: Schema) -> Parameter {
    Parameter::Header {
        parameter_data: ParameterData {
            name: name.into(),
            description: Some(description.into()),
            required,
            deprecated: None,
            format: ParameterSchemaOrContent::Schema(SchemaObject {
                json_schema: schema,
                example: None,
                external_docs: None,
            }),
            example: None,
            examples: Default::default(),
            explode: None,
            extensions: Default::default(),
        },
        style: Default::default(),
    }
}

/// The chat-completions operation's description and header.
pub fn describe_chat(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let mut op = op
        .id("chatCompletions")
        .tag("chat")
        .summary("OpenAI-compatible chat completions with the model's tool loop on the fleet")
        .description(
            "The OpenAI Chat Completions API in front of the configured model server \
             (`TOOLFLEET_UPSTREAM_BASE_URL`): while the model calls fleet tools only, all of \
             a message's calls run as one fleet turn and their results go back to the \
             model; the caller gets the final answer. A frontend changes only its base URL \
             and key. Errors the gateway writes are in the `{\"error\": …}` shape; the \
             model server's own errors pass through as it sent them.",
        );
    let operation = op.inner_mut();
    operation
        .parameters
        .push(ReferenceOr::Item(header_parameter(
            "X-Toolfleet-Tools",
            "`fleet`: offer the tenant's fleet tools beside the caller's own `tools` (for \
             typed clients that build `tools` themselves).",
            false,
            schemars::json_schema!({"type": "string", "enum": ["fleet"]}),
        )));
    set_request_example(operation, example_chat());
    op
}

/// `example` as the JSON request body's example of `operation`.
pub fn set_request_example(operation: &mut Operation, example: Value) {
    if let Some(ReferenceOr::Item(body)) = operation.request_body.as_mut() {
        if let Some(json) = body.content.get_mut("application/json") {
            json.example = Some(example);
        }
    }
}

/// An operation of `/mcp` or a public route, built in the document's generation context.
struct Doc {
    id: &'static str,
    tag: &'static str,
    summary: &'static str,
    description: &'static str,
    /// Whether the API key is required.
    keyed: bool,
}

impl Doc {
    fn operation(&self, ctx: &mut GenContext, responses: Vec<(u16, Response)>) -> Operation {
        let mut operation = Operation {
            operation_id: Some(self.id.into()),
            tags: vec![self.tag.into()],
            summary: Some(self.summary.into()),
            description: Some(self.description.into()),
            ..Default::default()
        };
        operation.security = if self.keyed {
            vec![[(SECURITY_SCHEME.to_string(), Vec::new())]
                .into_iter()
                .collect()]
        } else {
            // Explicitly public: no key is asked for.
            vec![Default::default()]
        };
        let mut all = responses;
        if self.keyed {
            all.push((
                401,
                error_response(
                    ctx,
                    401,
                    "No API key, or an unknown or revoked one (`unauthorized`).",
                ),
            ));
            all.push((
                429,
                error_response(
                    ctx,
                    429,
                    "The key's rate is exhausted, or this address presented too many \
                     unknown keys (`rate_limited`); see `Retry-After`.",
                ),
            ));
        }
        operation.responses = Some(Responses {
            responses: all
                .into_iter()
                .map(|(status, response)| (DocStatus::Code(status), ReferenceOr::Item(response)))
                .collect(),
            ..Default::default()
        });
        operation
    }
}

/// A response of `content_type` with a string body.
fn text_response(description: &str, content_type: &str) -> Response {
    Response {
        description: description.into(),
        content: [(
            content_type.to_string(),
            media(schemars::json_schema!({"type": "string"}), None),
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

/// A response whose body is a JSON-RPC message (or none), or, for the transport's own
/// refusals, the gateway's error shape.
fn jsonrpc_response(ctx: &mut GenContext, description: &str, sse: bool) -> Response {
    let message = ctx.schema.subschema_for::<JsonRpcMessage>();
    let error = ctx.schema.subschema_for::<crate::error::ErrorBody>();
    let either = schemars::json_schema!({"anyOf": [message, error]});
    let mut response = described(description);
    response
        .content
        .insert("application/json".into(), media(either, None));
    if sse {
        response
            .content
            .insert(EVENT_STREAM.into(), event_stream_media());
    }
    response
}

/// The `Mcp-Session-Id` request header.
fn mcp_session() -> ReferenceOr<Parameter> {
    ReferenceOr::Item(header_parameter(
        "Mcp-Session-Id",
        "The session, from the `Mcp-Session-Id` header of the `initialize` answer.",
        false,
        schemars::json_schema!({"type": "string", "minLength": 1}),
    ))
}

/// The `Accept` request header the MCP transport requires, `value`.
fn mcp_accept(value: &str) -> ReferenceOr<Parameter> {
    ReferenceOr::Item(header_parameter(
        "Accept",
        "What the client reads; the MCP transport requires it.",
        true,
        schemars::json_schema!({"type": "string", "enum": [value]}),
    ))
}

/// The refusals every MCP operation may answer.
fn mcp_refusals(ctx: &mut GenContext) -> Vec<(u16, Response)> {
    vec![
        (
            400,
            jsonrpc_response(
                ctx,
                "Not a JSON-RPC message the session can take (a JSON-RPC error, or \
                 `invalid_request`): a request other than `initialize` without a \
                 session, a bad protocol version header.",
                false,
            ),
        ),
        (
            403,
            error_response(
                ctx,
                403,
                "The `Host` header is not one of `TOOLFLEET_GATEWAY_MCP_ALLOWED_HOSTS` \
                 (`forbidden`, against DNS rebinding).",
            ),
        ),
        (
            404,
            jsonrpc_response(
                ctx,
                "No such session (ended, or opened by another key) or no such method.",
                false,
            ),
        ),
        (
            405,
            error_response(ctx, 405, "The transport does not serve this method here."),
        ),
        (
            406,
            error_response(
                ctx,
                406,
                "The `Accept` header lacks what the transport requires \
                 (`not_acceptable`).",
            ),
        ),
    ]
}

/// `POST /mcp`: one JSON-RPC message.
fn mcp_post(ctx: &mut GenContext) -> Operation {
    let post = Doc {
        id: "mcpMessage",
        tag: "mcp",
        summary: "Send an MCP message (Streamable HTTP)",
        description: "The fleet as an MCP server: `initialize` opens a session (its id in \
            the `Mcp-Session-Id` answer header), `tools/list` lists the tenant's fleet \
            tools, `tools/call` runs one as a fleet turn. Requests are answered with JSON or \
            an event stream; notifications and responses with 202.",
        keyed: true,
    };
    let mut responses = vec![
        (
            200,
            jsonrpc_response(
                ctx,
                "The JSON-RPC response, as JSON or as Server-Sent Events.",
                true,
            ),
        ),
        (202, described("A notification or response was accepted.")),
        (
            413,
            error_response(
                ctx,
                413,
                "The body is over the limit (`payload_too_large`).",
            ),
        ),
        (
            415,
            error_response(
                ctx,
                415,
                "The body is not `application/json` (`unsupported_media_type`).",
            ),
        ),
    ];
    responses.extend(mcp_refusals(ctx));
    let mut post_op = post.operation(ctx, responses);
    if let Some(ReferenceOr::Item(ok)) = post_op
        .responses
        .as_mut()
        .and_then(|r| r.responses.get_mut(&DocStatus::Code(200)))
    {
        ok.headers.insert(
            "Mcp-Session-Id".into(),
            ReferenceOr::Item(string_header(
                "The session `initialize` opened; send it with every later message.",
                false,
            )),
        );
    }
    post_op.parameters = vec![
        mcp_accept("application/json, text/event-stream"),
        mcp_session(),
    ];
    post_op.request_body = Some(ReferenceOr::Item(RequestBody {
        description: Some("One JSON-RPC message.".into()),
        content: [(
            "application/json".to_string(),
            media(
                ctx.schema.subschema_for::<JsonRpcMessage>(),
                Some(example_initialize()),
            ),
        )]
        .into_iter()
        .collect(),
        required: true,
        extensions: Default::default(),
    }));
    post_op
}

/// `GET /mcp`: a session's stream of server messages.
fn mcp_get(ctx: &mut GenContext) -> Operation {
    let get = Doc {
        id: "mcpStream",
        tag: "mcp",
        summary: "A session's stream of server messages",
        description: "Server-Sent Events carrying the server's messages to a session \
            (`Mcp-Session-Id`).",
        keyed: true,
    };
    let mut responses = vec![(
        200,
        Response {
            description: "The session's server messages.".into(),
            content: [(EVENT_STREAM.to_string(), event_stream_media())]
                .into_iter()
                .collect(),
            ..Default::default()
        },
    )];
    responses.extend(mcp_refusals(ctx));
    let mut get_op = get.operation(ctx, responses);
    get_op.parameters = vec![mcp_accept(EVENT_STREAM), mcp_session()];
    get_op
}

/// `DELETE /mcp`: ends a session.
fn mcp_delete(ctx: &mut GenContext) -> Operation {
    let delete = Doc {
        id: "mcpEndSession",
        tag: "mcp",
        summary: "End an MCP session",
        description: "Ends the session named by `Mcp-Session-Id`.",
        keyed: true,
    };
    let mut responses = vec![
        (200, described("The session ended.")),
        (202, described("The session ends.")),
    ];
    responses.extend(mcp_refusals(ctx));
    let mut delete_op = delete.operation(ctx, responses);
    delete_op.parameters = vec![mcp_session()];
    delete_op
}

/// The documented `/mcp` operations: `POST` (a JSON-RPC message), `GET` (a session's
/// stream of server messages) and `DELETE` (end a session).
fn mcp_docs(ctx: &mut GenContext) -> [ApiMethodDocs; 3] {
    [
        ApiMethodDocs::new("post", mcp_post(ctx)),
        ApiMethodDocs::new("get", mcp_get(ctx)),
        ApiMethodDocs::new("delete", mcp_delete(ctx)),
    ]
}

/// A route documented as a `GET` anyone may send: health, the document, the live page.
struct PublicGet {
    /// The route.
    path: &'static str,
    /// Its operation.
    doc: Doc,
    /// What a 200 answer is.
    ok: &'static str,
    /// The 200 answer's content type.
    content_type: &'static str,
    /// What a 503 answer means, when it may answer one.
    unavailable: Option<&'static str>,
}

/// The routes documented as [`PublicGet`]s.
const PUBLIC_GETS: [PublicGet; 9] = [
    PublicGet {
        path: "/healthz",
        doc: Doc {
            id: "healthz",
            tag: "meta",
            summary: "Liveness: the process answers",
            description: "`ok` while the process serves HTTP.",
            keyed: false,
        },
        ok: "`ok`.",
        content_type: "text/plain",
        unavailable: None,
    },
    PublicGet {
        path: "/readyz",
        doc: Doc {
            id: "readyz",
            tag: "meta",
            summary: "Readiness: NATS connected and the key database answering",
            description: "`ready` when the gateway can take turns.",
            keyed: false,
        },
        ok: "`ready`.",
        content_type: "text/plain",
        unavailable: Some("NATS or the key database is not reachable (`unavailable`)."),
    },
    PublicGet {
        path: "/openapi.json",
        doc: Doc {
            id: "openapi",
            tag: "meta",
            summary: "This document",
            description: "The OpenAPI document of the gateway.",
            keyed: false,
        },
        ok: "The OpenAPI document.",
        content_type: "application/json",
        unavailable: None,
    },
    PublicGet {
        path: "/docs",
        doc: Doc {
            id: "docs",
            tag: "meta",
            summary: "This document, rendered",
            description: "The OpenAPI document as a page (Redoc).",
            keyed: false,
        },
        ok: "An HTML page.",
        content_type: "text/html",
        unavailable: None,
    },
    PublicGet {
        path: "/",
        doc: Doc {
            id: "livePage",
            tag: "meta",
            summary: "The live turn page",
            description: "Paste a decision and watch every call of its turn; the \
                page asks for an API key and sends it only to this gateway.",
            keyed: false,
        },
        ok: "An HTML page.",
        content_type: "text/html",
        unavailable: None,
    },
    PublicGet {
        path: "/page/config.json",
        doc: Doc {
            id: "livePageConfig",
            tag: "meta",
            summary: "The live page's example decisions and Jaeger address",
            description: "The example decisions the live page offers and the \
                Jaeger base URL it links traces to.",
            keyed: false,
        },
        ok: "JSON.",
        content_type: "application/json",
        unavailable: None,
    },
    PublicGet {
        path: "/page/app.js",
        doc: Doc {
            id: "livePageScript",
            tag: "meta",
            summary: "The live page's script",
            description: "The live page's script (no build step).",
            keyed: false,
        },
        ok: "JavaScript.",
        content_type: "text/javascript",
        unavailable: None,
    },
    PublicGet {
        path: "/page/toolfleet.js",
        doc: Doc {
            id: "gatewayClient",
            tag: "meta",
            summary: "The gateway's JavaScript client",
            description: "The gateway client of `clients/typescript` \
                (`toolfleet.js`, an ES module without dependencies) that the \
                live page submits and follows its turns with; usable by any \
                page served from the gateway.",
            keyed: false,
        },
        ok: "JavaScript.",
        content_type: "text/javascript",
        unavailable: None,
    },
    PublicGet {
        path: "/page/style.css",
        doc: Doc {
            id: "livePageStyle",
            tag: "meta",
            summary: "The live page's style sheet",
            description: "The live page's style sheet.",
            keyed: false,
        },
        ok: "CSS.",
        content_type: "text/css",
        unavailable: None,
    },
];

/// A public `GET` route answering `content_type`.
fn public_get(ctx: &mut GenContext, get: &PublicGet) -> ApiMethodDocs {
    let (ok, content_type) = (get.ok, get.content_type);
    let mut responses = vec![(200, text_response(ok, content_type))];
    if content_type == "application/json" {
        responses[0].1.content.insert(
            content_type.into(),
            media(schemars::json_schema!({"type": "object"}), None),
        );
    }
    if let Some(what) = get.unavailable {
        responses.push((503, error_response(ctx, 503, what)));
    }
    ApiMethodDocs::new("get", get.doc.operation(ctx, responses))
}

/// `router` with the documentation of the routes served outside the documented API
/// router: `/mcp`, health, the document itself and the live page.
pub fn with_route_docs<S>(router: ApiRouter<S>) -> ApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    let (mcp, public) = in_context(|ctx| {
        let mcp = mcp_docs(ctx);
        let public: Vec<(&'static str, ApiMethodDocs)> = PUBLIC_GETS
            .iter()
            .map(|get| (get.path, public_get(ctx, get)))
            .collect();
        (mcp, public)
    });
    let mut router = router;
    for docs in mcp {
        router = router.api_route_docs("/mcp", docs);
    }
    for (path, docs) in public {
        router = router.api_route_docs(path, docs);
    }
    router
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    fn document() -> Value {
        serde_json::to_value(crate::api::document()).unwrap_or_default()
    }

    #[test]
    fn every_route_of_the_gateway_is_documented() {
        let doc = document();
        let paths = doc["paths"].as_object().cloned().unwrap_or_default();
        for (path, methods) in [
            ("/v1/turns", &["post"][..]),
            ("/v1/turns/{turn_id}", &["get", "delete"]),
            ("/v1/turns/{turn_id}/events", &["get"]),
            ("/v1/turns/{turn_id}/stream-token", &["post"]),
            ("/v1/tools", &["get"]),
            ("/v1/chat/completions", &["post"]),
            ("/mcp", &["post", "get", "delete"]),
            ("/healthz", &["get"]),
            ("/readyz", &["get"]),
            ("/openapi.json", &["get"]),
            ("/docs", &["get"]),
            ("/", &["get"]),
            ("/page/config.json", &["get"]),
            ("/page/app.js", &["get"]),
            ("/page/toolfleet.js", &["get"]),
            ("/page/style.css", &["get"]),
        ] {
            for method in methods {
                assert!(
                    paths[path][method]["operationId"].is_string(),
                    "{method} {path} is not documented"
                );
            }
        }
        assert_eq!(paths.len(), 16, "{:?}", paths.keys().collect::<Vec<_>>());
    }

    #[test]
    fn the_request_examples_are_real_requests() {
        let doc = document();
        let body = |path: &str| {
            doc["paths"][path]["post"]["requestBody"]["content"]["application/json"].clone()
        };
        let turn = body("/v1/turns")["example"].clone();
        assert_eq!(turn["decision"]["type"], "tool_calls");
        assert_eq!(turn["decision"]["calls"].as_array().map(Vec::len), Some(2));
        // The decision's own schema carries the example the rendered docs sample.
        let schema = &doc["components"]["schemas"]["TurnBody"]["properties"]["decision"];
        assert_eq!(schema["examples"][0]["type"], "tool_calls", "{schema}");
        let chat = body("/v1/chat/completions")["example"].clone();
        assert_eq!(chat["messages"][1]["role"], "user");
        assert_eq!(body("/mcp")["example"]["method"], "initialize");
    }

    #[test]
    fn every_error_the_gateway_writes_is_documented_in_the_error_shape() {
        let doc = document();
        let error_ref = "#/components/schemas/ErrorBody";
        let mut checked = 0;
        for (path, item) in doc["paths"].as_object().cloned().unwrap_or_default() {
            for (method, operation) in item.as_object().cloned().unwrap_or_default() {
                let responses = operation["responses"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                for (status, response) in responses {
                    let code: u16 = status.parse().unwrap_or(0);
                    // The model server's own errors pass through as it sent them.
                    let passed_through =
                        path == "/v1/chat/completions" && (code == 502 || code == 504);
                    if code < 400 || passed_through {
                        continue;
                    }
                    let schema = &response["content"]["application/json"]["schema"];
                    let shaped = schema["$ref"] == error_ref
                        || schema["anyOf"]
                            .as_array()
                            .is_some_and(|any| any.iter().any(|s| s["$ref"] == error_ref));
                    assert!(shaped, "{method} {path} {status}: {schema}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 40, "{checked}");
    }
}
