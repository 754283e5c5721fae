//! The Python frontend client of `sdk/python/toolfleet_client`, used as a frontend
//! developer would use it, against a real fleet: a turn of several calls read in `seq`
//! order, an ended turn replayed, a running turn left and attached from its last `seq`
//! (the deadline read from the replayed `ack`), an unknown id, a cancel, an `overloaded`
//! refusal waited out for its `retry_after_ms`, the NATS user of `deploy/nats/auth.conf`
//! (its own subjects and inbox); many turns while `nats-server` is killed
//! with SIGKILL and restarted every 1.5–3 s, not one lost; and the README's example run
//! as written. Beside it, the Rust client reads an attached turn's deadline from its
//! `ack` as well.
//!
//! The client's one package (nats-py) is installed by the test into a virtual
//! environment of its own (`python::venv`); the client is imported from the repository
//! (`PYTHONPATH`), so the test always runs its current source.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use toolfleet_common::TurnEvent;
use toolfleet_coordinator::{TenantPolicies, TenantPolicy};
use toolfleet_tests::fleet::{assert_numbered_ack_to_final, one_sleeping_call, Fleet};
use toolfleet_tests::secured::{SecuredServers, FRONTEND_PASSWORD};
use toolfleet_tests::{child_command, repo_path};

/// Bound of one scenario script.
const SCRIPT_WAIT: Duration = Duration::from_secs(120);
/// How long the chaos run keeps turns in flight.
const CHAOS_SECONDS: u64 = 30;
/// Turns the chaos run keeps in flight at once.
const CHAOS_CONCURRENCY: u32 = 12;
/// A turn's budget in the chaos script (its `DEADLINE_MS`) plus its wait for a `final`.
const CHAOS_TURN_BOUND_S: f64 = 16.0;

/// The Python of a virtual environment with the SDK's requirements (nats-py).
async fn python() -> Result<std::path::PathBuf> {
    toolfleet_tests::python::sdk_venv(env!("CARGO_TARGET_TMPDIR")).await
}

/// `python <script> <args>` with the client importable, bounded by [`SCRIPT_WAIT`]: the
/// one JSON object it prints.
async fn run_script(
    python: &Path,
    script: &Path,
    args: &[String],
    env: &[(&str, &str)],
) -> Result<Value> {
    let mut command = child_command(python, Stdio::piped());
    command
        .arg(script)
        .args(args)
        .current_dir(repo_path(""))
        .env("PYTHONPATH", repo_path("sdk/python"))
        .envs(env.iter().copied());
    let out = tokio::time::timeout(SCRIPT_WAIT, command.output())
        .await
        .with_context(|| format!("{} did not finish in time", script.display()))??;
    anyhow::ensure!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        out.status
    );
    let text = String::from_utf8(out.stdout)?;
    let last = text.lines().last().context("the script printed nothing")?;
    serde_json::from_str(last).with_context(|| format!("not JSON: {last}"))
}

fn scenario(fleet: &Fleet, name: &str) -> Vec<String> {
    vec![
        fleet.nats.url(),
        fleet.names.prefix().to_string(),
        name.to_string(),
    ]
}

fn seqs(n: u64) -> Value {
    json!((1..=n).collect::<Vec<_>>())
}

