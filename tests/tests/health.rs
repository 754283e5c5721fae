//! Health that means something: the HTTP endpoint answers from the first moment and
//! names the step start-up waits on, readiness fails while a process drains or while
//! the coordinators refuse one of a worker's definitions, and liveness fails when a
//! supervised background task died.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_packs as packs;
use toolfleet_tests::fleet::{call, read_final, result_of, until_state, Fleet, Running};
use toolfleet_tests::{free_port, http_get, wait_http_status};

const WAIT: Duration = Duration::from_secs(10);

fn loopback(port: u16) -> Option<std::net::SocketAddr> {
    Some(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_fails_when_a_background_task_dies() -> Result<()> {
    let fleet = Fleet::start().await?;
    let port = free_port()?;
    let mut config = fleet.coordinator_config();
    config.http_addr = loopback(port);
    // Bypasses the settings' range check: the results consumer's semaphore cannot be
    // this large, so that task panics at once.
    config.result_concurrency = usize::MAX;
    let coordinator = Running::coordinator(config);
    wait_http_status(port, "/healthz", 503, WAIT).await?;
    assert_eq!(http_get(port, "/readyz").await?.0, 503);
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_answers_before_nats_does_and_names_the_step() -> Result<()> {
    let fleet = Fleet::start().await?;
    let (port, nowhere) = (free_port()?, free_port()?);
    let mut config = fleet.coordinator_config();
    config.http_addr = loopback(port);
    config.nats_url = format!("nats://127.0.0.1:{nowhere}");
    let started = Instant::now();
    let coordinator = Running::coordinator(config);
    let body = wait_http_status(port, "/readyz", 503, Duration::from_secs(1)).await?;
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(body.contains("connecting to NATS"), "{body}");
    assert_eq!(http_get(port, "/healthz").await?.0, 200);
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_draining_and_liveness_holds() -> Result<()> {
    const SLEEP_MS: u64 = 3000;
    let fleet = Fleet::start().await?;
    let (c_port, w_port) = (free_port()?, free_port()?);
    let mut c_config = fleet.coordinator_config();
    c_config.http_addr = loopback(c_port);
    c_config.shutdown_grace = Duration::from_secs(10);
    let mut w_config = fleet.worker_config();
    w_config.http_addr = loopback(w_port);
    let coordinator = Running::coordinator(c_config);
    let tools = packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let worker = Running::worker(w_config, tools);
    fleet.wait_for_tools(&["test.behave"]).await?;
    for port in [c_port, w_port] {
        wait_http_status(port, "/readyz", 200, WAIT).await?;
    }

    let slow = call("slow", "test.behave", json!({"sleep_ms": SLEEP_MS}));
    let mut stream = fleet.submit_calls("acme", 20_000, vec![slow]).await?;
    until_state(&mut stream, Some("slow"), CallState::Running, WAIT).await?;
    coordinator.shutdown.cancel();
    worker.shutdown.cancel();
    for port in [c_port, w_port] {
        let body = wait_http_status(port, "/readyz", 503, Duration::from_secs(2)).await?;
        assert!(body.contains("draining"), "{body}");
        assert_eq!(http_get(port, "/healthz").await?.0, 200);
    }
    let fin = read_final(&mut stream, WAIT).await?;
    assert_eq!(result_of(&fin, "slow")?.state, CallState::Done, "{fin:?}");
    coordinator.stop().await;
    worker.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_not_ready_while_coordinators_refuse_its_definition() -> Result<()> {
    let fleet = Fleet::start().await?;
    let port = free_port()?;
    let mut config = fleet.worker_config();
    config.http_addr = loopback(port);
    config.heartbeat = Duration::from_millis(200);
    let tools = packs::tools_for(&["conformance"]).map_err(anyhow::Error::msg)?;
    let worker = Running::worker(config, tools);
    wait_http_status(port, "/readyz", 200, WAIT).await?;

    // What a coordinator writes when the definition does not decode (PROTOCOL §2.6).
    let tool = packs::testing::CONFORMANCE_TOOL;
    let key = fleet.names.rejected_definitions_key();
    let mut redis = fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    let refusal = json!({"reason": "the definition does not decode", "at_unix_ms": 1});
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg(tool)
        .arg(refusal.to_string())
        .query_async(&mut redis)
        .await?;
    let body = wait_http_status(port, "/readyz", 503, WAIT).await?;
    assert!(body.contains(tool), "{body}");
    let _: () = redis::cmd("HDEL")
        .arg(&key)
        .arg(tool)
        .query_async(&mut redis)
        .await?;
    wait_http_status(port, "/readyz", 200, WAIT).await?;
    worker.stop().await;
    Ok(())
}

/// `fleet-node role` on `nats_url` and `redis_url` with its endpoint on `port` and `env`.
fn spawn_node(
    role: &str,
    nats_url: &str,
    redis_url: &str,
    port: u16,
    env: &[(&str, &str)],
) -> Result<tokio::process::Child> {
    let mut command = tokio::process::Command::new(toolfleet_tests::fleet::fleet_node_path()?);
    command
        .arg(role)
        .env("TOOLFLEET_NATS_URL", nats_url)
        .env("TOOLFLEET_REDIS_URL", redis_url)
        .env("TOOLFLEET_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("TOOLFLEET_HEARTBEAT_MS", "500")
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    Ok(command.spawn()?)
}

/// Waits until `/readyz` on `port` answers 503 with a reason starting with `step`; the
/// reason.
async fn not_ready_at(port: u16, step: &str) -> Result<String> {
    toolfleet_tests::eventually_named(step, WAIT, || async {
        let (status, body) = http_get(port, "/readyz").await.ok()?;
        let reason = body
            .strip_prefix("not ready: ")
            .unwrap_or(&body)
            .trim_end()
            .to_string();
        (status == 503 && reason.starts_with(step)).then_some(reason)
    })
    .await
}

/// Redis unreachable at start: a coordinator and a worker wait for it as they wait for
/// NATS, readiness naming the step and the cause, past the 10-17 s after which they used
/// to exit, and are ready within seconds of Redis answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_at_start_is_retried_and_readiness_names_the_cause() -> Result<()> {
    let mut fleet = Fleet::start().await?;
    fleet.redis.stop().await;
    let (nats, redis) = (fleet.nats.url(), fleet.redis.url());
    let prefix = [("TOOLFLEET_PREFIX", fleet.names.prefix())];
    let (c_port, w_port) = (free_port()?, free_port()?);
    let mut coordinator = spawn_node("coordinator", &nats, &redis, c_port, &prefix)?;
    let mut worker = spawn_node("worker", &nats, &redis, w_port, &prefix)?;
    for port in [c_port, w_port] {
        not_ready_at(port, "connecting to Redis: ").await?;
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    for (port, child) in [(c_port, &mut coordinator), (w_port, &mut worker)] {
        assert!(child.try_wait()?.is_none(), "the process exited");
        assert_eq!(http_get(port, "/healthz").await?.0, 200);
        not_ready_at(port, "connecting to Redis: ").await?;
    }
    let back = Instant::now();
    fleet.redis.restart().await?;
    for port in [c_port, w_port] {
        wait_http_status(port, "/readyz", 200, WAIT).await?;
    }
    eprintln!(
        "ready {:.1} s after Redis answered",
        back.elapsed().as_secs_f64()
    );
    fleet.wait_for_tools(&["test.noop"]).await?;
    Ok(())
}

/// A wrong NATS password: readiness says so, and the refusals count as `server_error`
/// (what the server refused), not `client_error` (a server not reached).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_nats_password_is_named_by_readiness_and_counted_as_a_server_error() -> Result<()> {
    let auth = "authorization {\n  user: fleet\n  password: right-one\n}\n";
    let nats = toolfleet_tests::NatsServer::start_with_config(auth).await?;
    let redis = toolfleet_tests::RedisServer::start().await?;
    let port = free_port()?;
    let credentials = [
        ("TOOLFLEET_NATS_USER", "fleet"),
        ("TOOLFLEET_NATS_PASSWORD", "wrong-one"),
    ];
    let _worker = spawn_node("worker", &nats.url(), &redis.url(), port, &credentials)?;
    let body = not_ready_at(port, "connecting to NATS: ").await?;
    assert_eq!(body, "connecting to NATS: authorization violation");
    let (_, metrics) = http_get(port, "/metrics").await?;
    let count = |event: &str| {
        toolfleet_tests::metric_value(
            &metrics,
            "toolfleet_nats_events_total",
            &[&format!("event=\"{event}\"")],
        )
    };
    assert!(count("server_error").unwrap_or(0.0) >= 1.0, "{metrics}");
    assert_eq!(count("client_error"), Some(0.0));
    Ok(())
}

/// A worker whose NATS user may not create consumers: readiness names the step and the
/// server's refusal while it waits on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_nats_permission_is_named_by_readiness() -> Result<()> {
    let users = r#"authorization {
  users = [
    { user: coordinator, password: c-pass }
    { user: worker, password: w-pass, permissions: {
        publish: { allow: [">"], deny: ["$JS.API.CONSUMER.CREATE.>", "$JS.API.CONSUMER.DURABLE.CREATE.>"] }
        subscribe: { allow: [">"] } } }
  ]
}
"#;
    let nats = toolfleet_tests::NatsServer::start_with_config(users).await?;
    let redis = toolfleet_tests::RedisServer::start().await?;
    let (c_port, w_port) = (free_port()?, free_port()?);
    let coordinator = [
        ("TOOLFLEET_NATS_USER", "coordinator"),
        ("TOOLFLEET_NATS_PASSWORD", "c-pass"),
    ];
    let _coordinator = spawn_node(
        "coordinator",
        &nats.url(),
        &redis.url(),
        c_port,
        &coordinator,
    )?;
    wait_http_status(c_port, "/readyz", 200, WAIT).await?;
    let worker = [
        ("TOOLFLEET_NATS_USER", "worker"),
        ("TOOLFLEET_NATS_PASSWORD", "w-pass"),
    ];
    let _worker = spawn_node("worker", &nats.url(), &redis.url(), w_port, &worker)?;
    let reason = not_ready_at(w_port, "creating consumers: ").await?;
    assert!(
        reason.to_lowercase().contains("permissions violation"),
        "{reason}"
    );
    Ok(())
}
