//! A scripted OpenAI-compatible model server: `POST /v1/chat/completions` answered from
//! a script, streamed (`stream: true`) or not, for the gateway's chat-completions tests
//! and the `openai` bench phase. It stands in for a paid model API; it is not part of any
//! fleet process.
//!
//! Round `k` of any conversation (the request holds `k` assistant messages) gets the
//! script's entry `k`, so a conversation replays the same script however often it is
//! sent, streamed or not. A streamed answer is cut the way model servers cut theirs: the
//! role first, content in three pieces, each tool call as its own deltas (id and name,
//! then the arguments in two fragments), the finish reason, `usage` last when asked for
//! (`stream_options.include_usage`), then `[DONE]`. Every request is kept for the test to
//! read.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Scripted {
    /// A `chat.completion` response.
    Answer(Value),
    /// An error status with its body.
    Fail(u16, Value),
}

/// The `role: "tool"` messages a request the upstream received (one of [`ScriptedUpstream::requests`]) carries, as (id, content).
pub fn tool_messages(request: &Value) -> Vec<(String, String)> {
    request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap_or("").to_string(),
                m["content"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// A `chat.completion` whose message says `text`.
pub fn text_answer(text: &str) -> Scripted {
    Scripted::Answer(completion(
        json!({"role": "assistant", "content": text}),
        "stop",
    ))
}

/// A `chat.completion` whose message calls `calls` (`(id, name, arguments JSON)`).
pub fn calls_answer(calls: &[(&str, &str, Value)]) -> Scripted {
    let calls: Vec<Value> = calls
        .iter()
        .map(|(id, name, arguments)| {
            json!({"id": id, "type": "function",
                   "function": {"name": name, "arguments": arguments.to_string()}})
        })
        .collect();
    Scripted::Answer(completion(
        json!({"role": "assistant", "content": null, "tool_calls": calls}),
        "tool_calls",
    ))
}

fn completion(message: Value, finish_reason: &str) -> Value {
    json!({
        "id": "chatcmpl-scripted", "object": "chat.completion", "created": 1_700_000_000,
        "model": "scripted-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": null}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    })
}

#[derive(Default)]
struct Shared {
    script: Vec<Scripted>,
    requests: Mutex<Vec<Value>>,
    /// Suffix every call id with the request's number (each conversation its own ids).
    unique_ids: bool,
}

/// The running server; stops when dropped.
pub struct ScriptedUpstream {
    /// The base URL to configure (`http://127.0.0.1:<port>/v1`).
    pub base_url: String,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl ScriptedUpstream {
    /// Serves `script` on a free loopback port.
    pub async fn start(script: Vec<Scripted>) -> std::io::Result<Self> {
        Self::serve(script, false).await
    }

    /// Like [`ScriptedUpstream::start`], every call id suffixed with the request's
    /// number, so each conversation's calls are new ones (a benchmark's repeated turns).
    pub async fn start_with_unique_ids(script: Vec<Scripted>) -> std::io::Result<Self> {
        Self::serve(script, true).await
    }

    async fn serve(script: Vec<Scripted>, unique_ids: bool) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            script,
            requests: Mutex::default(),
            unique_ids,
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(answer))
            .with_state(Arc::clone(&shared));
        let stop = CancellationToken::new();
        let until = stop.clone().cancelled_owned();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(until)
                .await;
        });
        Ok(Self {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            shared,
            stop,
        })
    }

    /// Every request received, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.shared
            .requests
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn answer(State(shared): State<Arc<Shared>>, Json(request): Json<Value>) -> Response {
    let number = match shared.requests.lock() {
        Ok(mut requests) => {
            requests.push(request.clone());
            requests.len()
        }
        Err(_) => 0,
    };
    let round = request
        .get("messages")
        .and_then(Value::as_array)
        .map_or(0, |m| {
            m.iter()
                .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
                .count()
        });
    let Some(entry) = shared.script.get(round).or(shared.script.last()) else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "empty script").into_response();
    };
    let response = match entry {
        Scripted::Fail(status, body) => {
            let status = StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return (status, Json(body.clone())).into_response();
        }
        Scripted::Answer(response) => response,
    };
    let mut response = response.clone();
    if shared.unique_ids {
        if let Some(Value::Array(calls)) = response.pointer_mut("/choices/0/message/tool_calls") {
            for call in calls {
                if let Some(Value::String(id)) = call.get_mut("id") {
                    id.push_str(&format!("-{number}"));
                }
            }
        }
    }
    let response = &response;
    if request.get("stream").and_then(Value::as_bool) != Some(true) {
        return Json(response.clone()).into_response();
    }
    let usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut body = String::new();
    for chunk in chunks(response, usage) {
        body.push_str(&format!("data: {chunk}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

/// `response` cut into chunks.
fn chunks(response: &Value, usage: bool) -> Vec<Value> {
    let chunk = |delta: Value, finish: Value| {
        let mut chunk = Map::new();
        for key in ["id", "created", "model"] {
            if let Some(v) = response.get(key) {
                chunk.insert(key.into(), v.clone());
            }
        }
        chunk.insert("object".into(), json!("chat.completion.chunk"));
        chunk.insert(
            "choices".into(),
            json!([{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]),
        );
        Value::Object(chunk)
    };
    let message = &response["choices"][0]["message"];
    let mut out = vec![chunk(
        json!({"role": "assistant", "content": null}),
        Value::Null,
    )];
    if let Some(text) = message.get("content").and_then(Value::as_str) {
        let chars: Vec<char> = text.chars().collect();
        let third = chars.len().div_ceil(3).max(1);
        for piece in chars.chunks(third) {
            let piece: String = piece.iter().collect();
            out.push(chunk(json!({"content": piece}), Value::Null));
        }
    }
    for (index, call) in message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let arguments = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        let head = json!({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""}}]});
        out.push(chunk(head, Value::Null));
        let chars: Vec<char> = arguments.chars().collect();
        let half = chars.len().div_ceil(2).max(1);
        for piece in chars.chunks(half) {
            let piece: String = piece.iter().collect();
            out.push(chunk(
                json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                Value::Null,
            ));
        }
    }
    out.push(chunk(
        json!({}),
        response["choices"][0]["finish_reason"].clone(),
    ));
    if usage {
        let mut last = chunk(json!({}), Value::Null);
        if let Value::Object(fields) = &mut last {
            fields.insert("choices".into(), json!([]));
            fields.insert("usage".into(), response["usage"].clone());
        }
        out.push(last);
    }
    out
}
