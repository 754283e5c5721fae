//! The example tool crate (examples/tool-crate: `#[tool]` fns with typed outputs and
//! errors, one without arguments, one waiting on the worker's Tokio) in a real fleet:
//! every tool answers in one turn with its output's `Display` as the summary, its typed
//! error arrives with its code, and an argument the type does not name is refused before
//! any worker runs.
//!
//! And the same crate as a tool author has it: copied outside the workspace, with its
//! own lockfile and no `[patch]` section, built with `cargo build` (into a target folder
//! of its own under this build's, so a run after the first reuses it) and run as a
//! process. That worker gets the patched NATS client through the worker crate, starts
//! and stops without an ERROR line, keeps its connection through every malformed header
//! block, and passes `toolfleet conformance` with the SDK's probe.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use toolfleet_cli::conformance;
use toolfleet_common::call::codes;
use toolfleet_common::{CallResult, CallState, JobEnvelope, ToolCall};
use toolfleet_tests::fleet::{call, code_of, fleet_node_path, result_of, value_at, Fleet, Running};
use toolfleet_tests::poison::{RawPublisher, POISON};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// How long building the outside crate may take (a clean build: about 2 minutes on two
/// cores).
const BUILD_TIMEOUT: Duration = Duration::from_secs(900);

/// The example crate's package (and binary) name.
const CRATE: &str = "toolfleet-example-tools";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_crates_tools_serve_a_turn() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tools = toolfleet_example_tools::tools();
    let (coordinator, worker) = fleet
        .start_with(
            fleet.coordinator_config(),
            tools,
            &["units.celsius_to_fahrenheit", "math.add", "hello.greet"],
        )
        .await?;

    let calls = vec![
        call("f", "units.celsius_to_fahrenheit", json!({"celsius": 100})),
        call("sum", "math.add", json!({"a": 40, "b": 2})),
        call("hi", "hello.greet", json!({"name": "Ada"})),
        call(
            "cold",
            "units.celsius_to_fahrenheit",
            json!({"celsius": -300}),
        ),
        call(
            "units",
            "units.celsius_to_fahrenheit",
            json!({"celsius": 1, "units": "F"}),
        ),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    let f = result_of(fin, "f")?;
    assert_eq!(value_at(f, "/fahrenheit"), Some(json!(212.0)), "{f:?}");
    assert_eq!(
        f.summary.as_deref(),
        Some("That is 212.0 degrees Fahrenheit.")
    );
    let sum = result_of(fin, "sum")?;
    assert_eq!(value_at(sum, "/sum"), Some(json!(42)), "{sum:?}");
    assert_eq!(sum.summary.as_deref(), Some("The sum is 42."));
    let hi = result_of(fin, "hi")?;
    assert_eq!(
        hi.summary.as_deref(),
        Some("Hello Ada, from acme."),
        "{hi:?}"
    );

    let cold = result_of(fin, "cold")?;
    assert_eq!(cold.state, CallState::Error);
    assert_eq!(code_of(cold), Some("below_absolute_zero"), "{cold:?}");
    let units = result_of(fin, "units")?;
    assert_eq!(code_of(units), Some(codes::INVALID_ARGUMENTS), "{units:?}");
    assert_eq!(units.attempts, 0, "refused before a worker ran it");

    worker.stop().await;
    coordinator.stop().await;
    Ok(())
}

/// The outside copy's binary, built once per test binary.
static OUTSIDE: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();

/// Where the outside copy's sources live: a folder of the system's temporary directory,
/// so no `Cargo.toml` above it makes it a workspace member; named after this checkout,
/// so runs reuse it.
fn outside_dir() -> Result<PathBuf> {
    let repo = toolfleet_tests::repo_path("");
    let tag: String = repo
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Ok(std::env::temp_dir().join(format!("toolfleet-outside-tool-crate{tag}")))
}