/// A Redis that dies with acknowledged writes not yet on disk comes back without a
/// turn's last events, and stores its `final` under a seq the client already holds: the
/// Python client still ends the turn with that `final`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_takes_a_final_stored_under_a_seq_it_holds() -> Result<()> {
    let python = python().await?;
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let script = repo_path("tests/python/frontend_client.py");
    let redis_url = fleet.redis.url();
    let env = [
        ("TOOLFLEET_TEST_REDIS_URL", redis_url.as_str()),
        ("TOOLFLEET_PREFIX", fleet.names.prefix()),
    ];
    let report = run_script(&python, &script, &scenario(&fleet, "rewound"), &env).await?;
    assert_eq!(report["trimmed"], "+OK", "{report}");
    let held = report["held"].as_u64().context("held")?;
    let stored = report["stored"].as_u64().context("stored")?;
    assert!(held >= 8 && stored < held, "{report}");
    assert_eq!(report["last"], "final", "{report}");
    assert_eq!(report["last_seq"], stored, "{report}");
    assert_eq!(report["summary"]["ok"], 4, "{report}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_follows_attaches_and_cancels_turns() -> Result<()> {
    let python = python().await?;
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let script = repo_path("tests/python/frontend_client.py");
    let report = run_script(&python, &script, &scenario(&fleet, "follow"), &[]).await?;

    // Three calls: ack, three pending, three done, narration, final, in seq order.
    let three = &report["three_calls"];
    let n = three["seqs"].as_array().context("seqs")?.len() as u64;
    assert_eq!(three["seqs"], seqs(n), "{three}");
    assert_eq!(three["types"][0], "ack");
    assert_eq!(three["types"][n as usize - 1], "final");
    assert_eq!(three["states"], json!(["done", "done", "done"]));
    assert_eq!(three["summary"]["ok"], 3);
    assert_eq!(three["deadline_ms"], 60000);
    assert_eq!(three["asks"], 1, "a healthy turn is asked for once");
    // The ended turn replays every event and the same final.
    assert_eq!(report["replayed"]["seqs"], seqs(n));
    assert_eq!(report["replayed"]["same_final"], true);

    // Left after two events and attached from there: the rest, none repeated.
    let resumed = &report["resumed"];
    assert_eq!(resumed["first"]["seqs"], json!([1, 2]));
    let rest = resumed["rest"]["seqs"].as_array().context("rest")?;
    let all = 2 + rest.len() as u64;
    assert_eq!(
        resumed["rest"]["seqs"],
        json!((3..=all).collect::<Vec<_>>())
    );
    assert_eq!(resumed["final_state"], "done");
    // Attached past the ack, the stream knows only the default; the replayed ack names
    // the turn's own deadline.
    assert_eq!(resumed["deadline_without_ack"], 15000);
    assert_eq!(resumed["deadline_from_replayed_ack"], 60000);
    assert_eq!(resumed["replay"]["seqs"], seqs(all));

    assert_eq!(report["unknown"]["types"], json!(["error"]));
    assert_eq!(report["unknown"]["seqs"], json!([null]));
    assert_eq!(report["unknown"]["code"], "unknown_turn");

    let cancelled = &report["cancelled"];
    assert_eq!(cancelled["ack"], "ack");
    assert_eq!(cancelled["reply"]["outcome"], "cancelled");
    assert_eq!(cancelled["second"]["outcome"], "already_ended");
    assert_eq!(cancelled["second"]["ended"], "cancelled");
    assert_eq!(cancelled["states"], json!(["cancelled", "done"]));
    assert_eq!(cancelled["summary"]["cancelled"], 1);
    assert!(
        cancelled["final_after_s"].as_f64().unwrap_or(f64::MAX) < 3.0,
        "{cancelled}"
    );

    assert_eq!(report["refused"]["code"], "invalid_decision");
    assert_eq!(report["refused"]["retryable"], false);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_waits_out_an_overloaded_refusal_for_its_retry_after() -> Result<()> {
    let python = python().await?;
    let fleet = Fleet::start().await?;
    let mut config = fleet.coordinator_config();
    config.tenants = TenantPolicies {
        default: TenantPolicy::default(),
        tenants: BTreeMap::from([(
            "busy".to_string(),
            TenantPolicy {
                max_turns_in_flight: Some(1),
                ..TenantPolicy::default()
            },
        )]),
    };
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let (_coordinator, _worker) = fleet.start_with(config, tools, &["test.behave"]).await?;
    let script = repo_path("tests/python/frontend_client.py");
    let report = run_script(&python, &script, &scenario(&fleet, "overloaded"), &[]).await?;

    assert_eq!(report["first_ack"], "ack");
    assert_eq!(report["refusal_code"], "overloaded");
    assert_eq!(
        report["refusals"], 1,
        "asked again only once the wait was over: {report}"
    );
    let retry_after = report["retry_after_ms"]
        .as_f64()
        .context("retry_after_ms")?
        / 1000.0;
    // The refusal names the first turn's deadline (2.5 s), not the default second.
    assert!(retry_after > 1.5, "{report}");
    let accepted_after = report["accepted_after_s"]
        .as_f64()
        .context("accepted_after_s")?;
    assert!(accepted_after >= retry_after - 0.05, "{report}");
    assert!(accepted_after < retry_after + 2.0, "{report}");
    assert_eq!(report["second"]["types"][0], "ack");
    assert_eq!(report["second_summary"]["ok"], 1);
    assert_eq!(report["asks"], 2);
    Ok(())
}

/// Runs the chaos script in `mode` for [`CHAOS_SECONDS`] while `nats-server` is killed
/// with SIGKILL and restarted every 1.5–3 s; its report and the number of kills.
async fn under_nats_kills(mode: &str) -> Result<(Value, u32)> {
    let python = python().await?;
    let (mut fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let script = repo_path("tests/python/frontend_chaos.py");
    let args = vec![
        fleet.nats.url(),
        fleet.names.prefix().to_string(),
        CHAOS_SECONDS.to_string(),
        CHAOS_CONCURRENCY.to_string(),
        mode.to_string(),
    ];
    let run = run_script(&python, &script, &args, &[]);
    tokio::pin!(run);
    let mut kills = 0u32;
    let chaos_until = tokio::time::Instant::now() + Duration::from_secs(CHAOS_SECONDS);
    let report = loop {
        // 1.5, 2.2, 2.9, 1.9, 2.6 … s between kills: every value of the range in turn.
        let pause = Duration::from_millis(1500 + u64::from(kills * 700 % 1600));
        tokio::select! {
            report = &mut run => break report?,
            () = tokio::time::sleep(pause), if tokio::time::Instant::now() < chaos_until => {
                fleet.nats.kill().await;
                fleet.nats.restart().await?;
                kills += 1;
            }
        }
    };
    Ok((report, kills))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_turn_is_lost_while_nats_server_is_killed_and_restarted() -> Result<()> {
    let (report, kills) = under_nats_kills("client").await?;
    eprintln!("python client under {kills} nats-server kills: {report}");
    assert!(kills >= 8, "{kills} kills");
    let turns = report["turns"].as_u64().context("turns")?;
    assert!(turns >= 100, "{report}");
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(report["finals"], turns, "{report}");
    assert_eq!(report["finals_with_all_results"], turns, "{report}");
    // Exactly one final per turn, every turn's events in seq order without a repeat.
    assert_eq!(report["finals_per_turn"], json!({"1": turns}), "{report}");
    assert_eq!(report["out_of_order"], json!([]), "{report}");
    assert_eq!(report["client_errors"], json!({}), "{report}");
    assert_eq!(report["errors"], json!({}), "{report}");
    // The kills cost some turns their first request or events: they asked again.
    assert!(
        report["reasked_turns"].as_u64().unwrap_or(0) > 0,
        "{report}"
    );
    assert!(
        report["slowest_turn_s"].as_f64().unwrap_or(f64::MAX) < CHAOS_TURN_BOUND_S,
        "{report}"
    );
    Ok(())
}

/// The same load with each request published once and waited for, as PROTOCOL 8.1's
/// first sample did: a measurement for comparison (turns lost), not a guarantee.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement of a frontend that does not ask again; run with --ignored"]
async fn a_frontend_that_publishes_once_under_nats_server_kills() -> Result<()> {
    let (report, kills) = under_nats_kills("once").await?;
    eprintln!("publish-once frontend under {kills} nats-server kills: {report}");
    assert!(report["turns"].as_u64().unwrap_or(0) > 0, "{report}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_works_as_the_frontend_user_of_the_shipped_nats_config() -> Result<()> {
    let python = python().await?;
    let servers = SecuredServers::start().await?;
    let _coordinator = servers.coordinator(toolfleet_tests::free_port()?);
    let _worker = servers.demo_worker(toolfleet_tests::free_port()?)?;
    let frontend = servers.frontend().await?;
    toolfleet_tests::fleet::wait_for_tools_on(&frontend, &["crm.getOpenInvoices"]).await?;
    let script = repo_path("tests/python/frontend_client.py");
    let args = vec![
        servers.nats.url(),
        servers.names.prefix().to_string(),
        "as_user".to_string(),
    ];
    let user = [
        ("TOOLFLEET_NATS_USER", "frontend"),
        ("TOOLFLEET_NATS_PASSWORD", FRONTEND_PASSWORD),
    ];
    let report = run_script(&python, &script, &args, &user).await?;
    assert!(
        report["tools"]
            .as_array()
            .is_some_and(|t| t.contains(&json!("crm.getOpenInvoices"))),
        "{report}"
    );
    let n = report["turn"]["seqs"].as_array().context("seqs")?.len() as u64;
    assert_eq!(report["turn"]["seqs"], seqs(n), "{report}");
    assert_eq!(report["summary"]["ok"], 1, "{report}");
    assert_eq!(report["again"]["seqs"], seqs(n));
    assert_eq!(report["cancel"]["outcome"], "already_ended");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_reads_an_attached_turns_deadline_from_its_ack() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let request = one_sleeping_call("rust-attach-deadline", 60_000, 300);
    let mut submitted = fleet.client.submit(request).await?;
    let ack = submitted.next_event(Duration::from_secs(10)).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");

    let mut attached = fleet.client.attach("rust-attach-deadline").await?;
    assert_eq!(
        attached.deadline(),
        Duration::from_secs(15),
        "before the ack"
    );
    let replayed = attached.next_event(Duration::from_secs(10)).await?;
    assert!(matches!(replayed, TurnEvent::Ack { .. }), "{replayed:?}");
    assert_eq!(attached.deadline(), Duration::from_secs(60));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_example_of_the_python_client_runs_as_written() -> Result<()> {
    let python = python().await?;
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let readme = toolfleet_tests::read_repo_file("sdk/python/README.md")?;
    let section = readme
        .split("## Frontend client")
        .nth(1)
        .context("no Frontend client section")?;
    let code = section
        .split("```python\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .context("no python block in the Frontend client section")?;
    assert!(code.lines().count() <= 12, "a short example:\n{code}");
    let dir = tempfile::tempdir()?;
    let example = dir.path().join("example.py");
    std::fs::write(&example, code)?;
    let mut command = child_command(&python, Stdio::piped());
    command
        .arg(&example)
        .env("PYTHONPATH", repo_path("sdk/python"))
        .env("TOOLFLEET_NATS_URL", fleet.nats.url());
    let out = tokio::time::timeout(SCRIPT_WAIT, command.output()).await??;
    assert!(out.status.success(), "{}", out.status);
    let text = String::from_utf8(out.stdout)?;
    // One line per event, `seq type text`: the ack first, the final last.
    assert_numbered_ack_to_final(&text)
}
