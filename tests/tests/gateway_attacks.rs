//! The gateway from the attacker's seat: a flood of guessed API keys from one address
//! (and from the address honest clients share behind a proxy), a cache filled with other
//! keys, an MCP session taken over with another key, one key opening sessions without
//! end, and another tenant's turn ids probed and taken. Each test runs a real
//! `gateway-node` in front of a real fleet, with its keys in a real PostgreSQL database;
//! where the honest client must sit apart, it sends from another loopback address
//! (127.0.0.2), which Linux routes to `lo` like 127.0.0.1.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};
use toolfleet_tests::eventually_named;
use toolfleet_tests::gateway::{create_key, stack, GatewayNode, HTTP_WAIT};
use toolfleet_tests::pg::TestDatabase;

/// Guessed keys the flood sends.
const FLOOD: usize = 3000;
/// Requests of the flood in flight at once.
const FLOOD_CONCURRENCY: usize = 32;
/// Failed checks one address may make at once in these tests.
const FAILURE_BURST: usize = 20;
/// Failed checks an address earns back a minute in the flood test: one, so the flooding
/// address stays out of tokens for the rest of the test.
const FAILURES_PER_MIN: usize = 1;

/// A client whose requests leave from `source`.
fn client_from(source: Ipv4Addr) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .local_address(IpAddr::V4(source))
        .timeout(HTTP_WAIT)
        .build()?)
}

/// `GET /v1/tools` with `key`: the status and whether a 429 named `Retry-After`.
async fn tools(client: &reqwest::Client, gateway: &GatewayNode, key: &str) -> (u16, bool) {
    match client
        .get(gateway.url("/v1/tools"))
        .bearer_auth(key)
        .send()
        .await
    {
        Ok(response) => {
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|s| s >= 1);
            (response.status().as_u16(), retry_after)
        }
        Err(_) => (0, false),
    }
}

/// Transactions PostgreSQL counted in `db` so far. Every other connection to the
/// database is ended first (the gateway reconnects on its next lookup): a backend writes
/// out its statistics when it exits, so the count includes every lookup made until now.
async fn transactions(db: &TestDatabase) -> Result<i64> {
    let admin = db.admin().await?;
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await?;
    eventually_named(
        "the database's other connections to end",
        Duration::from_secs(10),
        || async {
            let row = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                    &[],
                )
                .await
                .ok()?;
            (row.get::<_, i64>(0) == 0).then_some(())
        },
    )
    .await?;
    // The count a moment later: the statistics of an ending backend may land just
    // after it leaves `pg_stat_activity`.
    let read = || async {
        let row = admin
            .query_one(
                "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database
                 WHERE datname = current_database()",
                &[],
            )
            .await?;
        anyhow::Ok(row.get::<_, i64>(0))
    };
    let first = read().await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(read().await?.max(first))
}

