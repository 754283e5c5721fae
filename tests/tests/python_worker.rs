//! A turn whose calls are served by a Rust worker and by the Python worker of
//! `examples/python-worker/` (written with the Python SDK of `sdk/python/`) together;
//! and a Python SDK worker whose tool's retry policy changed between two starts serves
//! from a consumer updated to it; both workers serve a fleet whose turns are spread over
//! three stream partitions; and a Python SDK worker that starts first creates the
//! streams with every process's settings, replicas included, on a 3-node JetStream
//! cluster.
//! Tools written the Python way (`examples/python-worker/typed_tools.py`: bare `@tool`,
//! TypedDict arguments, sync and async, a blocking one, no arguments, a summary hook)
//! serve a turn without a blocking tool holding up its siblings, with tracebacks
//! logged, `/healthz` and `/metrics` answered and trace context carried onto results;
//! they pass `toolfleet conformance`; settings out of the Rust worker's ranges stop
//! the worker at start; and `pip install` leaves the SDK's tree clean.
//! The SDK's packages (nats-py, redis-py) are installed by the test into a virtual
//! environment of its own (`python::venv`) and the SDK is imported from the repository
//! (`PYTHONPATH`), so the test always runs its current source; the machine needs only
//! `python3`.

use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, code_of, crm_call, named_turn, result_of, tool_calls, Fleet};
use toolfleet_tests::python::sdk_fleet;

