//! The `http` phase: turns through the HTTP gateway (JSON and Server-Sent Events) next
//! to the same turns through the NATS client, on one fleet: latency at concurrency 1,
//! turns/s under concurrent turns, and a burst of 2,000 requests on 100 connections.
//!
//! Owns the HTTP turns the phase sends and the figures computed from them. It must
//! never start or stop the gateway or the fleet (`mod.rs` does) and never format the
//! report.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;
use toolfleet_common::{FleetClient, TurnEvent, TurnRequest};

use super::phases::{decision, interleaved};
use super::progress::Progress;
use super::stats::{self, Summary};

/// Requests of the burst.
const BURST_REQUESTS: usize = 2_000;
/// Connections the burst keeps busy at once.
const BURST_CONNECTIONS: usize = 100;
/// Longest wait for one turn.
const TURN_WAIT: Duration = Duration::from_secs(20);

/// The gateway's figures beside the NATS client's.
#[derive(Debug, Clone, Serialize)]
pub struct Http {
    /// Submit → `final` through the NATS client, concurrency 1.
    pub nats: Summary,
    /// POST → JSON answer, concurrency 1.
    pub json: Summary,
    /// POST → `final` frame of the event stream, concurrency 1.
    pub sse: Summary,
    /// `json.p50_ms - nats.p50_ms`.
    pub json_overhead_p50_ms: f64,
    /// `sse.p50_ms - nats.p50_ms`.
    pub sse_overhead_p50_ms: f64,
    /// Turns in flight in the rate measurements.
    pub concurrency: usize,
    /// Turns/s through the NATS client.
    pub nats_turns_per_s: f64,
    /// Turns/s through the gateway, JSON.
    pub json_turns_per_s: f64,
    /// Turns/s through the gateway, SSE.
    pub sse_turns_per_s: f64,
    /// `json_turns_per_s / nats_turns_per_s`, in percent.
    pub json_throughput_pct: f64,
    /// Turns that failed in any of the above.
    pub failed: usize,
    /// The burst.
    pub burst: Burst,
}

/// A burst of JSON turns on many connections at once.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Burst {
    /// Requests sent.
    pub requests: usize,
    /// Connections used at once.
    pub connections: usize,
    /// Seconds from the first request to the last answer.
    pub seconds: f64,
    /// Answers by status.
    pub statuses: BTreeMap<u16, usize>,
    /// 200s whose body held the turn's `final`.
    pub finals: usize,
    /// 503s carrying `Retry-After`.
    pub refused_with_retry_after: usize,
    /// 5xx other than a 503 with `Retry-After`, and requests with no answer.
    pub bad: usize,
}

/// Where the phase sends its turns.
#[derive(Clone)]
pub struct Target {
    /// The NATS client of the fleet.
    pub client: FleetClient,
    /// `http://127.0.0.1:<port>` of the gateway.
    pub base: String,
    /// An API key of the gateway.
    pub key: String,
    /// The HTTP client.
    pub http: reqwest::Client,
}

/// Which way a turn goes.
#[derive(Debug, Clone, Copy)]
enum Via {
    Nats,
    Json,
    Sse,
}

fn body(decision: &Value) -> Value {
    json!({"decision": decision, "deadline_ms": 5_000})
}

impl Target {
    /// An HTTP client that keeps up to `connections` connections to the gateway.
    pub fn new(client: FleetClient, base: String, key: String, connections: usize) -> Result<Self> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(connections)
            .timeout(TURN_WAIT)
            .build()?;
        Ok(Self {
            client,
            base,
            key,
            http,
        })
    }

    /// One turn of `decision` the `via` way, to its `final`.
    async fn turn(&self, via: Via, decision: &Value) -> Result<()> {
        match via {
            Via::Nats => {
                let request: TurnRequest = serde_json::from_value(json!({
                    "tenant_id": "bench", "decision": decision, "deadline_ms": 5_000
                }))?;
                let mut stream = self.client.submit(request).await?;
                loop {
                    match stream.next_event(TURN_WAIT).await? {
                        TurnEvent::Final(_) => return Ok(()),
                        TurnEvent::Error { error, .. } => bail!("{}", error.code),
                        _ => {}
                    }
                }
            }
            Via::Json => {
                let answer: Value = self.post(decision, false).await?.json().await?;
                match answer["final"]["type"].as_str() {
                    Some("final") => Ok(()),
                    _ => bail!("no final in {answer}"),
                }
            }
            Via::Sse => {
                let mut body = self.post(decision, true).await?.bytes_stream();
                let mut seen = Vec::new();
                while let Some(chunk) = body.next().await {
                    seen.extend_from_slice(&chunk?);
                    if seen.windows(12).any(|w| w == b"event: final") {
                        return Ok(());
                    }
                }
                bail!("the event stream ended without a final")
            }
        }
    }

    async fn post(&self, decision: &Value, events: bool) -> Result<reqwest::Response> {
        let mut request = self
            .http
            .post(format!("{}/v1/turns", self.base))
            .bearer_auth(&self.key)
            .json(&body(decision));
        if events {
            request = request.header("accept", "text/event-stream");
        }
        let response = request.send().await?;
        if !response.status().is_success() {
            bail!("status {}", response.status());
        }
        Ok(response)
    }
}

