//! The `openai` phase: `POST /v1/chat/completions` through the gateway with one round of
//! three no-op fleet calls, against a scripted model server that answers at once, next
//! to the same model server asked directly and to the plain gateway's turn of three
//! no-op calls: what the loop adds per round beyond the upstream's own time.
//!
//! Owns the requests the phase sends and the figures computed from them. It must never
//! start or stop the gateway, the fleet or the model server (`mod.rs` does).

use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;
use serde_json::{json, Value};
use toolfleet_dev::upstream::{calls_answer, text_answer, Scripted};

use super::phases::{decision, interleaved};
use super::progress::Progress;
use super::stats::{self, Summary};

/// Longest wait for one request.
const WAIT: Duration = Duration::from_secs(20);

/// The figures of the phase.
#[derive(Debug, Clone, Serialize)]
pub struct Openai {
    /// One request straight to the model server.
    pub upstream: Summary,
    /// A chat completion through the gateway: a round of three fleet calls, then the
    /// answer (two model requests and one fleet turn).
    pub chat: Summary,
    /// `POST /v1/turns` with three no-op calls (the plain gateway).
    pub gateway_turn: Summary,
    /// `chat.p50_ms - 2 × upstream.p50_ms`: gateway and fleet time of one round.
    pub added_per_round_p50_ms: f64,
    /// Requests that failed.
    pub failed: usize,
}

/// The model server's script: three no-op fleet calls, then the answer.
pub fn script() -> Vec<Scripted> {
    vec![
        calls_answer(&[
            ("a", "test__noop", json!({})),
            ("b", "test__noop", json!({})),
            ("c", "test__noop", json!({})),
        ]),
        text_answer("done"),
    ]
}

/// `turns` rounds of the three requests at concurrency 1 (a tenth more as warm-up),
/// for at most `cap`.
pub async fn run(
    gateway: &str,
    key: &str,
    upstream: &str,
    turns: usize,
    cap: Duration,
    progress: &Progress,
) -> Result<Openai> {
    let http = reqwest::Client::builder().timeout(WAIT).build()?;
    let chat = json!({"model": "bench", "messages": [{"role": "user", "content": "go"}]});
    let turn = json!({"decision": decision("test.noop", &json!({}), 3), "deadline_ms": 5_000});
    let requests = [
        (format!("{upstream}/chat/completions"), chat.clone(), false),
        (format!("{gateway}/v1/chat/completions"), chat, true),
        (format!("{gateway}/v1/turns"), turn, true),
    ];
    let ([upstream, chat, gateway_turn], failed) =
        interleaved(turns, cap, ("openai", "request"), progress, |k| {
            let (url, body, keyed) = &requests[k];
            let mut request = http.post(url).json(body);
            if *keyed {
                request = request.bearer_auth(key);
            }
            async move {
                let response = request.send().await?;
                if !response.status().is_success() {
                    bail!("status {}", response.status());
                }
                let _: Value = response.json().await?;
                anyhow::Ok(())
            }
        })
        .await?;
    Ok(Openai {
        added_per_round_p50_ms: stats::round3(chat.p50_ms - 2.0 * upstream.p50_ms),
        upstream,
        chat,
        gateway_turn,
        failed,
    })
}
