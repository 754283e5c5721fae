//! The live turn page at `/`: paste a decision or pick an example, enter an API key,
//! submit, and watch the turn (ack, one row per call with its state and a duration bar
//! on a shared time axis, narration, summary, a link to the trace in Jaeger).
//!
//! Owns serving the page's files (plain HTML, CSS and JavaScript modules compiled into
//! the binary; no build step, nothing from a CDN), among them the gateway client of
//! `clients/typescript` at `/page/toolfleet.js`, through which the page submits and
//! follows its turns, and `/page/config.json` (the example decisions of
//! `examples/decisions` and the Jaeger base URL). Never runs a turn itself: the page
//! calls `POST /v1/turns` like any client.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::Gateway;

const INDEX: &str = include_str!("page/index.html");
const SCRIPT: &str = include_str!("page/app.js");
const STYLE: &str = include_str!("page/style.css");
/// The gateway client of `clients/typescript`, as its users get it.
const CLIENT: &str = include_str!("../../clients/typescript/toolfleet.js");

/// The example decisions offered by the page: file name and content.
pub const EXAMPLES: [(&str, &str); 5] = [
    (
        "appointments_and_billing.simple.json",
        include_str!("../../examples/decisions/appointments_and_billing.simple.json"),
    ),
    (
        "appointments_and_billing.openai.json",
        include_str!("../../examples/decisions/appointments_and_billing.openai.json"),
    ),
    (
        "appointments_and_billing.anthropic.json",
        include_str!("../../examples/decisions/appointments_and_billing.anthropic.json"),
    ),
    (
        "parallel.openai-message.json",
        include_str!("../../examples/decisions/parallel.openai-message.json"),
    ),
    (
        "receptionist_booking_and_policy.openai.json",
        include_str!("../../examples/decisions/receptionist_booking_and_policy.openai.json"),
    ),
];

/// The page's routes.
pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/", get(|| async { Html(INDEX) }))
        .route(
            "/page/app.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    SCRIPT,
                )
            }),
        )
        .route(
            "/page/toolfleet.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    CLIENT,
                )
            }),
        )
        .route(
            "/page/style.css",
            get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE) }),
        )
        .route("/page/config.json", get(config))
}

/// `GET /page/config.json`: the examples and the Jaeger base URL.
async fn config(State(gateway): State<Arc<Gateway>>) -> impl IntoResponse {
    let examples: Vec<Value> = EXAMPLES
        .iter()
        .map(|(name, text)| {
            let decision: Value = serde_json::from_str(text).unwrap_or(Value::Null);
            json!({"name": name, "decision": decision})
        })
        .collect();
    Json(json!({
        "jaeger_url": gateway.config.jaeger_url.trim_end_matches('/'),
        "examples": examples,
    }))
}