/// Waits until `key` works again from `client` after [`transactions`] ended the
/// gateway's database connection.
async fn reconnected(client: &reqwest::Client, gateway: &GatewayNode, key: &str) -> Result<()> {
    eventually_named(
        "the gateway to reach PostgreSQL again",
        Duration::from_secs(10),
        || async { (tools(client, gateway, key).await.0 == 200).then_some(()) },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_guessed_keys_from_one_address_is_refused_before_postgres() -> Result<()> {
    let burst = FAILURE_BURST.to_string();
    let per_min = FAILURES_PER_MIN.to_string();
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[
        ("TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST", &burst),
        ("TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN", &per_min),
    ])
    .await?;
    let key = create_key(&db, "acme").await?;
    let honest = client_from(Ipv4Addr::new(127, 0, 0, 2))?;
    let attacker = client_from(Ipv4Addr::LOCALHOST)?;
    // The honest client works before the flood, and its latency then.
    let mut quiet = Vec::new();
    for _ in 0..10 {
        let started = Instant::now();
        assert_eq!(tools(&honest, &gateway, &key).await.0, 200);
        quiet.push(started.elapsed());
    }
    let before = transactions(&db).await?;
    reconnected(&honest, &gateway, &key).await?;

    let flooding = std::sync::atomic::AtomicBool::new(true);
    let honest_side = async {
        let mut seen = Vec::new();
        while flooding.load(std::sync::atomic::Ordering::Relaxed) {
            let started = Instant::now();
            let (status, _) = tools(&honest, &gateway, &key).await;
            seen.push((status, started.elapsed()));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        seen
    };
    let started = Instant::now();
    let flood = async {
        let answers: Vec<(u16, bool)> = futures::stream::iter(0..FLOOD)
            .map(|_| {
                let guess = toolfleet_gateway::keys::generate_key();
                let (attacker, gateway) = (&attacker, &gateway);
                async move { tools(attacker, gateway, &guess).await }
            })
            .buffer_unordered(FLOOD_CONCURRENCY)
            .collect()
            .await;
        flooding.store(false, std::sync::atomic::Ordering::Relaxed);
        answers
    };
    let (answers, honest_seen) = tokio::join!(flood, honest_side);
    let elapsed = started.elapsed();
    let after = transactions(&db).await?;

    let unauthorized = answers.iter().filter(|(s, _)| *s == 401).count();
    let limited = answers.iter().filter(|(s, _)| *s == 429).count();
    let limited_with_wait = answers.iter().filter(|(s, r)| *s == 429 && *r).count();
    let lookups = after - before;
    let mut honest_ms: Vec<u128> = honest_seen.iter().map(|(_, d)| d.as_millis()).collect();
    honest_ms.sort_unstable();
    let mut quiet_ms: Vec<u128> = quiet.iter().map(Duration::as_millis).collect();
    quiet_ms.sort_unstable();
    eprintln!(
        "flood of {FLOOD} guessed keys in {elapsed:?}: {unauthorized} × 401, {limited} × 429; \
         {lookups} PostgreSQL transactions; honest requests: {} during the flood, {:?} ms \
         (quiet: {:?} ms)",
        honest_seen.len(),
        honest_ms,
        quiet_ms
    );

    // Every guess was refused: 401 until the address's failures ran out, 429 after.
    assert_eq!(unauthorized + limited, FLOOD, "only 401 and 429");
    let earned = (elapsed.as_secs_f64() * FAILURES_PER_MIN as f64 / 60.0).ceil() as usize;
    assert!(
        unauthorized <= FAILURE_BURST + earned + 1,
        "{unauthorized} guesses were looked up; the burst is {FAILURE_BURST}, {earned} earned back"
    );
    assert_eq!(limited_with_wait, limited, "every 429 names Retry-After");
    // PostgreSQL saw the guesses that were looked up and the honest requests, not the
    // flood (before the limit: two transactions a guess, a prepare and the query).
    let honest_lookups = (honest_seen.len() + 20) as i64;
    assert!(
        lookups <= 2 * ((unauthorized as i64) + honest_lookups),
        "{lookups} transactions for {unauthorized} looked-up guesses and {honest_lookups} honest requests"
    );
    assert!(lookups < (FLOOD / 10) as i64, "{lookups} transactions");
    // The honest client of the same tenant, from another address, was never refused.
    assert!(!honest_seen.is_empty());
    for (status, _) in &honest_seen {
        assert_eq!(*status, 200, "honest answers: {honest_seen:?}");
    }
    // The flooding address itself waits with a good key this gateway never saw work
    // (PostgreSQL is not asked about it), and says how long.
    let unseen = create_key(&db, "acme").await?;
    assert_eq!(tools(&attacker, &gateway, &unseen).await, (429, true));
    // The honest address still works after the flood.
    reconnected(&honest, &gateway, &key).await?;
    // And a key that worked before is never held back by its address's failures, even
    // from the flooding address itself (the key cache is off in this test: it is looked
    // up again).
    assert_eq!(tools(&attacker, &gateway, &key).await.0, 200);
    Ok(())
}

/// Behind the shipped Ingress every client reaches the gateway from the ingress
/// controller's address. A guesser there used up that address's failures and, once the
/// honest tenants' keys fell out of the key cache (5 s), their requests drew from the
/// guesser's empty bucket: 176 of 308 answered 429. Here everyone is 127.0.0.1, the
/// cache lasts 1 s and the address may fail 5 times (one earned back a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guesser_behind_the_same_address_never_holds_back_a_valid_key() -> Result<()> {
    const CACHE_MS: u64 = 1000;
    let cache_ms = CACHE_MS.to_string();
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[
        ("TOOLFLEET_GATEWAY_KEY_CACHE_MS", &cache_ms),
        ("TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST", "5"),
        ("TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN", "1"),
    ])
    .await?;
    let shared = client_from(Ipv4Addr::LOCALHOST)?;
    let mut keys = Vec::new();
    for tenant in ["acme", "globex", "initech"] {
        let key = create_key(&db, tenant).await?;
        // Each tenant's key is in use before the guesser starts.
        assert_eq!(tools(&shared, &gateway, &key).await.0, 200, "{tenant}");
        keys.push(key);
    }
    // The guesser, from the same address, until the address is out of failures.
    let mut guessed = Vec::new();
    while !guessed.contains(&429) && guessed.len() < 50 {
        let guess = toolfleet_gateway::keys::generate_key();
        guessed.push(tools(&shared, &gateway, &guess).await.0);
    }
    assert!(
        guessed.contains(&429),
        "the address never ran out: {guessed:?}"
    );

    // Then both go on for 3.5 cache periods: a guess every 50 ms, and a request of each
    // tenant every 250 ms.
    let until = Instant::now() + Duration::from_millis(CACHE_MS * 7 / 2);
    let guessing = async {
        let mut seen = Vec::new();
        while Instant::now() < until {
            let guess = toolfleet_gateway::keys::generate_key();
            seen.push(tools(&shared, &gateway, &guess).await.0);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        seen
    };
    let honest = async {
        let mut seen = Vec::new();
        while Instant::now() < until {
            for (i, key) in keys.iter().enumerate() {
                seen.push((i, tools(&shared, &gateway, key).await.0));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        seen
    };
    let (guesses, answers) = tokio::join!(guessing, honest);
    eprintln!(
        "{} guesses ({} × 429), {} honest requests",
        guesses.len(),
        guesses.iter().filter(|s| **s == 429).count(),
        answers.len()
    );
    // The guesser pays for its guesses ...
    assert!(!guesses.is_empty());
    assert!(guesses.iter().all(|s| *s == 429), "{guesses:?}");
    // ... and no tenant's valid key is ever refused for them, across the cache periods.
    assert!(answers.len() >= 3 * 12, "{answers:?}");
    assert!(answers.iter().all(|(_, s)| *s == 200), "{answers:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_key_stays_cached_while_other_keys_and_guesses_fill_the_caches() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[
        ("TOOLFLEET_GATEWAY_KEY_CACHE_MS", "60000"),
        ("TOOLFLEET_GATEWAY_KEY_CACHE_ENTRIES", "8"),
        ("TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_ENTRIES", "8"),
        ("TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST", "200"),
        ("TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN", "60"),
    ])
    .await?;
    let admin = db.admin().await?;
    let mut made = Vec::new();
    for i in 0..25 {
        made.push(toolfleet_gateway::keys::create(&admin, "acme", &format!("key {i}")).await?);
    }
    let (kept, others) = made.split_first().context("keys")?;
    let client = client_from(Ipv4Addr::LOCALHOST)?;
    let guesser = client_from(Ipv4Addr::new(127, 0, 0, 3))?;

    assert_eq!(tools(&client, &gateway, &kept.key).await.0, 200);
    // Three times the cache's size of other valid keys; the kept key is used between
    // them, as a busy client's key is.
    for (i, other) in others.iter().enumerate() {
        assert_eq!(tools(&client, &gateway, &other.key).await.0, 200, "key {i}");
        if i % 3 == 2 {
            assert_eq!(tools(&client, &gateway, &kept.key).await.0, 200);
        }
    }
    // Guesses from a third address fill the unknown-key cache many times over and use
    // up that address's failures.
    let guesses: Vec<u16> = futures::stream::iter(0..300)
        .map(|_| {
            let guess = toolfleet_gateway::keys::generate_key();
            let (guesser, gateway) = (&guesser, &gateway);
            async move { tools(guesser, gateway, &guess).await.0 }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(
        guesses.iter().all(|s| *s == 401 || *s == 429),
        "{guesses:?}"
    );
    assert!(guesses.contains(&429), "the guessing address ran out");

    // Revoked now: a key the gateway asks PostgreSQL about again is refused, a cached
    // one still works until its cache period ends.
    toolfleet_gateway::keys::revoke(&admin, &kept.id).await?;
    let oldest = others.first().context("other keys")?;
    toolfleet_gateway::keys::revoke(&admin, &oldest.id).await?;
    assert_eq!(
        tools(&client, &gateway, &kept.key).await.0,
        200,
        "the kept key was still cached: neither the other keys nor the guesses pushed it out"
    );
    // A cached key works even from the address that ran out of failures.
    assert_eq!(tools(&guesser, &gateway, &kept.key).await.0, 200);
    assert_eq!(
        tools(&client, &gateway, &oldest.key).await.0,
        401,
        "the least recently used key was forgotten and read again"
    );
    Ok(())
}

/// A JSON-RPC message to `/mcp` under `key`, in session `session` when given.
async fn mcp_post(
    gateway: &GatewayNode,
    key: &str,
    session: Option<&str>,
    message: &Value,
) -> Result<reqwest::Response> {
    let mut request = gateway
        .http
        .post(gateway.url("/mcp"))
        .bearer_auth(key)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .json(message);
    if let Some(session) = session {
        request = request.header("mcp-session-id", session);
    }
    Ok(request.send().await?)
}

/// The body of `response`, read for at most [`HTTP_WAIT`].
async fn body_text(response: reqwest::Response) -> Result<String> {
    let mut body = response.bytes_stream();
    let mut text = String::new();
    let read = async {
        while let Some(chunk) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk?));
            // One JSON-RPC answer is all these requests get.
            if text.contains("\"jsonrpc\"") && text.contains("\n\n") {
                break;
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(HTTP_WAIT, read)
        .await
        .context("the MCP answer stalled")??;
    Ok(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_session_answers_only_the_key_that_opened_it() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let owner = create_key(&db, "acme").await?;
    let same_tenant = create_key(&db, "acme").await?;
    let other_tenant = create_key(&db, "globex").await?;

    let session = open_session(&gateway, &owner).await?;

    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let tools_list = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list"});
    for (who, key) in [
        ("another tenant's key", &other_tenant),
        ("another key of the same tenant", &same_tenant),
    ] {
        for message in [&ping, &tools_list] {
            let refused = mcp_post(&gateway, key, Some(&session), message).await?;
            assert_eq!(refused.status(), StatusCode::NOT_FOUND, "{who}: {message}");
        }
        // Nor may it listen on the session's stream or end the session.
        let listen = gateway
            .http
            .get(gateway.url("/mcp"))
            .bearer_auth(key)
            .header("accept", "text/event-stream")
            .header("mcp-session-id", &session)
            .send()
            .await?;
        assert_eq!(listen.status(), StatusCode::NOT_FOUND, "{who}: GET");
        let end = gateway
            .http
            .delete(gateway.url("/mcp"))
            .bearer_auth(key)
            .header("mcp-session-id", &session)
            .send()
            .await?;
        assert_eq!(end.status(), StatusCode::NOT_FOUND, "{who}: DELETE");
    }

    // The owner's session is untouched and still answers its owner.
    let answered = mcp_post(&gateway, &owner, Some(&session), &ping).await?;
    assert_eq!(answered.status(), StatusCode::OK);
    let text = body_text(answered).await?;
    assert!(text.contains("\"result\""), "{text}");
    // The owner ends it; then it is gone for everyone.
    let end = gateway
        .http
        .delete(gateway.url("/mcp"))
        .bearer_auth(&owner)
        .header("mcp-session-id", &session)
        .send()
        .await?;
    assert!(end.status().is_success(), "{}", end.status());
    let gone = mcp_post(&gateway, &owner, Some(&session), &ping).await?;
    assert_eq!(gone.status(), StatusCode::NOT_FOUND);
    Ok(())
}

/// Opens an MCP session with `key` (`initialize`, then `notifications/initialized`);
/// its id.
async fn open_session(gateway: &GatewayNode, key: &str) -> Result<String> {
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "gateway-attacks", "version": "0"}}});
    let opened = mcp_post(gateway, key, None, &initialize).await?;
    assert_eq!(opened.status(), StatusCode::OK);
    let session = opened
        .headers()
        .get("mcp-session-id")
        .context("initialize named no session")?
        .to_str()?
        .to_string();
    let text = body_text(opened).await?;
    assert!(text.contains("\"result\""), "{text}");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let notified = mcp_post(gateway, key, Some(&session), &initialized).await?;
    assert_eq!(notified.status(), StatusCode::ACCEPTED);
    Ok(session)
}

/// `ping` in `session` under `key`: the status (a 200 must carry the answer).
async fn ping(gateway: &GatewayNode, key: &str, session: &str) -> Result<u16> {
    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let answered = mcp_post(gateway, key, Some(session), &ping).await?;
    let status = answered.status().as_u16();
    if status == 200 {
        let text = body_text(answered).await?;
        assert!(text.contains("\"result\""), "{text}");
    }
    Ok(status)
}

/// One key opened 3,632 MCP sessions in 180 s at its own rate, ~78 KB each, until the
/// gateway passed its memory limit. Now a key holds at most its bound (3 here): each
/// session it opens past it closes that key's least recently used one, and another
/// key's session is never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_holds_at_most_its_bound_of_mcp_sessions_and_loses_only_its_own_oldest(
) -> Result<()> {
    const BOUND: usize = 3;
    let bound = BOUND.to_string();
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[
        ("TOOLFLEET_GATEWAY_MCP_SESSIONS_PER_KEY", &bound),
        ("TOOLFLEET_GATEWAY_RATE_PER_S", "1000"),
        ("TOOLFLEET_GATEWAY_BURST", "1000"),
    ])
    .await?;
    let key = create_key(&db, "acme").await?;
    let neighbour = create_key(&db, "globex").await?;
    let same_tenant = create_key(&db, "acme").await?;
    let theirs = open_session(&gateway, &neighbour).await?;
    let colleagues = open_session(&gateway, &same_tenant).await?;

    let mut opened: Vec<String> = Vec::new();
    for round in 0..4 * BOUND {
        opened.push(open_session(&gateway, &key).await?);
        // Only the newest `BOUND` sessions answer; every older one is gone (404, on
        // which an MCP client opens a new session). The live ones are used oldest
        // first, so their order of use stays their order of opening.
        let (gone, live) = opened.split_at(opened.len().saturating_sub(BOUND));
        for (i, session) in gone.iter().enumerate() {
            assert_eq!(
                ping(&gateway, &key, session).await?,
                404,
                "round {round}: session {i} should be closed"
            );
        }
        for (i, session) in live.iter().enumerate() {
            assert_eq!(
                ping(&gateway, &key, session).await?,
                200,
                "round {round}: live session {i}"
            );
        }
    }
    // The least recently *used* session goes, not the oldest opened: the oldest live
    // one, used now, outlives the next opening.
    let live: Vec<String> = opened[opened.len() - BOUND..].to_vec();
    assert_eq!(ping(&gateway, &key, &live[0]).await?, 200);
    let newest = open_session(&gateway, &key).await?;
    assert_eq!(ping(&gateway, &key, &live[1]).await?, 404);
    for session in [&live[0], &live[2], &newest] {
        assert_eq!(ping(&gateway, &key, session).await?, 200);
    }
    // Other keys' sessions, another tenant's and the same tenant's, were never touched.
    assert_eq!(ping(&gateway, &neighbour, &theirs).await?, 200);
    assert_eq!(ping(&gateway, &same_tenant, &colleagues).await?, 200);
    Ok(())
}

