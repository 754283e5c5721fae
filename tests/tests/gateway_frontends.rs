//! The gateway at the seams a frontend meets: stream tokens for clients that cannot send
//! headers (across replicas, and never outliving the turn cap), and a resumed stream of
//! a turn longer than the default deadline. A real `gateway-node` process in front of a
//! real fleet, keys in a real PostgreSQL.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use toolfleet_tests::gateway::{
    create_key, gateway_node_path, read_events, read_first_events, stack, GatewayNode, SseEvent,
};

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

    // A stream token minted by another tenant's key reads nothing of this tenant's turn:
    // under that tenant the id names no turn.
    let minted = gateway
        .post_for_json("/v1/turns/token-1/stream-token", &other_tenant)
        .await?;
    let foreign = minted["events_url"].as_str().context("no url")?;
    let refused = http.get(gateway.url(foreign)).send().await?;
    assert_eq!(code(refused).await?, (404, "unknown_turn".into()));

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
    let header = token_header(&answered)?;
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

/// The stream-token secret both replicas of these tests share (at least 32 bytes).
const SHARED_SECRET: &str = "one-stream-token-secret-for-every-replica";
const SECRET_VAR: &str = "TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET";

/// A quick turn with id `id`.
fn quick_turn(id: &str) -> Value {
    json!({
        "turn_id": id,
        "decision": {"type": "tool_calls", "calls": [
            {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 200}}
        ]}
    })
}

/// `POST /v1/turns` with `Prefer: respond-async` on `gateway`: the 202's body.
async fn submit_async(gateway: &GatewayNode, key: &str, body: &Value) -> Result<Value> {
    let accepted = gateway
        .http
        .post(gateway.url("/v1/turns"))
        .bearer_auth(key)
        .header("prefer", "respond-async")
        .json(body)
        .send()
        .await?;
    anyhow::ensure!(accepted.status() == 202, "{}", accepted.status());
    Ok(accepted.json().await?)
}

/// Behind one address (the Service, the Ingress) a browser's `EventSource` reaches any
/// replica, and reconnects to any: a token minted by one must read on every other.
/// Each replica drew a secret of its own before, so the other answered 401, on which
/// an `EventSource` stops for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_token_minted_by_one_replica_reads_on_another() -> Result<()> {
    let shared = [(SECRET_VAR, SHARED_SECRET)];
    let (fleet, _coordinator, _worker, db, first) = stack(&shared).await?;
    let second = GatewayNode::start(&fleet, &db, &shared).await?;
    let stranger = GatewayNode::start(
        &fleet,
        &db,
        &[(SECRET_VAR, "a-secret-of-another-deployment-entirely")],
    )
    .await?;
    let key = create_key(&db, "demo").await?;

    // Minted by the first replica with the turn, followed on the second, key-less, from
    // the first event to the final.
    let accepted = submit_async(&first, &key, &quick_turn("replicas-1")).await?;
    let events_url = accepted["events_url"].as_str().context("no url")?;
    let followed = second.http.get(second.url(events_url)).send().await?;
    assert_eq!(followed.status(), 200);
    let events = read_events(followed).await?;
    assert_eq!(events.first().map(|e| e.event.as_str()), Some("ack"));
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("final"));
    assert_eq!(events[0].data["turn_id"], "replicas-1");

    // Minted by the second (`POST /v1/turns/{id}/stream-token`), read on the first.
    let minted = second
        .post_for_json("/v1/turns/replicas-1/stream-token", &key)
        .await?;
    let url = minted["events_url"].as_str().context("no url")?;
    let replayed = first.http.get(first.url(url)).send().await?;
    assert_eq!(replayed.status(), 200);
    let replayed = read_events(replayed).await?;
    assert_eq!(replayed.last().map(|e| e.event.as_str()), Some("final"));

    // A gateway with another secret (what every other replica was) refuses both.
    for url in [events_url, url] {
        let refused = stranger.http.get(stranger.url(url)).send().await?;
        assert_eq!(code(refused).await?, (401, "unauthorized".into()), "{url}");
    }
    Ok(())
}