const EVENT_WAIT: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_and_python_workers_serve_one_turn() -> Result<()> {
    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
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
        crm_call("rust", "crm.getOpenInvoices", "cust_001"),
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
    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
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
            crm_call("rust", "crm.getOpenInvoices", "cust_001"),
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
    let (python, fleet, coordinator) = sdk_fleet(env!("CARGO_TARGET_TMPDIR")).await?;
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
    fleet
        .assert_gives_up_after(TOOL, 3, "flaky", EVENT_WAIT)
        .await?;

    toolfleet_tests::python::terminate(&mut second).await?;
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_tool_sees_its_turn_cancelled() -> Result<()> {
    const TOOL: &str = "test.py_wait";
    let (python, fleet, coordinator) = sdk_fleet(env!("CARGO_TARGET_TMPDIR")).await?;
    let markers = tempfile::tempdir()?;
    let dir = markers.path().to_string_lossy().to_string();
    let mut worker = toolfleet_tests::python::worker(
        &python,
        &fleet,
        &["tests/python/cancel_worker.py"],
        &[("CANCEL_MARKERS", dir.as_str())],
    )?;
    fleet.wait_for_tools(&[TOOL]).await?;

    let request = named_turn(
        "py-cancel",
        "acme",
        20_000,
        vec![call("c1", TOOL, json!({"wait_ms": 10_000}))],
    );
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

    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
    let fleet = Fleet::start().await?;
    let cluster = toolfleet_dev::cluster::NatsCluster::start(3).await?;
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

/// `GET path` on `port`: status and body.
async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let response = tokio::time::timeout(
        EVENT_WAIT,
        reqwest::get(format!("http://127.0.0.1:{port}{path}")),
    )
    .await??;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

/// The value of the Prometheus sample `series` (name and labels as written) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_tools_written_the_python_way_serve_a_turn() -> Result<()> {
    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let port = toolfleet_tests::free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let mut command = toolfleet_tests::python::worker_command(
        &python,
        &fleet,
        &["examples/python-worker/typed_tools.py"],
        // An ack wait of 3 s (keep-alives every second): a worker held up for a moment
        // on a busy machine still keeps its job, where at 1 s a stall of 0.7 s had the
        // job delivered again and the non-idempotent tool's second delivery answer
        // `call_interrupted`.
        &[
            ("TOOLFLEET_HTTP_ADDR", &addr),
            ("TOOLFLEET_ACK_WAIT_MS", "3000"),
        ],
    );
    command.stderr(std::process::Stdio::piped());
    let mut child = command.spawn()?;
    let mut stderr = child.stderr.take().context("stderr is not piped")?;
    let log = tokio::spawn(async move {
        let mut text = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text).await;
        text
    });
    fleet
        .wait_for_tools(&[
            "greet",
            "wait_async",
            "wait_blocking",
            "units.convert",
            "clock",
            "broken",
        ])
        .await?;
    let calls = vec![
        call("hi", "greet", json!({"name": "Ada"})),
        // Blocks its thread for longer than the ack wait (3 s): runs on a thread, so the
        // worker's keep-alives go on (one attempt) and its sibling is not held up.
        call("block", "wait_blocking", json!({"ms": 3500})),
        call("async", "wait_async", json!({"ms": 300})),
        call("f", "units.convert", json!({"celsius": 100, "units": "F"})),
        call(
            "extra",
            "units.convert",
            json!({"celsius": 1, "units": "F", "x": 1}),
        ),
        call("range", "wait_async", json!({"ms": 6000})),
        call(
            "cold",
            "units.convert",
            json!({"celsius": -300, "units": "K"}),
        ),
        call("clock", "clock", json!({})),
        call("broken", "broken", json!({"name": "Ada"})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(
        result_of(fin, "hi")?.summary.as_deref(),
        Some("Hello Ada, from acme.")
    );
    let block = result_of(fin, "block")?;
    let quick = result_of(fin, "async")?;
    assert_eq!(block.state, CallState::Done, "{block:?}");
    assert_eq!(block.attempts, 1, "{block:?}");
    assert_eq!(
        block.summary.as_deref(),
        Some("I waited 3500 milliseconds.")
    );
    assert_eq!(quick.state, CallState::Done, "{quick:?}");
    assert!(
        quick.ended_at < block.ended_at,
        "the async tool waited for the blocking one: {quick:?} {block:?}"
    );
    let f = result_of(fin, "f")?;
    assert_eq!(f.result, Some(json!({"value": 212.0})), "{f:?}");
    for refused in ["extra", "range"] {
        let r = result_of(fin, refused)?;
        assert_eq!(code_of(r), Some("invalid_arguments"), "{r:?}");
        assert_eq!(r.attempts, 0, "refused before a worker ran it");
    }
    let cold = result_of(fin, "cold")?;
    assert_eq!(code_of(cold), Some("below_absolute_zero"));
    assert_eq!(
        cold.error.as_ref().and_then(|e| e.user_message.as_deref()),
        Some("That is colder than anything can be.")
    );
    assert_eq!(result_of(fin, "clock")?.state, CallState::Done);
    assert_eq!(code_of(result_of(fin, "broken")?), Some("tool_panicked"));

    let (status, body) = http_get(port, "/healthz").await?;
    assert_eq!(status, 200, "{body}");
    let (status, _) = http_get(port, "/readyz").await?;
    assert_eq!(status, 200);
    let (status, metrics) = http_get(port, "/metrics").await?;
    assert_eq!(status, 200);
    let count = |tool: &str, outcome: &str| {
        sample(
            &metrics,
            &format!(
                "toolfleet_call_duration_seconds_count{{gen_ai_tool_name=\"{tool}\",outcome=\"{outcome}\"}}"
            ),
        )
    };
    assert_eq!(count("broken", "error"), Some(1.0), "{metrics}");
    assert_eq!(count("units.convert", "done"), Some(1.0), "{metrics}");

    let status = toolfleet_tests::python::terminate(&mut child).await?;
    assert!(status.success(), "{status}");
    let log = tokio::time::timeout(EVENT_WAIT, log).await??;
    // The tool's exception is logged with its traceback (the result holds one line).
    assert!(log.contains("Traceback (most recent call last)"), "{log}");
    assert!(log.contains("ZeroDivisionError"), "{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_tools_written_the_python_way_pass_conformance() -> Result<()> {
    let (python, fleet, coordinator) = sdk_fleet(env!("CARGO_TARGET_TMPDIR")).await?;
    let script = "examples/python-worker/typed_tools.py";
    let mut child = toolfleet_tests::python::worker(&python, &fleet, &[script], &[])?;
    let tool = "conformance.probe";
    fleet.wait_for_tools(&[tool]).await?;
    let settings = toolfleet_tests::conformance::settings(&fleet, tool, child.id())?;
    let report = toolfleet_cli::conformance::run(&settings).await?;
    toolfleet_tests::conformance::assert_clean(&report);
    let _ = tokio::time::timeout(EVENT_WAIT, child.wait()).await;
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_settings_out_of_the_rust_workers_ranges_stop_the_worker() -> Result<()> {
    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
    let fleet = Fleet::start().await?;
    let script = "examples/python-worker/typed_tools.py";
    for (name, value) in [
        ("TOOLFLEET_HEARTBEAT_MS", "0"),
        ("TOOLFLEET_ACK_WAIT_MS", "0"),
        ("TOOLFLEET_WORKER_CONCURRENCY", "-5"),
        ("TOOLFLEET_WORKER_CONSUMERS", "bnid"),
        ("TOOLFLEET_MAX_RESULT_BYTES", "10"),
        ("TOOLFLEET_HTTP_ADDR", "nowhere"),
    ] {
        let mut command =
            toolfleet_tests::python::worker_command(&python, &fleet, &[script], &[(name, value)]);
        command.stderr(std::process::Stdio::null());
        let status = tokio::time::timeout(EVENT_WAIT, command.status())
            .await
            .with_context(|| format!("{name}={value}: the worker started"))??;
        assert!(!status.success(), "{name}={value}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pip_install_leaves_the_sdk_tree_clean() -> Result<()> {
    let python = toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await?;
    // A copy of the SDK's tree, installed into a target folder of its own.
    let work = tempfile::tempdir()?;
    let tree = work.path().join("python");
    std::fs::create_dir_all(tree.join("toolfleet_worker"))?;
    let sdk = toolfleet_tests::repo_path("sdk/python");
    for name in ["pyproject.toml", "README.md"] {
        std::fs::copy(sdk.join(name), tree.join(name))?;
    }
    for file in std::fs::read_dir(sdk.join("toolfleet_worker"))? {
        let file = file?;
        if file.path().extension().is_some_and(|e| e == "py") {
            std::fs::copy(
                file.path(),
                tree.join("toolfleet_worker").join(file.file_name()),
            )?;
        }
    }
    let listing = |dir: &std::path::Path| -> Result<Vec<String>> {
        let mut names: Vec<String> = std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<std::io::Result<_>>()?;
        names.sort();
        Ok(names)
    };
    let before = listing(&tree)?;
    let install = tokio::process::Command::new(&python)
        .args(toolfleet_tests::python::PIP_INSTALL)
        .arg("--no-deps")
        .arg("--target")
        .arg(work.path().join("site"))
        .arg(&tree)
        .env("PIP_NO_INPUT", "1")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), install).await??;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        listing(&tree)?,
        before,
        "pip install wrote into the source tree"
    );
    assert!(work
        .path()
        .join("site/toolfleet_worker/_worker.py")
        .is_file());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_tools_show_up_as_spans_in_the_turns_trace() -> Result<()> {
    let python = toolfleet_tests::python::venv(
        env!("CARGO_TARGET_TMPDIR"),
        "sdk/python/requirements-otel.txt",
    )
    .await?;
    let receiver = toolfleet_tests::otlp::OtlpReceiver::start().await?;
    let endpoint = receiver.endpoint();
    let mut fleet = Fleet::start().await?;
    let exporting = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    fleet.spawn_node("coordinator", &exporting)?;
    let mut env = exporting.to_vec();
    env.push(("OTEL_SERVICE_NAME", "python-tools"));
    let script = "examples/python-worker/typed_tools.py";
    let mut child = toolfleet_tests::python::worker(&python, &fleet, &[script], &env)?;
    fleet.wait_for_tools(&["greet", "wait_blocking"]).await?;
    let mut results = fleet
        .client
        .nats()
        .subscribe(format!("{}.results.>", fleet.names.prefix()))
        .await?;
    let calls = vec![
        call("hi", "greet", json!({"name": "Ada"})),
        call("block", "wait_blocking", json!({"ms": 50})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    assert_eq!(
        outcome.final_event.summary.ok, 2,
        "{:?}",
        outcome.final_event
    );
    let result = tokio::time::timeout(EVENT_WAIT, results.next())
        .await?
        .context("results subscription closed")?;
    let headers = result.headers.context("a result without headers")?;
    let traceparent = headers
        .get("traceparent")
        .map(|v| v.to_string())
        .context("a result without traceparent")?;
    assert!(
        headers.get("Fleet-Turn-Traceparent").is_some(),
        "{headers:?}"
    );

    // The worker's spans: `process` under a coordinator span of the same trace,
    // `execute_tool` inside it; the result's traceparent names the `process` span.
    let spans = toolfleet_tests::eventually_named("the Python worker's spans", EVENT_WAIT, || {
        let spans = receiver.spans();
        async move {
            let python = spans.iter().filter(|s| s.service == "python-tools").count();
            (python >= 4).then_some(spans)
        }
    })
    .await?;
    for tool in ["greet", "wait_blocking"] {
        let execute = spans
            .iter()
            .find(|s| s.service == "python-tools" && s.name == format!("execute_tool {tool}"))
            .with_context(|| format!("no execute_tool span for {tool}"))?;
        let process = spans
            .iter()
            .find(|s| s.span_id == execute.parent_span_id)
            .context("execute_tool has no parent")?;
        assert!(process.name.starts_with("process "), "{process:?}");
        assert_eq!(process.kind, 5, "a CONSUMER span");
        let parent = spans
            .iter()
            .find(|s| s.span_id == process.parent_span_id)
            .with_context(|| format!("the parent of {process:?} was not exported"))?;
        assert_ne!(parent.service, "python-tools");
        assert_eq!(parent.trace_id, process.trace_id);
        assert_eq!(process.attr("gen_ai.tool.name"), Some(tool));
    }
    assert!(
        spans
            .iter()
            .any(|s| s.name.starts_with("process ") && traceparent.contains(&s.span_id)),
        "{traceparent}"
    );
    let status = toolfleet_tests::python::terminate(&mut child).await?;
    assert!(status.success(), "{status}");
    Ok(())
}
