//! TLS between every process and the servers, on a CA and certificates the test makes
//! with `openssl`: a `nats-server` with a `tls {}` block and a `redis-server` with only a
//! TLS port. A coordinator and a worker (`fleet-node` processes) reach them through the
//! TLS settings alone (`tls://` and `rediss://` URLs, `TOOLFLEET_NATS_CA_FILE`,
//! `TOOLFLEET_REDIS_CA_FILE`) and a turn of several tools ends with every call done and
//! one `final`; a Python SDK worker does the same. A plain connection to that NATS is
//! refused, and a client that lacks the CA fails with an error instead of hanging.
//! Where the servers verify clients, the client certificate
//! (`TOOLFLEET_*_CERT_FILE`, `TOOLFLEET_*_KEY_FILE`) is what lets a client in.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use toolfleet_common::client::ClientErrorKind;
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::tls::TlsFiles;
use toolfleet_common::{CallState, FleetClient, TurnEvent};
use toolfleet_tests::fleet::{call, crm_call, result_of, tool_calls, turn, wait_for_tools_on};
use toolfleet_tests::tls::TlsServers;

/// Longest wait for one turn event.
const EVENT_WAIT: Duration = Duration::from_secs(15);

/// Longest a refused connection may take to fail: above the Redis client's own
/// reconnection attempts (about 6 s), far below a hang.
const REFUSAL_WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_runs_with_every_connection_over_tls() -> Result<()> {
    let servers = TlsServers::start(false).await?;
    let _coordinator = servers.node("coordinator", &[])?;
    // The worker names NATS by `nats://`: its CA file alone makes TLS required.
    let nats_url = servers.nats.url();
    let _worker = servers.node("worker", &[("TOOLFLEET_NATS_URL", &nats_url)])?;
    let client = servers.client().await?;
    let tools = [
        "crm.getOpenInvoices",
        "crm.getNextAppointment",
        "test.behave",
    ];
    wait_for_tools_on(&client, &tools).await?;

    let calls = vec![
        crm_call("invoices", "crm.getOpenInvoices", "cust_001"),
        crm_call("appointment", "crm.getNextAppointment", "cust_001"),
        call("echo", "test.behave", json!({"value": "over tls"})),
    ];
    let outcome = client
        .run_turn(turn("acme", tool_calls(calls)), EVENT_WAIT)
        .await?;
    let finals = outcome
        .events
        .iter()
        .filter(|event| matches!(event, TurnEvent::Final(_)))
        .count();
    assert_eq!(finals, 1);
    let fin = &outcome.final_event;
    for id in ["invoices", "appointment", "echo"] {
        assert_eq!(result_of(fin, id)?.state, CallState::Done, "{fin:?}");
    }
    assert_eq!(fin.summary.ok, 3, "{fin:?}");

    // The join lives in the TLS-only Redis: read back over `rediss://` with the CA.
    let mut redis = servers.redis_with(servers.client_tls()).await?;
    let calls: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(servers.names.turn_calls_key(&outcome.turn_id))
        .query_async(&mut redis)
        .await?;
    assert_eq!(
        toolfleet_tests::fleet::recorded_calls(&calls).len(),
        3,
        "{calls:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_untrusting_clients_are_refused() -> Result<()> {
    let servers = TlsServers::start(false).await?;

    // The NATS protocol in plain text: the server announces that TLS is required and
    // closes the connection without answering the PING.
    let plain = tokio::time::timeout(EVENT_WAIT, async {
        let stream = TcpStream::connect(("127.0.0.1", servers.nats.port())).await?;
        let mut stream = BufReader::new(stream);
        let mut info = String::new();
        stream.read_line(&mut info).await?;
        stream
            .get_mut()
            .write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
            .await?;
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await?;
        anyhow::Ok((info, rest))
    })
    .await
    .context("the server kept a plain connection open")??;
    let (info, rest) = plain;
    let info: Value = serde_json::from_str(info.trim().trim_start_matches("INFO "))?;
    assert_eq!(info["tls_required"], json!(true), "{info}");
    assert!(
        !rest.windows(4).any(|w| w == b"PONG"),
        "a plain client got an answer"
    );

    // A client that does not trust the CA: an error, by `tls://` or by `nats://`.
    for url in [servers.nats_tls_url(), servers.nats.url()] {
        let connect = FleetClient::connect(&url, servers.names.prefix());
        let refused = tokio::time::timeout(REFUSAL_WAIT, connect)
            .await
            .with_context(|| format!("connecting to {url} without the CA hung"))?;
        match refused {
            Ok(_) => anyhow::bail!("{url}: a client without the CA connected"),
            Err(error) => assert_eq!(error.kind(), ClientErrorKind::Connect),
        }
    }

    // Redis without the CA: an error too.
    let redis = tokio::time::timeout(REFUSAL_WAIT, servers.redis_with(TlsFiles::none()))
        .await
        .context("connecting to Redis without the CA hung")?;
    assert!(redis.is_err(), "a Redis client without the CA connected");

    // The same clients with the CA get in.
    let client = servers.client().await?;
    client.nats().flush().await?;
    let mut redis = servers.redis_with(servers.client_tls()).await?;
    let pong: String = redis::cmd("PING").query_async(&mut redis).await?;
    assert_eq!(pong, "PONG");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_that_verify_clients_take_the_client_certificate() -> Result<()> {
    let servers = TlsServers::start(true).await?;

    let client = servers.client().await?;
    client.nats().flush().await?;
    let mut redis = servers.redis_with(servers.client_tls()).await?;
    let pong: String = redis::cmd("PING").query_async(&mut redis).await?;
    assert_eq!(pong, "PONG");

    let ca_only = TlsFiles::trusting(servers.certificates.ca_file());
    let (url, credentials) = (
        servers.nats_tls_url(),
        NatsCredentials::none().with_tls(ca_only.clone()),
    );
    let connect = FleetClient::connect_with(&url, servers.names.prefix(), &credentials);
    let refused = tokio::time::timeout(REFUSAL_WAIT, connect)
        .await
        .context("connecting to NATS without a client certificate hung")?;
    match refused {
        Ok(_) => anyhow::bail!("a NATS client without a certificate connected"),
        Err(error) => assert_eq!(error.kind(), ClientErrorKind::Connect),
    }
    let redis = tokio::time::timeout(REFUSAL_WAIT, async {
        let mut redis = servers.redis_with(ca_only).await?;
        let pong: String = redis::cmd("PING").query_async(&mut redis).await?;
        anyhow::Ok(pong)
    })
    .await
    .context("Redis without a client certificate hung")?;
    assert!(
        redis.is_err(),
        "a Redis client without a certificate got in"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_worker_serves_over_tls() -> Result<()> {
    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
    let servers = TlsServers::start(false).await?;
    let _coordinator = servers.node("coordinator", &[])?;
    let _worker = servers.python_worker(&python, "examples/python-worker/worker.py")?;
    let client = servers.client().await?;
    wait_for_tools_on(&client, &["text.stats"]).await?;

    let calls = vec![call(
        "py",
        "text.stats",
        json!({"text": "Over TLS. Both ways."}),
    )];
    let outcome = client
        .run_turn(turn("acme", tool_calls(calls)), EVENT_WAIT)
        .await?;
    let result = result_of(&outcome.final_event, "py")?;
    assert_eq!(result.state, CallState::Done, "{result:?}");
    assert_eq!(
        result.result,
        Some(json!({"words": 4, "sentences": 2, "characters": 20}))
    );
    Ok(())
}
