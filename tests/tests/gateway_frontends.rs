//! The gateway at the seams a frontend meets: stream tokens for clients that cannot send
//! headers, and a resumed stream of a turn longer than the default deadline. A real
//! `gateway-node` process in front of a real fleet, keys in a real PostgreSQL.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use toolfleet_tests::gateway::{create_key, read_events, read_first_events, stack, SseEvent};

fn seq(event: &SseEvent) -> Result<u64> {
    Ok(event
        .id
        .as_deref()
        .context("an event without id")?
        .parse()?)
}

/// The error code of a refused answer.
async fn code(response: reqwest::Response) -> Result<(u16, String)> {
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    Ok((
        status,
        body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_stream_waits_for_the_turns_own_deadline_not_the_default() -> Result<()> {
    // The gateway's default wait is 2 s; the turn asks for 60 s and its call takes 4 s.
    let short_default = [
        ("TOOLFLEET_DEFAULT_DEADLINE_MS", "1500"),
        ("TOOLFLEET_GATEWAY_FINAL_GRACE_MS", "500"),
    ];
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&short_default).await?;
    let key = create_key(&db, "demo").await?;
    let body = json!({
        "turn_id": "long-resume-1",
        "deadline_ms": 60000,
        "decision": {"type": "tool_calls", "calls": [
            {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 4000}}
        ]}
    });
    let response = gateway.stream_turn(&key, &body).await?;
    assert_eq!(response.status(), 200);
    let first = read_first_events(response, 2).await?;
    // The replayed ack names the deadline the coordinator applied.
    assert_eq!(first[0].data["deadline_ms"], 60000);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let response = gateway
        .http
        .get(gateway.url("/v1/turns/long-resume-1/events"))
        .bearer_auth(&key)
        .header("last-event-id", seq(&first[1])?.to_string())
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let rest = read_events(response).await?;
    let kinds: Vec<&str> = rest.iter().map(|e| e.event.as_str()).collect();
    assert!(!kinds.contains(&"error"), "{kinds:?}");
    let last = rest.last().context("no events")?;
    assert_eq!(last.event, "final", "{kinds:?}");
    assert_eq!(last.data["results"][0]["state"], "done");
    assert_eq!(last.data["deadline_hit"], false);
    let ids = first
        .iter()
        .chain(&rest)
        .map(seq)
        .collect::<Result<Vec<_>>>()?;
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_token_reads_its_one_turn_and_nothing_else() -> Result<()> {
    let ttl = [("TOOLFLEET_GATEWAY_STREAM_TOKEN_TTL_MS", "1000")];
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&ttl).await?;
    let key = create_key(&db, "demo").await?;
    let other_tenant = create_key(&db, "acme").await?;
    let http = &gateway.http;
    let turn = |id: &str| {
        json!({
            "turn_id": id,
            "decision": {"type": "tool_calls", "calls": [
                {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 300}}
            ]}
        })
    };

    // Submitted with Prefer: respond-async: 202 at acceptance, with a URL to follow.
    let accepted = http
        .post(gateway.url("/v1/turns"))
        .bearer_auth(&key)
        .header("prefer", "respond-async")
        .json(&turn("token-1"))
        .send()
        .await?;
    assert_eq!(accepted.status(), 202);
    assert_eq!(
        accepted
            .headers()
            .get("preference-applied")
            .map(|v| v.as_bytes()),
        Some(&b"respond-async"[..])
    );
    let accepted: Value = accepted.json().await?;
    let token = accepted["token"].as_str().context("no token")?.to_string();
    let events_url = accepted["events_url"].as_str().context("no url")?;
    assert!(!events_url.contains(&key));
    assert!(token.starts_with("tfs_"));

    // The URL alone (no key) follows the turn from its first event to its final.
    let response = http.get(gateway.url(events_url)).send().await?;
    assert_eq!(response.status(), 200);
    let events = read_events(response).await?;
    let ids = events.iter().map(seq).collect::<Result<Vec<_>>>()?;
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("final"));
    // And it resumes like a key does.
    let last = ids.len();
    let done = http
        .get(gateway.url(&format!("{events_url}&after={last}")))
        .send()
        .await?;
    assert_eq!(done.status(), 204);

    // The token is no API key: it submits, reads, cancels and lists nothing.
    let as_bearer = http
        .post(gateway.url("/v1/turns"))
        .bearer_auth(&token)
        .json(&turn("token-2"))
        .send()
        .await?;
    assert_eq!(code(as_bearer).await?, (401, "unauthorized".into()));
    for (method, path) in [
        (reqwest::Method::GET, "/v1/turns/token-1"),
        (reqwest::Method::DELETE, "/v1/turns/token-1"),
        (reqwest::Method::GET, "/v1/tools"),
    ] {
        let refused = http
            .request(
                method.clone(),
                gateway.url(&format!("{path}?token={token}")),
            )
            .send()
            .await?;
        assert_eq!(
            code(refused).await?,
            (401, "unauthorized".into()),
            "{method} {path}"
        );
    }
    // Nor another turn's events, nor a changed token.
    let other_turn = http
        .get(gateway.url(&format!("/v1/turns/token-2/events?token={token}")))
        .send()
        .await?;
    assert_eq!(code(other_turn).await?, (401, "unauthorized".into()));
    // Its last hex digit changed (to another digit whatever it was).
    let (kept, last) = token.split_at(token.len() - 1);
    let changed = format!("{kept}{}", if last == "0" { "1" } else { "0" });
    let forged = http
        .get(gateway.url(&format!("/v1/turns/token-1/events?token={changed}")))
        .send()
        .await?;
    assert_eq!(code(forged).await?, (401, "unauthorized".into()));

    // A stream token minted by another tenant's key reads nothing of this tenant's turn.
    let minted = gateway
        .post_for_json("/v1/turns/token-1/stream-token", &other_tenant)
        .await?;
    let foreign = minted["events_url"].as_str().context("no url")?;
    let refused = http.get(gateway.url(foreign)).send().await?;
    assert_eq!(code(refused).await?.0, 403);

    // A minted token expires after the configured TTL (1 s here).
    let minted = gateway
        .post_for_json("/v1/turns/token-1/stream-token", &key)
        .await?;
    let url = minted["events_url"].as_str().context("no url")?.to_string();
    assert_eq!(http.get(gateway.url(&url)).send().await?.status(), 200);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let expired = http.get(gateway.url(&url)).send().await?;
    assert_eq!(code(expired).await?, (401, "unauthorized".into()));

    // Every answer of POST /v1/turns carries a token for its turn.
    let answered = gateway.json_turn(&key, &turn("token-3")).await?;
    assert_eq!(answered.status(), 200);
    let header = answered
        .headers()
        .get("toolfleet-stream-token")
        .and_then(|v| v.to_str().ok())
        .context("no token header")?
        .to_string();
    let stored = http
        .get(gateway.url(&format!("/v1/turns/token-3/events?token={header}")))
        .send()
        .await?;
    assert_eq!(stored.status(), 200);
    let replayed = read_events(stored).await?;
    assert_eq!(replayed.last().map(|e| e.event.as_str()), Some("final"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_of_zero_is_refused_not_clamped() -> Result<()> {
    let (fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, "demo").await?;
    let decision = json!({"type": "tool_calls", "calls": [
        {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 10}}
    ]});
    // Over HTTP, in both modes: 400 invalid_request, never a 200 of timeouts.
    for deadline in [json!(0), json!(-1)] {
        let body = json!({"deadline_ms": deadline, "decision": decision});
        let json_mode = gateway.json_turn(&key, &body).await?;
        assert_eq!(code(json_mode).await?, (400, "invalid_request".into()));
        let streamed = gateway.stream_turn(&key, &body).await?;
        assert_eq!(code(streamed).await?, (400, "invalid_request".into()));
    }
    // A NATS frontend sending 0 gets one error event with the same code.
    let request: toolfleet_common::TurnRequest = serde_json::from_value(json!({
        "turn_id": "zero-deadline", "tenant_id": "demo", "deadline_ms": 0,
        "decision": decision,
    }))?;
    let mut stream = fleet.client.submit(request).await?;
    match stream.next_event(Duration::from_secs(10)).await? {
        toolfleet_common::TurnEvent::Error { error, .. } => {
            assert_eq!(error.code, "invalid_request");
            assert!(!error.retryable);
        }
        other => anyhow::bail!("expected an error event, got {other:?}"),
    }
    // 1 ms is a (hopeless) budget, not a refusal.
    let body = json!({"deadline_ms": 1, "decision": decision});
    assert_eq!(gateway.json_turn(&key, &body).await?.status(), 200);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_in_the_json_error_shape() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, "demo").await?;
    let http = &gateway.http;
    // A method the route does not have: 405 with Allow, in the shape.
    let put = http
        .put(gateway.url("/v1/turns"))
        .bearer_auth(&key)
        .send()
        .await?;
    assert!(put.headers().contains_key("allow"));
    assert_eq!(code(put).await?, (405, "method_not_allowed".into()));
    // The MCP transport's Host check (against DNS rebinding): 403, in the shape.
    let mcp = http
        .post(gateway.url("/mcp"))
        .bearer_auth(&key)
        .header("host", "evil.example")
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
        .send()
        .await?;
    assert_eq!(code(mcp).await?, (403, "forbidden".into()));
    // An unknown turn speaks of the key's tenant, not of NATS frontends.
    let unknown = http
        .get(gateway.url("/v1/turns/never-submitted"))
        .bearer_auth(&key)
        .send()
        .await?;
    assert_eq!(unknown.status(), 404);
    let body: Value = unknown.json().await?;
    assert_eq!(body["error"]["code"], "unknown_turn");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.contains("frontend"), "{message}");
    assert_eq!(body["error"]["retryable"], false);
    Ok(())
}