/// Runs the phase: `turns` turns each way at concurrency 1 (interleaved, for at most
/// `cap`), then `concurrency` turns in flight for `window` each way, then the burst.
pub async fn run(
    target: &Target,
    turns: usize,
    cap: Duration,
    concurrency: usize,
    window: Duration,
    progress: &Progress,
) -> Result<Http> {
    let noop = decision("test.noop", &json!({}), 3);
    let ways = [Via::Nats, Via::Json, Via::Sse];
    let ([nats, json_lat, sse], mut failed) =
        interleaved(turns, cap, ("http", "turn"), progress, |k| {
            target.turn(ways[k], &noop)
        })
        .await?;
    let mut rates = [0.0; 3];
    for (k, via) in ways.iter().enumerate() {
        let (rate, lost) = rate(target, *via, &noop, concurrency, window).await;
        rates[k] = rate;
        failed += lost;
    }
    let burst = burst(target, &noop).await?;
    Ok(Http {
        json_overhead_p50_ms: stats::round3(json_lat.p50_ms - nats.p50_ms),
        sse_overhead_p50_ms: stats::round3(sse.p50_ms - nats.p50_ms),
        nats,
        json: json_lat,
        sse,
        concurrency,
        nats_turns_per_s: stats::round3(rates[0]),
        json_turns_per_s: stats::round3(rates[1]),
        sse_turns_per_s: stats::round3(rates[2]),
        json_throughput_pct: if rates[0] > 0.0 {
            stats::round3(100.0 * rates[1] / rates[0])
        } else {
            0.0
        },
        failed,
        burst,
    })
}

/// Turns/s with `concurrency` turns of `decision` in flight the `via` way for
/// `window` (after a quarter of it as warm-up), and the turns that failed.
async fn rate(
    target: &Target,
    via: Via,
    decision: &Value,
    concurrency: usize,
    window: Duration,
) -> (f64, usize) {
    let from = Instant::now() + window / 4;
    let to = from + window;
    let mut set = JoinSet::new();
    for _ in 0..concurrency {
        let (target, decision) = (target.clone(), decision.clone());
        set.spawn(async move {
            let (mut done, mut failed) = (0usize, 0usize);
            while Instant::now() < to {
                let ok = target.turn(via, &decision).await.is_ok();
                let now = Instant::now();
                if now >= from && now <= to {
                    if ok {
                        done += 1;
                    } else {
                        failed += 1;
                    }
                }
            }
            (done, failed)
        });
    }
    let (mut done, mut failed) = (0, 0);
    while let Some(Ok((d, f))) = set.join_next().await {
        done += d;
        failed += f;
    }
    (done as f64 / window.as_secs_f64(), failed)
}

/// 2,000 JSON turns on 100 connections at once.
async fn burst(target: &Target, decision: &Value) -> Result<Burst> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut set = JoinSet::new();
    for _ in 0..BURST_CONNECTIONS {
        let (target, decision, next) = (target.clone(), decision.clone(), next.clone());
        set.spawn(async move {
            let mut out = Burst::default();
            while next.fetch_add(1, Ordering::Relaxed) < BURST_REQUESTS {
                out.requests += 1;
                one_of_burst(&target, &decision, &mut out).await;
            }
            out
        });
    }
    let mut total = Burst {
        connections: BURST_CONNECTIONS,
        ..Burst::default()
    };
    while let Some(part) = set.join_next().await {
        let part = part.context("a burst task failed")?;
        total.requests += part.requests;
        total.finals += part.finals;
        total.refused_with_retry_after += part.refused_with_retry_after;
        total.bad += part.bad;
        for (status, n) in part.statuses {
            *total.statuses.entry(status).or_default() += n;
        }
    }
    total.seconds = stats::round3(started.elapsed().as_secs_f64());
    Ok(total)
}

/// One request of the burst, counted in `out`.
async fn one_of_burst(target: &Target, decision: &Value, out: &mut Burst) {
    let sent = target
        .http
        .post(format!("{}/v1/turns", target.base))
        .bearer_auth(&target.key)
        .json(&body(decision))
        .send()
        .await;
    let Ok(response) = sent else {
        out.bad += 1;
        return;
    };
    let status = response.status();
    *out.statuses.entry(status.as_u16()).or_default() += 1;
    let retry_after = response.headers().contains_key("retry-after");
    if status.is_success() {
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if answer["final"]["type"] == "final" {
            out.finals += 1;
        }
    } else if status.as_u16() == 503 && retry_after {
        out.refused_with_retry_after += 1;
    } else if status.is_server_error() {
        out.bad += 1;
    }
}
