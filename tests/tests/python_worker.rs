//! A turn whose calls are served by a Rust worker and by the Python worker of
//! `examples/python-worker/` (written with the Python SDK of `sdk/python/`) together;
//! and a Python SDK worker whose tool's retry policy changed between two starts serves
//! from a consumer updated to it; both workers serve a fleet whose turns are spread over
//! three stream partitions; and a Python SDK worker that starts first creates the
//! streams with every process's settings, replicas included, on a 3-node JetStream
//! cluster.
//! The SDK's packages (nats-py, redis-py) are installed by the test into a virtual
//! environment of its own (`python::venv`) and the SDK is imported from the repository
//! (`PYTHONPATH`), so the test always runs its current source; the machine needs only
//! `python3`.

use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, code_of, result_of, tool_calls, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_and_python_workers_serve_one_turn() -> Result<()> {
    let python =
        toolfleet_tests::python::venv(env!("CARGO_TARGET_TMPDIR"), "sdk/python/requirements.txt")
            .await?;
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let script = "examples/python-worker/worker.py";
    // A notice for every call, the instant `text.stats` included (no running delay).
    let announce_all = [("TOOLFLEET_RUNNING_AFTER_MS", "0")];
    let mut child = toolfleet_tests::python::worker(&python, &fleet, &[script], &announce_all)?;
    fleet.wait_for_tools(&["text.stats"]).await?;
    // Progress notices are what the Python worker must send; whether the owner's
    // `running` relay beats the `done` of an instant tool is a race, so the notice
    // itself is checked.
    let mut progress = fleet.subscribe_progress().await?;

    let calls = vec![
        call(
            "rust",
            "crm.getOpenInvoices",
            json!({"customerId": "cust_001"}),
        ),
        call(
            "python",
            "text.stats",
            json!({"text": "Show me my appointments. And my billing!"}),
        ),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(fin.summary.ok, 2, "{fin:?}");
    let rust = result_of(fin, "rust")?;
    let py = result_of(fin, "python")?;
    assert_eq!(
        py.result,
        Some(json!({"words": 7, "sentences": 2, "characters": 40}))
    );
    assert_eq!(py.summary.as_deref(), Some("That text has 7 words."));
    assert_eq!(py.attempts, 1);
    assert!(py.started_at.is_some() && py.ended_at.is_some());
    let py_worker = py.worker_id.clone().unwrap_or_default();
    assert!(py_worker.starts_with("py-"), "{py_worker}");
    assert_ne!(rust.worker_id.as_deref(), Some(py_worker.as_str()));
    assert!(fin.text.contains("That text has 7 words."), "{}", fin.text);
    // The Python worker announced the start of its call.
    let deadline = tokio::time::Instant::now() + EVENT_WAIT;
    let started = loop {
        let message = tokio::time::timeout_at(deadline, progress.next())
            .await
            .context("no started notice from the Python worker")?
            .context("progress subscription closed")?;
        let notice: serde_json::Value = serde_json::from_slice(&message.payload)?;
        if notice["kind"] == "started" && notice["tool_call_id"] == "python" {
            break notice;
        }
    };
    assert!(started["worker_id"]
        .as_str()
        .is_some_and(|w| w.starts_with("py-")));

    // On SIGTERM it withdraws from the registry.
    let status = toolfleet_tests::python::terminate(&mut child).await?;
    assert!(status.success(), "{status}");
    fleet.wait_for_tool_gone("text.stats").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_and_python_workers_serve_turns_spread_over_stream_partitions() -> Result<()> {
    const PARTITIONS: u32 = 3;
    let python =
        toolfleet_tests::python::venv(env!("CARGO_TARGET_TMPDIR"), "sdk/python/requirements.txt")
            .await?;
    let mut fleet = Fleet::start().await?;
    fleet.names = fleet.names.clone().with_partitions(PARTITIONS);
    let (_c, _w) = fleet.start_default().await?;
    let script = "examples/python-worker/worker.py";
    let partitions = PARTITIONS.to_string();
    let mut child = toolfleet_tests::python::worker(
        &python,
        &fleet,
        &[script],
        &[("TOOLFLEET_STREAM_PARTITIONS", &partitions)],
    )?;
    fleet.wait_for_tools(&["text.stats"]).await?;
    // Two turns in each partition, each with a call for either worker.
    let mut ids = Vec::new();
    for k in 0..PARTITIONS {
        ids.extend(
            (0..)
                .map(|i| format!("spread-{i}"))
                .filter(|id| fleet.names.partition_of(id) == k)
                .take(2),
        );
    }
    for id in &ids {
        let calls = vec![
            call(
                "rust",
                "crm.getOpenInvoices",
                json!({"customerId": "cust_001"}),
            ),
            call("python", "text.stats", json!({"text": "One. Two."})),
        ];
        let mut request = toolfleet_tests::fleet::turn("acme", tool_calls(calls));
        request.turn_id = Some(id.clone());
        let outcome = fleet.run(request, EVENT_WAIT).await?;
        assert_eq!(
            outcome.final_event.summary.ok, 2,
            "{id}: {:?}",
            outcome.final_event
        );
    }
    // Each partition's streams carried exactly its turns' jobs and results.
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    for k in 0..PARTITIONS {
        for stream in [
            fleet.names.jobs_stream_in(k),
            fleet.names.results_stream_in(k),
        ] {
            let info = js.get_stream(&stream).await?.info().await?.clone();
            assert_eq!(info.state.last_sequence, 4, "{stream}");
        }
    }
    let status = toolfleet_tests::python::terminate(&mut child).await?;
    assert!(status.success(), "{status}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_retry_policy_of_a_python_tool_is_in_force_on_the_next_start() -> Result<()> {
    const TOOL: &str = "test.py_flaky";
    let python =
        toolfleet_tests::python::venv(env!("CARGO_TARGET_TMPDIR"), "sdk/python/requirements.txt")
            .await?;
    let fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let script = ["tests/python/flaky_worker.py"];
    let start = |attempts: &str| {
        toolfleet_tests::python::worker(&python, &fleet, &script, &[("FLAKY_ATTEMPTS", attempts)])
    };

    let mut first = start("2")?;
    fleet.wait_for_tools(&[TOOL]).await?;
    assert_eq!(fleet.consumer_max_deliver(TOOL).await?, 2);
    toolfleet_tests::python::terminate(&mut first).await?;
    fleet.wait_for_tool_gone(TOOL).await?;

    let mut second = start("3")?;
    fleet.wait_for_tools(&[TOOL]).await?;
    assert_eq!(fleet.consumer_max_deliver(TOOL).await?, 3);
    let outcome = fleet
        .run_calls("acme", vec![call("c1", TOOL, json!({}))], EVENT_WAIT)
        .await?;
    let result = result_of(&outcome.final_event, "c1")?;
    assert_eq!(result.state, CallState::Error, "{result:?}");
    assert_eq!(code_of(result), Some("flaky"), "{result:?}");
    assert_eq!(result.attempts, 3, "{result:?}");

    toolfleet_tests::python::terminate(&mut second).await?;
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_tool_sees_its_turn_cancelled() -> Result<()> {
    const TOOL: &str = "test.py_wait";
    let python =
        toolfleet_tests::python::venv(env!("CARGO_TARGET_TMPDIR"), "sdk/python/requirements.txt")
            .await?;
    let fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let markers = tempfile::tempdir()?;
    let dir = markers.path().to_string_lossy().to_string();
    let mut worker = toolfleet_tests::python::worker(
        &python,
        &fleet,
        &["tests/python/cancel_worker.py"],
        &[("CANCEL_MARKERS", dir.as_str())],
    )?;
    fleet.wait_for_tools(&[TOOL]).await?;

    let mut request = toolfleet_tests::fleet::timed_turn(
        "acme",
        20_000,
        vec![call("c1", TOOL, json!({"wait_ms": 10_000}))],
    );
    request.turn_id = Some("py-cancel".into());
    let mut progress = fleet.subscribe_progress().await?;
    let mut stream = fleet.client.submit(request).await?;
    // Cancel once the call runs on the Python worker.
    tokio::time::timeout(EVENT_WAIT, progress.next())
        .await
        .context("the call never started")?;
    let reply = fleet.client.cancel("py-cancel", None, EVENT_WAIT).await?;
    assert_eq!(
        reply.outcome,
        toolfleet_common::turn::CancelOutcome::Cancelled
    );
    let events = toolfleet_tests::fleet::read_to_end(&mut stream, EVENT_WAIT).await?;
    let Some(toolfleet_common::TurnEvent::Final(fin)) = events.last() else {
        anyhow::bail!("no final: {events:?}");
    };
    assert_eq!(fin.results[0].state, CallState::Cancelled);
    let marker = markers.path().join("py-cancel.c1");
    let until = std::time::Instant::now() + EVENT_WAIT;
    while !marker.exists() {
        anyhow::ensure!(
            std::time::Instant::now() < until,
            "the Python tool never saw the cancellation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    toolfleet_tests::python::terminate(&mut worker).await?;
    coordinator.stop().await;
    Ok(())
}

/// A Python SDK worker that starts first creates the jobs and results streams with the
/// settings every coordinator and worker uses (PROTOCOL 2.3), its replicas
/// (`TOOLFLEET_STREAM_REPLICAS`) included: three on a 3-node JetStream cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_worker_creates_the_streams_as_every_process_does() -> Result<()> {
    use async_nats::jetstream::stream::{DiscardPolicy, RetentionPolicy, StorageType};
    use toolfleet_common::streams;

    let python =
        toolfleet_tests::python::venv(env!("CARGO_TARGET_TMPDIR"), "sdk/python/requirements.txt")
            .await?;
    let fleet = Fleet::start().await?;
    let cluster = toolfleet_cli::cluster::NatsCluster::start(3).await?;
    cluster.wait_jetstream(Duration::from_secs(20)).await?;
    let urls = cluster.urls();
    let mut child = toolfleet_tests::python::worker(
        &python,
        &fleet,
        &["examples/python-worker/worker.py"],
        &[
            ("TOOLFLEET_NATS_URL", &urls),
            ("TOOLFLEET_STREAM_REPLICAS", "3"),
            ("TOOLFLEET_STREAM_STORAGE", "file"),
        ],
    )?;
    let js = async_nats::jetstream::new(cluster.connect().await?);
    let names = [
        fleet.names.jobs_stream_in(0),
        fleet.names.results_stream_in(0),
    ];
    let deadline = tokio::time::Instant::now() + EVENT_WAIT;
    for name in names {
        let config = loop {
            if let Ok(mut stream) = js.get_stream(&name).await {
                break stream.info().await?.config.clone();
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{name} was not created"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(config.num_replicas, 3, "{name}");
        assert_eq!(config.retention, RetentionPolicy::WorkQueue, "{name}");
        assert_eq!(config.storage, StorageType::File, "{name}");
        assert_eq!(config.duplicate_window, streams::DUPLICATE_WINDOW, "{name}");
        assert_eq!(config.max_age, streams::MAX_AGE, "{name}");
        assert_eq!(config.max_bytes, streams::MAX_BYTES, "{name}");
        assert_eq!(config.max_message_size, streams::MAX_MESSAGE_SIZE, "{name}");
        assert_eq!(config.discard, DiscardPolicy::New, "{name}");
    }
    let status = toolfleet_tests::python::terminate(&mut child).await?;
    assert!(status.success(), "{status}");
    Ok(())
}
