//! A turn whose calls are served by a Rust worker and by the Python worker of
//! `examples/python-worker/` (written with the Python SDK of `sdk/python/`) together.
//! The SDK's packages (nats-py, redis-py) are installed by the test into a virtual
//! environment of its own (`python::venv`) and the SDK is imported from the repository
//! (`PYTHONPATH`), so the test always runs its current source; the machine needs only
//! `python3`.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use tokio::process::Command;
use toolfleet_tests::fleet::{call, result_of, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_and_python_workers_serve_one_turn() -> Result<()> {
    let python =
        toolfleet_tests::python::venv(env!("CARGO_TARGET_TMPDIR"), "sdk/python/requirements.txt")
            .await?;
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let script = toolfleet_tests::repo_path("examples/python-worker/worker.py");
    let mut child = Command::new(&python)
        .arg(&script)
        .env("PYTHONPATH", toolfleet_tests::repo_path("sdk/python"))
        .env("TOOLFLEET_NATS_URL", fleet.nats.url())
        .env("TOOLFLEET_REDIS_URL", fleet.redis.url())
        .env("TOOLFLEET_PREFIX", fleet.names.prefix())
        .env("TOOLFLEET_HEARTBEAT_MS", "500")
        .env("TOOLFLEET_ACK_WAIT_MS", "1000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the Python worker")?;
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
    let pid = child.id().context("the Python worker has no pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .context("the Python worker did not stop")??;
    assert!(status.success(), "{status}");
    fleet.wait_for_tool_gone("text.stats").await?;
    Ok(())
}