/// A gateway that anyone else can reach (it listens beyond loopback, as every shipped
/// one does) refuses to start without the shared secret, naming the variable, instead
/// of drawing a secret of its own that its neighbours would refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_beyond_loopback_without_a_stream_token_secret_refuses_to_start() -> Result<()> {
    for (secret, says) in [
        (None, "openssl rand"),
        (Some("too-short"), "at least 32 bytes"),
    ] {
        let port = toolfleet_tests::free_port()?;
        let mut command = tokio::process::Command::new(gateway_node_path()?);
        command
            .env("TOOLFLEET_GATEWAY_ADDR", format!("0.0.0.0:{port}"))
            // Never reached: the settings are refused first.
            .env("TOOLFLEET_NATS_URL", "nats://127.0.0.1:1")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove(SECRET_VAR)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        if let Some(secret) = secret {
            command.env(SECRET_VAR, secret);
        }
        let out = tokio::time::timeout(Duration::from_secs(20), command.output())
            .await
            .context("the gateway kept running without a usable stream-token secret")??;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{secret:?}: {stderr}");
        assert!(stderr.contains(SECRET_VAR), "{secret:?}: {stderr}");
        assert!(stderr.contains(says), "{secret:?}: {stderr}");
        assert!(!stderr.contains("too-short"), "the value is never repeated");
        // It never listened.
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    }
    Ok(())
}

/// The expiry inside a stream token (`tfs_` + hex(`v1|expiry|…`) + `_` + mac).
fn token_expiry(token: &str) -> Result<u64> {
    let payload = token
        .strip_prefix("tfs_")
        .and_then(|t| t.split_once('_'))
        .map(|(payload, _)| payload)
        .context("not a stream token")?;
    let bytes = (0..payload.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&payload[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()?;
    let text = String::from_utf8(bytes)?;
    Ok(text.split('|').nth(1).context("no expiry")?.parse()?)
}

/// A token minted with a turn lived as long as the turn *asked* (`deadline_ms`
/// 3,605,000: an hour), though no turn runs past the fleet's cap of 300 s. Now it lives
/// the turn's real deadline plus the grace, at most the cap plus the grace (the TTL here
/// is 1 s, so the turn's life is what counts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_token_lives_no_longer_than_the_turn_cap_whatever_the_deadline_asked() -> Result<()>
{
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[
        ("TOOLFLEET_GATEWAY_STREAM_TOKEN_TTL_MS", "1000"),
        ("TOOLFLEET_GATEWAY_FINAL_GRACE_MS", "5000"),
    ])
    .await?;
    let key = create_key(&db, "demo").await?;
    let cap = toolfleet_gateway::turns::MAX_TURN_DEADLINE.as_secs() + 5;
    let mut asked = quick_turn("asks-an-hour-1");
    asked["deadline_ms"] = json!(3_605_000);

    let accepted = submit_async(&gateway, &key, &asked).await?;
    let now = toolfleet_gateway::stream_token::now_s();
    let expires_at = accepted["expires_at"].as_u64().context("no expiry")?;
    assert!(
        expires_at <= now + cap,
        "the token expires {} s from now, past the {cap} s a turn can last",
        expires_at.saturating_sub(now)
    );
    let token = accepted["token"].as_str().context("no token")?;
    assert_eq!(token_expiry(token)?, expires_at);
    // It reads its turn all the same.
    let url = accepted["events_url"].as_str().context("no url")?;
    let followed = gateway.http.get(gateway.url(url)).send().await?;
    assert_eq!(followed.status(), 200);
    let events = read_events(followed).await?;
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("final"));

    // The token of every other answer (`Toolfleet-Stream-Token`) alike.
    asked["turn_id"] = json!("asks-an-hour-2");
    let answered = gateway.json_turn(&key, &asked).await?;
    assert_eq!(answered.status(), 200);
    let header = token_header(&answered)?;
    let now = toolfleet_gateway::stream_token::now_s();
    let expiry = token_expiry(&header)?;
    assert!(expiry <= now + cap, "{} s", expiry.saturating_sub(now));
    Ok(())
}

/// The stream token an answer of `POST /v1/turns` carries (`Toolfleet-Stream-Token`).
fn token_header(answered: &reqwest::Response) -> Result<String> {
    Ok(answered
        .headers()
        .get("toolfleet-stream-token")
        .and_then(|v| v.to_str().ok())
        .context("no token header")?
        .to_string())
}
