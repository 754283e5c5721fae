//! The `mcp` pack against a real MCP server written with the official Python SDK
//! (`tests/mcp/server.py`, in a virtual environment the test provisions from
//! `tests/mcp/requirements.txt`), run over stdio by the pack and over Streamable HTTP
//! by the test: calls and their results, a killed server, a changing tool list, and the
//! turn's trace continued into the server.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use toolfleet_common::call::codes;
use toolfleet_common::{CallResult, CallState};
use toolfleet_packs::mcp::MCP_SERVER_UNAVAILABLE;
use toolfleet_packs::{start_packs, PackSettings, StartedPacks};
use toolfleet_tests::fleet::{call, code_of, result_of, Fleet, Running};
use toolfleet_tests::{eventually_named, free_port, python};

const EVENT_WAIT: Duration = Duration::from_secs(20);
const SERVER_START: Duration = Duration::from_secs(30);

/// The interpreter of the test's virtual environment, with the `mcp` SDK.
async fn python() -> Result<PathBuf> {
    python::venv(env!("CARGO_TARGET_TMPDIR"), "tests/mcp/requirements.txt").await
}

fn server_script() -> String {
    toolfleet_tests::repo_path("tests/mcp/server.py")
        .display()
        .to_string()
}

/// The test server over Streamable HTTP on a free port, killed on drop; its URL.
async fn http_server(python: &Path) -> Result<(Child, String)> {
    let port = free_port()?;
    let child = Command::new(python)
        .args([server_script(), "http".into(), port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting the HTTP MCP server")?;
    eventually_named(
        "the HTTP MCP server to listen",
        SERVER_START,
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
        },
    )
    .await?;
    Ok((child, format!("http://127.0.0.1:{port}/mcp")))
}

/// A servers file in `dir` with the stdio server `local` (its `nap` calls append the
/// server's pid to `marker`) and, when given, the HTTP server `remote`.
fn servers_file(dir: &Path, python: &Path, marker: &Path, url: Option<&str>) -> Result<PathBuf> {
    let mut servers = json!({
        "local": {
            "command": python,
            "args": [server_script(), "stdio"],
            "env": {"NAP_MARKER": marker},
            "timeout_ms": 5000,
            "waiting_hint": "asking the local server"
        }
    });
    if let Some(url) = url {
        servers["remote"] = json!({"url": url, "headers": {"x-fleet-test": "1"}});
    }
    let path = dir.join("mcp_servers.json");
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&json!({"servers": servers}))?,
    )?;
    Ok(path)
}

/// One test's MCP servers: the stdio server `local` napping into `marker` and, when
/// asked for, the HTTP server `remote` (killed on drop), named in the servers `file`.
struct Servers {
    marker: PathBuf,
    file: PathBuf,
    _dir: tempfile::TempDir,
    _http: Option<Child>,
}

impl Servers {
    /// The servers of [`servers_file`] in a new temporary folder, `remote` when `http`.
    async fn start(http: bool) -> Result<Self> {
        let python = python().await?;
        let dir = tempfile::tempdir()?;
        let (child, url) = match http {
            true => {
                let (child, url) = http_server(&python).await?;
                (Some(child), Some(url))
            }
            false => (None, None),
        };
        let marker = dir.path().join("naps");
        let file = servers_file(dir.path(), &python, &marker, url.as_deref())?;
        Ok(Self {
            marker,
            file,
            _dir: dir,
            _http: child,
        })
    }
}

/// One test's [`Servers`] (`remote` when `http`), a fresh fleet, and a coordinator and
/// a worker serving the `mcp` pack of those servers in-process, once `tools` are served.
async fn mcp_fleet(
    http: bool,
    tools: &[&str],
) -> Result<(Servers, Fleet, Running, Running, StartedPacks)> {
    let servers = Servers::start(http).await?;
    let fleet = Fleet::start().await?;
    let settings = PackSettings {
        mcp_servers_file: Some(servers.file.clone()),
        ..PackSettings::default()
    };
    let packs = start_packs(&["mcp"], &settings).await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let (config, pack_tools) = (fleet.worker_config(), packs.tools.clone());
    let worker = Running::spawn("worker", |token| {
        toolfleet_worker::run_set(config, pack_tools, token)
    });
    fleet.wait_for_tools(tools).await?;
    Ok((servers, fleet, coordinator, worker, packs))
}

/// Whether the two results' execution intervals overlap.
fn overlap(a: &CallResult, b: &CallResult) -> bool {
    let (Some(a0), Some(a1), Some(b0), Some(b1)) = (
        a.started_at.as_deref(),
        a.ended_at.as_deref(),
        b.started_at.as_deref(),
        b.ended_at.as_deref(),
    ) else {
        return false;
    };
    // RFC 3339 timestamps of one clock and format order as they read.
    a0 < b1 && b0 < a1
}