/// Copies examples/tool-crate outside the workspace, as an author's crate: its
/// `Cargo.toml` with the worker's path made absolute (nothing else changed: no
/// `[patch]`, no workspace), its sources, and a lockfile of its own (seeded from the
/// workspace's so versions match the build cache; cargo trims it to this crate). Builds
/// it with `cargo build` and returns the binary's path.
async fn build_outside() -> Result<PathBuf> {
    let node = fleet_node_path()?;
    let profile_dir = node.parent().context("fleet-node has no folder")?;
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let target = profile_dir
        .parent()
        .context("no target folder")?
        .join("outside-tool-crate");
    let dir = outside_dir()?;
    let example = toolfleet_tests::repo_path("examples/tool-crate");
    std::fs::create_dir_all(dir.join("src"))?;
    let manifest = std::fs::read_to_string(example.join("Cargo.toml"))?;
    let worker = toolfleet_tests::repo_path("worker");
    let manifest = manifest.replace(
        "path = \"../../worker\"",
        &format!("path = {:?}", worker.to_string_lossy()),
    );
    anyhow::ensure!(
        ["[patch", "[workspace", "workspace = true", ".workspace"]
            .iter()
            .all(|k| !manifest.contains(k)),
        "the example's Cargo.toml must stand alone"
    );
    std::fs::write(dir.join("Cargo.toml"), manifest)?;
    for file in std::fs::read_dir(example.join("src"))? {
        let file = file?;
        std::fs::copy(file.path(), dir.join("src").join(file.file_name()))?;
    }
    std::fs::copy(
        toolfleet_tests::repo_path("Cargo.lock"),
        dir.join("Cargo.lock"),
    )?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(&dir)
        .args(["build", "--quiet", "--bin", CRATE])
        .env("CARGO_TARGET_DIR", &target)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if release {
        build.arg("--release");
    }
    let status = tokio::time::timeout(BUILD_TIMEOUT, build.status())
        .await
        .context("building the outside tool crate took too long")??;
    anyhow::ensure!(status.success(), "building the outside tool crate failed");
    let binary = target
        .join(if release { "release" } else { "debug" })
        .join(format!("{CRATE}{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(binary.is_file(), "{} was not built", binary.display());
    Ok(binary)
}

async fn outside_binary() -> Result<PathBuf> {
    OUTSIDE.get_or_try_init(build_outside).await.cloned()
}

/// Starts the outside binary against `fleet` as its author would run it: settings from
/// the environment, default log filter, logs as JSON lines on stderr (piped).
fn spawn_outside(binary: &Path, fleet: &Fleet) -> Result<Child> {
    Command::new(binary)
        .envs(fleet.servers_env())
        .env("TOOLFLEET_HEARTBEAT_MS", "500")
        .env("TOOLFLEET_ACK_WAIT_MS", "1000")
        .env("TOOLFLEET_HTTP_ADDR", "127.0.0.1:0")
        .env("TOOLFLEET_LOG_FORMAT", "json")
        // The conformance probe panics on request; no backtrace symbolized meanwhile.
        .env("RUST_BACKTRACE", "0")
        .env_remove("RUST_LOG")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the outside tool crate's worker")
}

/// A fresh fleet with one coordinator, and the outside binary started against it.
async fn outside_fleet() -> Result<(Fleet, Running, Child)> {
    let binary = outside_binary().await?;
    let fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let child = spawn_outside(&binary, &fleet)?;
    Ok((fleet, coordinator, child))
}

/// The lines of `lines` logged at level ERROR.
fn error_lines(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["level"] == "ERROR").collect()
}

/// SIGTERM, then the exit status and every log line the process wrote, parsed.
async fn stop_outside(mut child: Child) -> Result<(std::process::ExitStatus, Vec<Value>)> {
    let mut stderr = child.stderr.take().context("stderr is not piped")?;
    if let Some(pid) = child.id() {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        )?;
    }
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .context("the worker did not stop")??;
    let mut text = String::new();
    tokio::time::timeout(EVENT_WAIT, stderr.read_to_string(&mut text))
        .await
        .context("the worker's stderr did not close")??;
    let lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("not a JSON log line: {l}")))
        .collect::<Result<Vec<Value>>>()?;
    Ok((status, lines))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outside_tool_crate_locks_the_patched_nats_client() -> Result<()> {
    outside_binary().await?;
    let lock = std::fs::read_to_string(outside_dir()?.join("Cargo.lock"))?;
    let packages: Vec<toml_package::Package> = toml_package::parse(&lock);
    let nats: Vec<_> = packages
        .iter()
        .filter(|p| p.name.contains("async-nats"))
        .collect();
    assert_eq!(nats.len(), 1, "{nats:?}");
    assert_eq!(nats[0].name, "toolfleet-async-nats");
    assert_eq!(nats[0].source, None, "the vendored copy, by path");
    Ok(())
}

/// The `[[package]]` entries of a Cargo.lock: name and source.
mod toml_package {
    #[derive(Debug)]
    pub struct Package {
        pub name: String,
        pub source: Option<String>,
    }

