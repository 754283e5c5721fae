//! The HTTP gateway as a frontend sees it: a real `gateway-node` process in front of a
//! real fleet (NATS, Redis, coordinator, worker), API keys in a real PostgreSQL
//! database, requests over real HTTP.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use toolfleet_tests::gateway::{
    comparable_final, create_key, read_events, read_first_events, stack, GatewayNode,
};
use toolfleet_tests::pg::TestDatabase;
use toolfleet_tests::{eventually_named, read_repo_json};

const TENANT: &str = "demo";

/// Every example decision, by file name.
fn examples() -> Result<Vec<(String, Value)>> {
    toolfleet_gateway::page::EXAMPLES
        .iter()
        .map(|(name, _)| {
            Ok((
                name.to_string(),
                read_repo_json(&format!("examples/decisions/{name}"))?,
            ))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_decision_shape_gives_the_same_final_over_sse_and_json() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, TENANT).await?;
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    for (name, decision) in examples()? {
        let body = json!({"decision": decision, "context": {"customerId": "cust_001"}});
        let response = gateway
            .http
            .post(gateway.url("/v1/turns"))
            .bearer_auth(&key)
            .header("accept", "text/event-stream")
            .header("traceparent", parent)
            .json(&body)
            .send()
            .await?;
        assert_eq!(response.status(), 200, "{name}");
        let traceparent = response.headers()["traceparent"].to_str()?.to_string();
        assert!(
            traceparent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
            "{name}: {traceparent}"
        );
        let events = read_events(response).await?;
        let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(kinds.first(), Some(&"ack"), "{name}: {kinds:?}");
        assert_eq!(kinds.last(), Some(&"final"), "{name}: {kinds:?}");
        assert_eq!(kinds.iter().filter(|k| **k == "final").count(), 1, "{name}");
        for event in &events {
            assert_eq!(event.data["type"], event.event.as_str(), "{name}");
        }
        let sse_final = &events.last().context("no events")?.data;

        let response = gateway.json_turn(&key, &body).await?;
        assert_eq!(response.status(), 200, "{name}");
        let answer: Value = response.json().await?;
        let json_final = &answer["final"];
        assert_eq!(answer["turn_id"], json_final["turn_id"], "{name}");
        let listed = answer["events"].as_array().context("no events")?;
        assert_eq!(
            listed.first().map(|e| &e["type"]),
            Some(&json!("ack")),
            "{name}"
        );
        assert_eq!(
            listed.last(),
            Some(json_final),
            "{name}: events end with the final"
        );
        assert_eq!(
            comparable_final(sse_final),
            comparable_final(json_final),
            "{name}: SSE and JSON finals differ"
        );
        let results = json_final["results"].as_array().context("no results")?;
        assert_eq!(json_final["summary"]["total"], results.len(), "{name}");
    }
    Ok(())
}

/// The error body's code, checking the shape on the way.
async fn error_code(response: reqwest::Response) -> Result<(u16, String)> {
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    let error = body["error"]
        .as_object()
        .with_context(|| format!("{status}: no error object in {body}"))?;
    assert!(error["message"].is_string(), "{body}");
    assert!(error["retryable"].is_boolean(), "{body}");
    Ok((
        status,
        error["code"].as_str().unwrap_or_default().to_string(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_answer_with_their_status_and_the_json_error_shape() -> Result<()> {
    let limits = [
        ("TOOLFLEET_GATEWAY_MAX_BODY_BYTES", "4096"),
        ("TOOLFLEET_GATEWAY_RATE_PER_S", "0.01"),
        ("TOOLFLEET_GATEWAY_BURST", "3"),
    ];
    let (mut fleet, _coordinator, _worker, db, gateway) = stack(&limits).await?;
    let key = create_key(&db, TENANT).await?;
    let turn = json!({"decision": {"type": "final", "text": "hello"}});
    let post = |key: Option<&str>, body: &Value| {
        let request = gateway.http.post(gateway.url("/v1/turns")).json(body);
        match key {
            Some(k) => request.bearer_auth(k),
            None => request,
        }
        .send()
    };

    let no_key = error_code(post(None, &turn).await?).await?;
    assert_eq!(no_key, (401, "unauthorized".into()));
    let bad_key = error_code(post(Some("tfk_0000"), &turn).await?).await?;
    assert_eq!(bad_key, (401, "unauthorized".into()));

    let other_tenant = json!({"tenant_id": "globex", "decision": {"type": "final", "text": "x"}});
    let forbidden = error_code(post(Some(&key), &other_tenant).await?).await?;
    assert_eq!(forbidden, (403, "tenant_not_allowed".into()));

    let other_key = create_key(&db, TENANT).await?;
    let big = json!({"decision": {"type": "final", "text": "x".repeat(10_000)}});
    // The gateway answers before reading the rest and closes the connection, so this
    // request does not hand it back to the pool for the next one.
    let too_large = gateway
        .http
        .post(gateway.url("/v1/turns"))
        .bearer_auth(&other_key)
        .header("connection", "close")
        .json(&big)
        .send()
        .await?;
    let too_large = error_code(too_large).await?;
    assert_eq!(too_large, (413, "payload_too_large".into()));

    // The key's burst of 3 is spent by the 403 above and two more requests.
    for _ in 0..2 {
        assert_eq!(post(Some(&key), &turn).await?.status(), 200);
    }
    let limited = post(Some(&key), &turn).await?;
    let retry_after: u64 = limited.headers()["retry-after"].to_str()?.parse()?;
    assert!(retry_after >= 1);
    assert_eq!(error_code(limited).await?, (429, "rate_limited".into()));

    // A revoked key stops working (the test gateway caches keys for 0 ms).
    let admin = db.admin().await?;
    let third = toolfleet_gateway::keys::create(&admin, TENANT, "revoked").await?;
    assert_eq!(post(Some(&third.key), &turn).await?.status(), 200);
    let listed = toolfleet_gateway::keys::list(&admin, Some(TENANT)).await?;
    assert!(listed
        .iter()
        .any(|k| k.id == third.id && k.revoked_at.is_none()));
    let revoked_key = toolfleet_gateway::keys::revoke(&admin, &third.id).await?;
    assert!(revoked_key.revoked_at.is_some());
    let revoked = error_code(post(Some(&third.key), &turn).await?).await?;
    assert_eq!(revoked, (401, "unauthorized".into()));

    // NATS gone: 503 with Retry-After, never a hang or another 5xx.
    fleet.nats.stop().await;
    let readyz = gateway.url("/readyz");
    eventually_named(
        "the gateway to see NATS gone",
        Duration::from_secs(10),
        || async {
            let response = gateway.http.get(&readyz).send().await.ok()?;
            (response.status() == 503).then_some(())
        },
    )
    .await?;
    let fresh = create_key(&db, TENANT).await?;
    let down = tokio::time::timeout(Duration::from_secs(10), post(Some(&fresh), &turn))
        .await
        .context("no answer while NATS is down")??;
    assert!(down.headers().contains_key("retry-after"));
    assert_eq!(error_code(down).await?, (503, "unavailable".into()));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_lists_the_tenants_tools_in_each_format() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, TENANT).await?;
    for format in ["openai", "anthropic", "mcp", "native"] {
        let response = gateway
            .http
            .get(gateway.url("/v1/tools"))
            .query(&[("format", format)])
            .header("x-api-key", &key)
            .send()
            .await?;
        assert_eq!(response.status(), 200, "{format}");
        let answer: Value = response.json().await?;
        assert_eq!(answer["format"], format);
        let tools = answer["tools"].as_array().context("no tools")?;
        assert!(tools.len() >= 3, "{format}: {answer}");
    }
    let bad = gateway
        .http
        .get(gateway.url("/v1/tools?format=yaml"))
        .bearer_auth(&key)
        .send()
        .await?;
    assert_eq!(error_code(bad).await?, (400, "invalid_request".into()));
    let spec = gateway.get_json("/openapi.json", None).await?;
    assert!(spec["paths"]["/v1/turns"]["post"].is_object());
    assert!(spec["paths"]["/v1/tools"]["get"].is_object());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_runs_as_its_own_nats_user_for_any_tenant_of_its_keys() -> Result<()> {
    use toolfleet_tests::secured::{SecuredServers, GATEWAY_PASSWORD};
    let servers = SecuredServers::start().await?;
    let port = toolfleet_tests::free_port()?;
    // The coordinator binds `frontend` to acme alone and the gateway to every tenant.
    let bindings = [("TOOLFLEET_FRONTEND_TENANTS", "frontend=acme;gateway=*")];
    let _coordinator = servers.coordinator_node(port, &bindings)?;
    let frontend = servers.frontend().await?;
    toolfleet_tests::fleet::wait_for_catalog(&frontend, "a coordinator answers", |_| true).await?;
    let db = TestDatabase::create().await?;
    let credentials = [
        ("TOOLFLEET_NATS_USER", "gateway"),
        ("TOOLFLEET_NATS_PASSWORD", GATEWAY_PASSWORD),
    ];
    let gateway = GatewayNode::start_on(
        &servers.nats.url(),
        servers.names.prefix(),
        &db,
        &credentials,
    )
    .await?;
    for tenant in ["acme", "globex"] {
        let key = create_key(&db, tenant).await?;
        let body = json!({"decision": {"type": "final", "text": format!("hello {tenant}")}});
        let response = gateway.json_turn(&key, &body).await?;
        assert_eq!(response.status(), 200, "{tenant}");
        let answer: Value = response.json().await?;
        assert_eq!(answer["final"]["text"], format!("hello {tenant}"));
    }
    Ok(())
}

/// A decision whose three calls end at 100, 500 and 900 ms.
fn staggered(turn_id: &str) -> Value {
    json!({
        "turn_id": turn_id,
        "decision": {"type": "tool_calls", "calls": [
            {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 100}},
            {"id": "c2", "toolName": "test.behave", "arguments": {"sleep_ms": 500}},
            {"id": "c3", "toolName": "test.behave", "arguments": {"sleep_ms": 900}}
        ]}
    })
}

fn seq(event: &toolfleet_tests::gateway::SseEvent) -> Result<u64> {
    Ok(event
        .id
        .as_deref()
        .context("an event without id")?
        .parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_resumes_after_its_last_event_id_and_the_final_arrives_once() -> Result<()>
{
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, TENANT).await?;

    // The client reads the ack and the first call states, then goes away.
    let response = gateway.stream_turn(&key, &staggered("resume-1")).await?;
    assert_eq!(response.status(), 200);
    let first = read_first_events(response, 2).await?;
    let last_id = seq(first.last().context("no events")?)?;

    // An EventSource reconnect: the events after Last-Event-ID, then the rest.
    let response = gateway
        .http
        .get(gateway.url("/v1/turns/resume-1/events"))
        .bearer_auth(&key)
        .header("last-event-id", last_id.to_string())
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let rest = read_events(response).await?;
    let all: Vec<_> = first.iter().chain(&rest).collect();
    let ids = all.iter().map(|e| seq(e)).collect::<Result<Vec<_>>>()?;
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>(), "{ids:?}");
    assert_eq!(all.iter().filter(|e| e.event == "final").count(), 1);
    assert_eq!(all.last().map(|e| e.event.as_str()), Some("final"));

    // The stored turn holds the same events; a client holding the final gets 204.
    let stored = gateway.get_json("/v1/turns/resume-1", Some(&key)).await?;
    assert_eq!(stored["status"], "ended");
    let stored_events = stored["events"].as_array().context("no events")?;
    assert_eq!(stored_events.len(), all.len());
    for (stored, sent) in stored_events.iter().zip(&all) {
        assert_eq!(stored, &sent.data);
    }
    assert_eq!(stored["final"], all[all.len() - 1].data);
    let done = gateway
        .http
        .get(gateway.url(&format!("/v1/turns/resume-1/events?after={}", ids.len())))
        .bearer_auth(&key)
        .send()
        .await?;
    assert_eq!(done.status(), 204);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_by_id_are_read_and_cancelled_for_their_tenant_only() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, TENANT).await?;
    let other = create_key(&db, "acme").await?;
    let get = |key: &str, path: &str| gateway.http.get(gateway.url(path)).bearer_auth(key).send();
    let delete = |key: &str, path: &str| {
        gateway
            .http
            .delete(gateway.url(path))
            .bearer_auth(key)
            .send()
    };

    assert_eq!(
        error_code(get(&key, "/v1/turns/never-submitted").await?).await?,
        (404, "unknown_turn".into())
    );
    // A running turn: its events so far; another tenant's key may neither read nor
    // cancel it.
    let long = json!({"turn_id": "by-id-1", "decision": {"type": "tool_calls", "calls": [
        {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 5000}}
    ]}});
    let submitted = gateway.stream_turn(&key, &long).await?;
    let first = read_first_events(submitted, 1).await?;
    assert_eq!(first[0].event, "ack");
    let running: Value = get(&key, "/v1/turns/by-id-1").await?.json().await?;
    assert_eq!(running["status"], "running", "{running}");
    assert!(running.get("final").is_none());
    // Turn ids are scoped by tenant: to another tenant this id is one it never used.
    assert_eq!(
        error_code(get(&other, "/v1/turns/by-id-1").await?).await?,
        (404, "unknown_turn".into())
    );
    assert_eq!(
        error_code(delete(&other, "/v1/turns/by-id-1").await?).await?,
        (404, "unknown_turn".into())
    );

    // Cancelled by its own key: ended at once, the call `cancelled`; again: unchanged.
    let cancelled = delete(&key, "/v1/turns/by-id-1").await?;
    assert_eq!(cancelled.status(), 200);
    let cancelled: Value = cancelled.json().await?;
    assert_eq!(cancelled["outcome"], "cancelled", "{cancelled}");
    let ended: Value = get(&key, "/v1/turns/by-id-1").await?.json().await?;
    assert_eq!(ended["status"], "ended", "{ended}");
    assert_eq!(ended["final"]["results"][0]["state"], "cancelled");
    let again: Value = delete(&key, "/v1/turns/by-id-1").await?.json().await?;
    assert_eq!(again["outcome"], "already_ended");
    assert_eq!(again["ended"], "cancelled");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_retry_of_the_same_turn_id_attaches_and_runs_the_calls_once() -> Result<()> {
    let (fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, TENANT).await?;
    let mut progress = fleet.subscribe_progress().await?;
    let body = staggered("http-retry-1");
    let (first, second) = tokio::join!(gateway.json_turn(&key, &body), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        gateway.json_turn(&key, &body).await
    });
    let first: Value = first?.json().await?;
    let second: Value = second?.json().await?;
    assert_eq!(first["final"], second["final"]);
    assert_eq!(first["final"]["summary"]["ok"], 3, "{first}");
    let mut starts = 0;
    // The fleet stores the client's id scoped by its tenant.
    let stored = toolfleet_gateway::turn_scope::stored_turn_id(TENANT, "http-retry-1");
    assert_eq!(first["turn_id"], "http-retry-1");
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while let Ok(Some(message)) =
        tokio::time::timeout_at(until, futures::StreamExt::next(&mut progress)).await
    {
        if message.subject.contains(&format!(".{stored}."))
            && String::from_utf8_lossy(&message.payload).contains("\"started\"")
        {
            starts += 1;
        }
    }
    assert_eq!(starts, 3, "each call started once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_turn_when_so_configured() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) =
        stack(&[("TOOLFLEET_GATEWAY_CANCEL_ON_DISCONNECT", "true")]).await?;
    let key = create_key(&db, TENANT).await?;
    let long = json!({"turn_id": "gone-1", "decision": {"type": "tool_calls", "calls": [
        {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 5000}}
    ]}});
    let response = gateway.stream_turn(&key, &long).await?;
    let first = read_first_events(response, 1).await?;
    assert_eq!(first[0].event, "ack");
    // The connection is closed: the turn ends well before its call would.
    let stored = eventually_named("the turn is cancelled", Duration::from_secs(3), || async {
        let response = gateway
            .http
            .get(gateway.url("/v1/turns/gone-1"))
            .bearer_auth(&key)
            .send()
            .await
            .ok()?;
        let stored: Value = response.json().await.ok()?;
        (stored["status"] == "ended").then_some(stored)
    })
    .await?;
    assert_eq!(
        stored["final"]["results"][0]["state"], "cancelled",
        "{stored}"
    );
    Ok(())
}