/// The catalog's native definition of `name`.
async fn definition(fleet: &Fleet, name: &str) -> Result<Value> {
    let tools = fleet
        .client
        .catalog(
            toolfleet_common::CatalogFormat::Native,
            None,
            Duration::from_secs(2),
        )
        .await?;
    tools
        .into_iter()
        .find(|t| t["name"] == name)
        .with_context(|| format!("{name} is not in the catalog"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_and_http_servers_answer_one_turn() -> Result<()> {
    let (_servers, fleet, _c, _w, packs) = mcp_fleet(
        true,
        &[
            "local.nap",
            "local.fail",
            "local.forecast",
            "remote.forecast",
            "remote.nap",
        ],
    )
    .await?;

    // What the servers said about their tools, as the fleet announces them.
    let forecast = definition(&fleet, "remote.forecast").await?;
    assert_eq!(forecast["description"], "Tomorrow's forecast for a city.");
    assert_eq!(
        forecast["input_schema"]["properties"]["city"]["type"],
        "string"
    );
    assert!(forecast["output_schema"]["properties"]["high_c"].is_object());
    assert_eq!(forecast["retry"]["idempotent"], true, "readOnlyHint");
    let nap = definition(&fleet, "local.nap").await?;
    assert_eq!(nap["retry"]["idempotent"], false);
    assert_eq!(nap["timeout_ms"], 5000);
    assert_eq!(nap["waiting_hint"], "asking the local server");

    let calls = vec![
        call("nap_a", "local.nap", json!({"ms": 500})),
        call("nap_b", "local.nap", json!({"ms": 500})),
        call("nap_http", "remote.nap", json!({"ms": 500})),
        call("fail", "local.fail", json!({"reason": "no umbrellas"})),
        call("weather", "remote.forecast", json!({"city": "Oslo"})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    for id in ["nap_a", "nap_b", "nap_http"] {
        let nap = result_of(fin, id)?;
        assert_eq!(nap.state, CallState::Done, "{nap:?}");
        assert_eq!(nap.result, Some(json!("slept 500 ms")));
        assert_eq!(nap.summary.as_deref(), Some("slept 500 ms"));
    }
    // The sleeps ran at once, on one stdio connection and over HTTP.
    let (a, b, h) = (
        result_of(fin, "nap_a")?,
        result_of(fin, "nap_b")?,
        result_of(fin, "nap_http")?,
    );
    assert!(
        overlap(a, b) && overlap(a, h) && overlap(b, h),
        "{a:?} {b:?} {h:?}"
    );

    let fail = result_of(fin, "fail")?;
    assert_eq!(fail.state, CallState::Error);
    assert_eq!(code_of(fail), Some(codes::TOOL_ERROR));
    let error = fail.error.as_ref().context("an error")?;
    assert!(error.message.contains("refused: no umbrellas"), "{error:?}");
    assert!(!error.retryable);

    let weather = result_of(fin, "weather")?;
    assert_eq!(weather.state, CallState::Done, "{weather:?}");
    let value = weather.result.clone().unwrap_or_default();
    assert_eq!(value["city"], "Oslo");
    assert_eq!(value["high_c"], 21);
    assert_eq!(weather.summary, None, "structured results are not read out");
    assert_eq!(fin.summary.ok, 4);
    assert_eq!(fin.summary.errors, 1);
    packs.stop().await;
    Ok(())
}

/// The pids the local server wrote while napping.
fn nap_pids(marker: &Path) -> Vec<i32> {
    std::fs::read_to_string(marker)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_stdio_server_fails_its_call_and_comes_back() -> Result<()> {
    let (servers, fleet, _c, _w, packs) = mcp_fleet(false, &["local.nap", "local.fail"]).await?;

    let calls = vec![call("long", "local.nap", json!({"ms": 5000}))];
    let mut stream = fleet
        .client
        .submit(toolfleet_tests::fleet::turn(
            "acme",
            toolfleet_tests::fleet::tool_calls(calls),
        ))
        .await?;
    let pid = eventually_named("the server to start the nap", EVENT_WAIT, || {
        let pids = nap_pids(&servers.marker);
        async move { pids.first().copied() }
    })
    .await?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;

    let fin = toolfleet_tests::fleet::read_final(&mut stream, EVENT_WAIT).await?;
    let long = result_of(&fin, "long")?;
    assert_eq!(code_of(long), Some(MCP_SERVER_UNAVAILABLE), "{long:?}");
    assert_eq!(long.error.as_ref().map(|e| e.retryable), Some(true));

    // Its tools left the catalog with it, and come back with the restarted server.
    fleet.wait_for_tool_gone("local.nap").await?;
    fleet.wait_for_tools(&["local.nap", "local.fail"]).await?;
    let short = fleet
        .run_one("acme", "short", "local.nap", json!({"ms": 10}), EVENT_WAIT)
        .await?;
    assert_eq!(short.state, CallState::Done, "{short:?}");
    let pids = nap_pids(&servers.marker);
    assert_eq!(pids.len(), 2, "{pids:?}");
    assert_ne!(pids[0], pids[1], "a new server process answered");
    packs.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_follows_a_changing_tool_list() -> Result<()> {
    let (_servers, fleet, _c, _w, packs) =
        mcp_fleet(true, &["local.learn", "remote.learn"]).await?;

    for server in ["local", "remote"] {
        let learned = format!("{server}.echo_{server}");
        let name = json!({"name": format!("echo_{server}")});
        let learn = format!("{server}.learn");
        let learn = fleet
            .run_one("acme", "learn", &learn, name.clone(), EVENT_WAIT)
            .await?;
        assert_eq!(learn.state, CallState::Done, "{learn:?}");
        fleet.wait_for_tools(&[&learned]).await?;

        let text = json!({"text": "hello"});
        let echo = fleet
            .run_one("acme", "echo", &learned, text, EVENT_WAIT)
            .await?;
        assert_eq!(echo.result, Some(json!("hello")), "{echo:?}");

        let forget = format!("{server}.forget");
        let forget = fleet
            .run_one("acme", "forget", &forget, name, EVENT_WAIT)
            .await?;
        assert_eq!(forget.state, CallState::Done);
        fleet.wait_for_tool_gone(&learned).await?;
    }
    packs.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_the_deadline_is_cancelled_on_the_server() -> Result<()> {
    let (servers, fleet, _c, _w, packs) = mcp_fleet(false, &["local.nap"]).await?;

    let request = toolfleet_tests::fleet::timed_turn(
        "acme",
        800,
        vec![call("long", "local.nap", json!({"ms": 5000}))],
    );
    let outcome = fleet.run(request, EVENT_WAIT).await?;
    let long = result_of(&outcome.final_event, "long")?;
    assert_eq!(long.state, CallState::Timeout, "{long:?}");
    // The runner dropped the call at the deadline; the server heard
    // `notifications/cancelled` and stopped the nap.
    let cancelled = eventually_named("the server to cancel the nap", EVENT_WAIT, || {
        let text = std::fs::read_to_string(&servers.marker).unwrap_or_default();
        async move {
            text.lines()
                .any(|l| l.starts_with("cancelled "))
                .then_some(())
        }
    })
    .await;
    assert!(cancelled.is_ok(), "{cancelled:?}");
    packs.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_call_continues_the_turn_trace() -> Result<()> {
    let servers = Servers::start(true).await?;
    let receiver = toolfleet_tests::otlp::OtlpReceiver::start().await?;
    let mut fleet = Fleet::start().await?;
    let file = servers.file.display().to_string();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
        ("FLEET_NODE_PACKS", "test,mcp".to_string()),
        ("TOOLFLEET_MCP_SERVERS", file),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let coordinator = fleet.spawn_node("coordinator", &env)?;
    let worker = fleet.spawn_node("worker", &env)?;
    fleet
        .wait_for_tools(&["test.behave", "remote.forecast"])
        .await?;

    let calls = vec![
        call("native", "test.behave", json!({"sleep_ms": 20})),
        call("weather", "remote.forecast", json!({"city": "Oslo"})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(fin.summary.ok, 2, "{fin:?}");
    let weather = result_of(fin, "weather")?
        .result
        .clone()
        .unwrap_or_default();
    fleet.terminate_nodes(&[worker, coordinator]).await?;

    let execs = eventually_named("both execute_tool spans", Duration::from_secs(10), || {
        let spans = receiver.spans();
        async move {
            let execs: Vec<_> = spans
                .into_iter()
                .filter(|s| s.attr("gen_ai.operation.name") == Some("execute_tool"))
                .collect();
            (execs.len() >= 2).then_some(execs)
        }
    })
    .await?;
    let span_of = |id: &str| {
        execs
            .iter()
            .find(|s| s.attr("gen_ai.tool.call.id") == Some(id))
            .with_context(|| format!("no execute_tool span for {id}"))
    };
    let (native, mcp) = (span_of("native")?, span_of("weather")?);
    assert_eq!(native.trace_id, mcp.trace_id, "one trace for the turn");
    // The server got the MCP call's execute_tool span as its parent, in `_meta` and as
    // the HTTP header.
    let expected = format!("00-{}-{}-01", mcp.trace_id, mcp.span_id);
    assert_eq!(weather["traceparent_meta"], json!(expected), "{weather}");
    assert_eq!(weather["traceparent_header"], json!(expected), "{weather}");
    eprintln!(
        "{}",
        toolfleet_tests::otlp::render_tree(
            &receiver.spans(),
            &mcp.trace_id,
            &["gen_ai.tool.name", "gen_ai.tool.call.id"]
        )
    );
    Ok(())
}