    pub fn parse(lock: &str) -> Vec<Package> {
        let mut out = Vec::new();
        for block in lock.split("[[package]]").skip(1) {
            let field = |key: &str| {
                block.lines().find_map(|l| {
                    l.strip_prefix(key)
                        .and_then(|r| r.trim().strip_prefix('='))
                        .map(|v| v.trim().trim_matches('"').to_string())
                })
            };
            if let Some(name) = field("name ") {
                out.push(Package {
                    name,
                    source: field("source "),
                });
            }
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outside_crate_serves_a_turn_without_an_error_line() -> Result<()> {
    let (fleet, coordinator, child) = outside_fleet().await?;
    fleet
        .wait_for_tools(&["math.add", "whoami.tenant", "timer.pause"])
        .await?;
    let calls = vec![
        call("sum", "math.add", json!({"a": 40, "b": 2})),
        call("who", "whoami.tenant", json!({})),
        call("pause", "timer.pause", json!({"ms": 300})),
        call("long", "timer.pause", json!({"ms": 6000})),
        call(
            "cold",
            "units.celsius_to_fahrenheit",
            json!({"celsius": -300}),
        ),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(value_at(result_of(fin, "sum")?, "/sum"), Some(json!(42)));
    let who = result_of(fin, "who")?;
    assert_eq!(
        who.summary.as_deref(),
        Some("You are calling for acme."),
        "{who:?}"
    );
    let pause = result_of(fin, "pause")?;
    assert_eq!(value_at(pause, "/waited_ms"), Some(json!(300)), "{pause:?}");
    assert!(pause.duration_ms >= 300, "{pause:?}");
    let long = result_of(fin, "long")?;
    assert_eq!(code_of(long), Some(codes::INVALID_ARGUMENTS), "{long:?}");
    assert_eq!(long.attempts, 0, "refused by the schema's range");
    let cold = result_of(fin, "cold")?;
    assert_eq!(code_of(cold), Some("below_absolute_zero"), "{cold:?}");

    let (status, lines) = stop_outside(child).await?;
    assert!(status.success(), "{status}");
    assert!(!lines.is_empty(), "the worker logged nothing");
    let errors = error_lines(&lines);
    assert!(errors.is_empty(), "{errors:#?}");
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_header_blocks_never_cost_the_outside_worker_its_connection() -> Result<()> {
    let (fleet, coordinator, child) = outside_fleet().await?;
    fleet.wait_for_tools(&["math.add"]).await?;
    let nats = fleet.client.nats();
    let mut results = nats
        .subscribe(format!("{}.results.>", fleet.names.prefix()))
        .await?;
    nats.flush().await?;

    // Each malformed header block on a job of its own: the worker's connection reads
    // it, and on unpatched async-nats closes (the job is then redelivered and answered
    // `call_interrupted`, math.add being not idempotent), or never answers.
    let mut publisher = RawPublisher::connect(fleet.nats.port()).await?;
    let now = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    for (i, header) in POISON.iter().enumerate() {
        let job = JobEnvelope {
            turn_id: format!("poison-{i}"),
            tenant_id: "acme".into(),
            session_id: None,
            call: ToolCall {
                id: "p1".into(),
                name: "math.add".into(),
                arguments: json!({"a": i, "b": 100}),
                parent_id: None,
            },
            deadline_unix_ms: now + 60_000,
            timeout_ms: 1000,
            dispatched_unix_ms: now,
            context: Default::default(),
        };
        publisher
            .hpub(
                &fleet.names.job_subject("math.add"),
                None,
                header,
                &serde_json::to_vec(&job)?,
            )
            .await
            .with_context(|| format!("poison {i}"))?;
    }
    let mut answered = std::collections::BTreeMap::new();
    let deadline = tokio::time::Instant::now() + EVENT_WAIT;
    while answered.len() < POISON.len() {
        let message = tokio::time::timeout_at(deadline, results.next())
            .await
            .with_context(|| format!("poisoned jobs answered: {answered:?}"))?
            .context("subscription closed")?;
        let result: CallResult = serde_json::from_slice(&message.payload)?;
        let turn = message
            .subject
            .split('.')
            .nth(2)
            .unwrap_or_default()
            .to_string();
        if turn.starts_with("poison-") {
            answered.insert(turn, (result.state, result.attempts, result.result));
        }
    }
    for (i, turn) in (0..POISON.len()).map(|i| (i, format!("poison-{i}"))) {
        let (state, attempts, value) = &answered[&turn];
        assert_eq!(*state, CallState::Done, "{turn}: {answered:?}");
        assert_eq!(*attempts, 1, "{turn}: delivered once");
        assert_eq!(
            value.as_ref().and_then(|v| v.get("sum")),
            Some(&json!(i + 100))
        );
    }
    // And honest turns go on.
    let outcome = fleet
        .run_calls(
            "acme",
            vec![call("sum", "math.add", json!({"a": 1, "b": 2}))],
            EVENT_WAIT,
        )
        .await?;
    assert_eq!(
        value_at(result_of(&outcome.final_event, "sum")?, "/sum"),
        Some(json!(3))
    );

    let (status, lines) = stop_outside(child).await?;
    assert!(status.success(), "{status}");
    let errors = error_lines(&lines);
    assert!(errors.is_empty(), "{errors:#?}");
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outside_crate_passes_conformance_with_the_sdks_probe() -> Result<()> {
    let (fleet, coordinator, mut child) = outside_fleet().await?;
    let tool = toolfleet_worker::conformance::CONFORMANCE_TOOL;
    fleet.wait_for_tools(&[tool]).await?;
    let settings = toolfleet_tests::conformance::settings(&fleet, tool, child.id())?;
    // The stderr pipe is drained while the probe runs, so the worker never blocks on it.
    let mut stderr = child.stderr.take().context("stderr is not piped")?;
    let drain = tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = stderr.read_to_end(&mut sink).await;
    });
    let report = conformance::run(&settings).await?;
    toolfleet_tests::conformance::assert_clean(&report);
    let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
    drain.abort();
    coordinator.stop().await;
    Ok(())
}
