//! Every refusal of the HTTP gateway, asked for as a client would, answers in the one
//! documented shape: `application/json`, `{"error": {"code", "message", "retryable"}}` and
//! nothing else, `retryable` true exactly for 429 and 503, with the status and code of
//! PROTOCOL §11.3. That holds for the refusals the handlers write and for the ones no
//! handler writes (the router's 404 and 405, the body limit, the MCP transport's `Host`,
//! `Accept`, content-type and session checks).

use anyhow::{Context, Result};
use reqwest::{Method, RequestBuilder};
use serde_json::{json, Value};
use toolfleet_tests::gateway::{create_key, stack};

/// The body limit this gateway runs with, so a body over it is cheap to send.
const MAX_BODY: usize = 64 * 1024;

/// A refusal: what is sent, and the status and code it must get.
struct Case {
    what: &'static str,
    request: RequestBuilder,
    status: u16,
    code: &'static str,
}

/// Asserts that `response` is `status` with `code` in the error shape; its message.
async fn assert_shaped(response: reqwest::Response, case: &Case) -> Result<String> {
    let what = case.what;
    assert_eq!(response.status().as_u16(), case.status, "{what}");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        content_type.starts_with("application/json"),
        "{what}: content type {content_type:?}"
    );
    let body: Value = response.json().await.with_context(|| what.to_string())?;
    let top: Vec<&String> = body.as_object().context("an object")?.keys().collect();
    assert_eq!(top, ["error"], "{what}: {body}");
    let error = body["error"].as_object().context("error is an object")?;
    let mut fields: Vec<&str> = error.keys().map(String::as_str).collect();
    fields.sort_unstable();
    assert_eq!(fields, ["code", "message", "retryable"], "{what}: {body}");
    assert_eq!(error["code"], case.code, "{what}: {body}");
    let retryable = case.status == 429 || case.status == 503;
    assert_eq!(error["retryable"], retryable, "{what}: {body}");
    let message = error["message"].as_str().unwrap_or_default().to_string();
    assert!(!message.trim().is_empty(), "{what}: an empty message");
    Ok(message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_answers_the_one_error_shape() -> Result<()> {
    let limit = MAX_BODY.to_string();
    let settings = [("TOOLFLEET_GATEWAY_MAX_BODY_BYTES", limit.as_str())];
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&settings).await?;
    let key = create_key(&db, "demo").await?;
    let http = &gateway.http;
    let keyed =
        |method: Method, path: &str| http.request(method, gateway.url(path)).bearer_auth(&key);
    let decision = json!({"type": "tool_calls", "calls": [
        {"toolName": "crm.getOpenInvoices", "arguments": {"customerId": "cust_002"}}
    ]});
    let mcp_ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"});
    let mcp_accept = "application/json, text/event-stream";
    let cases = vec![
        Case {
            what: "no key",
            request: http.get(gateway.url("/v1/tools")),
            status: 401,
            code: "unauthorized",
        },
        Case {
            what: "an unknown key",
            request: http
                .get(gateway.url("/v1/tools"))
                .bearer_auth(format!("tfk_{}", "0".repeat(64))),
            status: 401,
            code: "unauthorized",
        },
        Case {
            what: "no such route",
            request: keyed(Method::GET, "/v1/nothing-here"),
            status: 404,
            code: "not_found",
        },
        Case {
            what: "PUT /v1/turns",
            request: keyed(Method::PUT, "/v1/turns").json(&json!({"decision": decision})),
            status: 405,
            code: "method_not_allowed",
        },
        Case {
            what: "PATCH /v1/turns/{id}",
            request: keyed(Method::PATCH, "/v1/turns/some-turn"),
            status: 405,
            code: "method_not_allowed",
        },
        Case {
            what: "a body that is not JSON",
            request: keyed(Method::POST, "/v1/turns")
                .header("content-type", "application/json")
                .body("{not json"),
            status: 400,
            code: "invalid_request",
        },
        Case {
            what: "a body without a decision",
            request: keyed(Method::POST, "/v1/turns").json(&json!({"user_message": "hi"})),
            status: 400,
            code: "invalid_request",
        },
        Case {
            what: "a deadline of 0",
            request: keyed(Method::POST, "/v1/turns")
                .json(&json!({"decision": decision, "deadline_ms": 0})),
            status: 400,
            code: "invalid_request",
        },
        Case {
            what: "another tenant in the body",
            request: keyed(Method::POST, "/v1/turns")
                .json(&json!({"decision": decision, "tenant_id": "other"})),
            status: 403,
            code: "tenant_not_allowed",
        },
        Case {
            what: "a body over the limit",
            // The gateway answers before reading the rest and closes the connection,
            // so this request does not hand it back to the pool for the next case.
            request: keyed(Method::POST, "/v1/turns")
                .header("content-type", "application/json")
                .header("connection", "close")
                .body(format!(
                    r#"{{"decision": {decision}, "user_message": "{}"}}"#,
                    "x".repeat(MAX_BODY)
                )),
            status: 413,
            code: "payload_too_large",
        },
        Case {
            what: "an unknown turn",
            request: keyed(Method::GET, "/v1/turns/never-submitted"),
            status: 404,
            code: "unknown_turn",
        },
        Case {
            what: "an unknown turn's events",
            request: keyed(Method::GET, "/v1/turns/never-submitted/events"),
            status: 404,
            code: "unknown_turn",
        },
        Case {
            what: "a forged stream token",
            request: http.get(gateway.url("/v1/turns/some-turn/events?token=tfs_forged")),
            status: 401,
            code: "unauthorized",
        },
        Case {
            what: "chat completions without a model server",
            request: keyed(Method::POST, "/v1/chat/completions")
                .json(&json!({"messages": [{"role": "user", "content": "hi"}]})),
            status: 503,
            code: "upstream_not_configured",
        },
        Case {
            what: "/mcp without a key",
            request: http
                .post(gateway.url("/mcp"))
                .header("accept", mcp_accept)
                .json(&mcp_ping),
            status: 401,
            code: "unauthorized",
        },
        Case {
            what: "/mcp from a Host not allowed",
            request: keyed(Method::POST, "/mcp")
                .header("host", "evil.example")
                .header("accept", mcp_accept)
                .json(&mcp_ping),
            status: 403,
            code: "forbidden",
        },
        Case {
            what: "/mcp without the Accept it requires",
            request: keyed(Method::POST, "/mcp")
                .header("accept", "application/json")
                .json(&mcp_ping),
            status: 406,
            code: "not_acceptable",
        },
        Case {
            what: "/mcp with a body that is not JSON",
            request: keyed(Method::POST, "/mcp")
                .header("accept", mcp_accept)
                .header("content-type", "text/plain")
                .body("ping"),
            status: 415,
            code: "unsupported_media_type",
        },
        Case {
            what: "/mcp naming a session that does not exist",
            request: keyed(Method::POST, "/mcp")
                .header("accept", mcp_accept)
                .header("mcp-session-id", "no-such-session")
                .json(&mcp_ping),
            status: 404,
            code: "not_found",
        },
    ];
    let count = cases.len();
    for case in cases {
        let response = case
            .request
            .try_clone()
            .context("a request that can be sent")?
            .send()
            .await
            .with_context(|| case.what)?;
        let allow = response.headers().get("allow").is_some();
        let message = assert_shaped(response, &case).await?;
        if case.status == 405 {
            assert!(allow, "{}: 405 without Allow", case.what);
        }
        if case.code == "unknown_turn" {
            // In the words of the key's view: HTTP clients have a tenant, not a frontend.
            assert!(!message.contains("frontend"), "{}: {message}", case.what);
        }
    }
    assert_eq!(count, 19);
    Ok(())
}