/// A turn id through the gateway, as tenant `key` asks for it: the status and the body.
async fn turn_answer(
    gateway: &GatewayNode,
    method: reqwest::Method,
    path: &str,
    key: &str,
) -> Result<(u16, String)> {
    let response = gateway
        .http
        .request(method, gateway.url(path))
        .bearer_auth(key)
        .send()
        .await?;
    Ok((response.status().as_u16(), response.text().await?))
}

/// Turn ids shared one namespace across tenants: another tenant's id answered 403 on
/// GET (404 for an id nobody used), and a POST could take an id first. Now a turn id is
/// the client's name within its tenant: another tenant's id is an id this tenant never
/// used, answered with the same bytes, and posting it makes a turn of one's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_turn_id_answers_as_an_unknown_one_and_cannot_be_taken() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let owner = create_key(&db, "acme").await?;
    let prober = create_key(&db, "globex").await?;
    const ID: &str = "order-1001";

    let body = json!({"turn_id": ID, "decision": {"type": "tool_calls", "calls": [
        {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 10}}
    ]}});
    let answered = gateway.json_turn(&owner, &body).await?;
    assert_eq!(answered.status(), StatusCode::OK);
    let answered: Value = answered.json().await?;
    // The owner sees its own id everywhere.
    assert_eq!(answered["turn_id"], ID, "{answered}");
    assert_eq!(answered["final"]["turn_id"], ID, "{answered}");
    for event in answered["events"].as_array().context("no events")? {
        assert_eq!(event["turn_id"], ID, "{event}");
    }
    let stored_id = toolfleet_gateway::turn_scope::stored_turn_id("acme", ID);
    assert!(!answered.to_string().contains(&stored_id), "{answered}");
    let (status, stored) = turn_answer(
        &gateway,
        reqwest::Method::GET,
        &format!("/v1/turns/{ID}"),
        &owner,
    )
    .await?;
    assert_eq!(status, 200, "{stored}");
    let stored: Value = serde_json::from_str(&stored)?;
    assert_eq!(stored["status"], "ended");
    assert_eq!(stored["turn_id"], ID);

    // The other tenant asks about that id and about an id nobody used: the same answer,
    // byte for byte, on every operation.
    let nobodys = format!("never-{}", uuid::Uuid::new_v4().simple());
    for (method, suffix) in [
        (reqwest::Method::GET, ""),
        (reqwest::Method::GET, "/events"),
        (reqwest::Method::DELETE, ""),
    ] {
        let theirs = turn_answer(
            &gateway,
            method.clone(),
            &format!("/v1/turns/{ID}{suffix}"),
            &prober,
        )
        .await?;
        let unknown = turn_answer(
            &gateway,
            method.clone(),
            &format!("/v1/turns/{nobodys}{suffix}"),
            &prober,
        )
        .await?;
        assert_eq!(theirs, unknown, "{method} {suffix}");
        assert_eq!(theirs.0, 404, "{method} {suffix}: {}", theirs.1);
    }

    // Posting the owner's id makes the prober's own turn; the owner's is untouched.
    let taken = json!({"turn_id": ID, "decision": {"type": "final", "text": "globex's own"}});
    let posted = gateway.json_turn(&prober, &taken).await?;
    assert_eq!(posted.status(), StatusCode::OK);
    let posted: Value = posted.json().await?;
    assert_eq!(posted["turn_id"], ID);
    assert_eq!(posted["final"]["text"], "globex's own", "{posted}");
    let (status, again) = turn_answer(
        &gateway,
        reqwest::Method::GET,
        &format!("/v1/turns/{ID}"),
        &owner,
    )
    .await?;
    assert_eq!(status, 200);
    let again: Value = serde_json::from_str(&again)?;
    assert_eq!(again, stored, "the owner's turn changed");
    assert_eq!(again["final"]["results"][0]["state"], "done");
    // The owner's retry of its own id still attaches to its own turn.
    let retried: Value = gateway.json_turn(&owner, &body).await?.json().await?;
    assert_eq!(retried["final"], answered["final"]);
    // And each tenant reads its own turn under the one id.
    let (_, prober_view) = turn_answer(
        &gateway,
        reqwest::Method::GET,
        &format!("/v1/turns/{ID}"),
        &prober,
    )
    .await?;
    let prober_view: Value = serde_json::from_str(&prober_view)?;
    assert_eq!(
        prober_view["final"]["text"], "globex's own",
        "{prober_view}"
    );
    Ok(())
}
