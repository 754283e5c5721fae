//! `POST /v1/chat/completions` driven by typed JavaScript clients that build the `tools`
//! array themselves — the Vercel AI SDK (`ai` with `@ai-sdk/openai`, `generateText` and
//! `streamText`) and the official `openai` npm client — each with one tool of its own
//! and the fleet's tools asked for with the `X-Toolfleet-Tools: fleet` header, against a
//! real fleet and gateway with a scripted model server. The packages come from
//! `tests/node/package-lock.json`, installed by the test with `npm ci` into a folder
//! under the build's target directory, keyed by the lockfile's hash. A machine without
//! Node.js fails the test with the package to install; nothing is skipped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::process::Command;
use toolfleet_dev::upstream::{calls_answer, text_answer, tool_messages, ScriptedUpstream};
use toolfleet_tests::gateway::{create_key, stack};
use toolfleet_tests::{output_of, repo_path};

/// The Debian packages that give a machine `node` and `npm`.
const INSTALL_HINT: &str = "apt-get install -y nodejs npm";
/// The files copied beside the installed packages (ES modules resolve `node_modules`
/// from the script's own folder).
const SCRIPTS: [&str; 2] = ["clients.mjs", "readme_example.mjs"];
const FINAL_TEXT: &str = "Sunny in Lyon, and you owe $150.00.";

/// `name` on `PATH`, or an error naming the package to install.
fn on_path(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not found: {INSTALL_HINT}"))
}

/// A folder under the target directory holding `tests/node`'s packages (installed once
/// per lockfile) and its scripts (copied every time).
async fn node_modules() -> Result<PathBuf> {
    let source = repo_path("tests/node");
    let lock = std::fs::read(source.join("package-lock.json"))?;
    let manifest = std::fs::read(source.join("package.json"))?;
    let mut digest = Sha256::new();
    digest.update(&manifest);
    digest.update(&lock);
    let hex: String = digest.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = root.join(format!("node-clients-{hex}"));
    static PROVISIONING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = PROVISIONING.lock().await;
    if !dir
        .join("node_modules")
        .join(".package-lock.json")
        .is_file()
    {
        on_path("node")?;
        let npm = on_path("npm")?;
        // Installed beside its final place and renamed into it, so a half-done install is
        // never used.
        let building = root.join(format!("node-clients-{hex}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&building);
        std::fs::create_dir_all(&building)?;
        std::fs::write(building.join("package.json"), &manifest)?;
        std::fs::write(building.join("package-lock.json"), &lock)?;
        let mut npm = Command::new(npm);
        npm.args(["ci", "--no-audit", "--no-fund", "--ignore-scripts"])
            .current_dir(&building)
            .stdin(Stdio::null());
        let installed = output_of(&mut npm, Duration::from_secs(600), "npm ci in tests/node").await;
        if let Err(failed) = installed {
            let _ = std::fs::remove_dir_all(&building);
            return Err(failed);
        }
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&building, &dir)?;
    }
    for script in SCRIPTS {
        std::fs::copy(source.join(script), dir.join(script))?;
    }
    Ok(dir)
}

/// Runs `node <args>` in `dir` with `env` (bounded); its stdout.
async fn node(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let mut command = Command::new(on_path("node")?);
    command
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for (key, value) in env {
        command.env(key, value);
    }
    let what = format!("node {args:?}");
    let out = output_of(&mut command, Duration::from_secs(120), &what).await?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The names of the tools a request offered the model.
fn offered(request: &Value) -> Vec<String> {
    request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_js_clients_mix_their_own_tool_with_the_fleets() -> Result<()> {
    let dir = node_modules().await?;
    // One message calling a fleet tool, the client's own tool and another fleet tool;
    // then the answer.
    let script = vec![
        calls_answer(&[
            (
                "m1",
                "crm__getOpenInvoices",
                json!({"customerId": "cust_001"}),
            ),
            ("m2", "get_weather", json!({"city": "Lyon"})),
            ("m3", "test__behave", json!({"value": "fleet"})),
        ]),
        text_answer(FINAL_TEXT),
    ];
    let upstream = ScriptedUpstream::start(script).await?;
    let env = [("TOOLFLEET_UPSTREAM_BASE_URL", upstream.base_url.as_str())];
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&env).await?;
    let key = create_key(&db, "acme").await?;

    let scenarios = ["ai-generate", "ai-stream", "openai-plain", "openai-stream"];
    for (i, scenario) in scenarios.into_iter().enumerate() {
        let out = node(&dir, &["clients.mjs", &gateway.base, &key, scenario], &[]).await?;
        let seen: Value = serde_json::from_str(out.trim()).with_context(|| out.clone())?;
        assert_eq!(seen["text"], FINAL_TEXT, "{scenario}: {seen}");
        assert_eq!(seen["finishReason"], "stop", "{scenario}: {seen}");
        assert_eq!(seen["steps"], 2, "{scenario}: {seen}");
        // The client ran its own call, and only that one.
        assert_eq!(
            seen["ownCalls"],
            json!([{"id": "m2", "input": {"city": "Lyon"}}]),
            "{scenario}"
        );

        // Each client sent two requests: the question, then the conversation with its
        // own result.
        let requests = upstream.requests();
        assert_eq!(requests.len(), 2 * (i + 1), "{scenario}");
        let (first, second) = (&requests[2 * i], &requests[2 * i + 1]);
        let tools = offered(first);
        for name in ["get_weather", "crm__getOpenInvoices", "test__behave"] {
            assert!(tools.iter().any(|t| t == name), "{scenario}: {tools:?}");
        }
        assert_eq!(tools[0], "get_weather", "the client's own tools come first");
        // The model sees every result in its call order: the fleet's, never a client's
        // stand-in for a tool it does not know.
        let results = tool_messages(second);
        let ids: Vec<&str> = results.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["m1", "m2", "m3"], "{scenario}: {results:?}");
        assert!(results[0].1.contains("inv_001"), "{scenario}: {results:?}");
        assert_eq!(results[1].1, "sunny", "{scenario}");
        assert!(results[2].1.contains("fleet"), "{scenario}: {results:?}");
        assert!(
            results[2].1.contains("acme"),
            "{scenario}: the fleet ran it for the tenant: {results:?}"
        );
    }

    // The example of docs/FRONTENDS.md (the Vercel AI SDK), as written.
    let env = [
        ("TOOLFLEET_URL", gateway.base.as_str()),
        ("TOOLFLEET_API_KEY", key.as_str()),
    ];
    let out = node(&dir, &["readme_example.mjs"], &env).await?;
    assert_eq!(out.trim(), FINAL_TEXT);
    let requests = upstream.requests();
    let last = requests.last().context("the example asked the model")?;
    let ids: Vec<String> = tool_messages(last).into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, ["m1", "m2", "m3"]);
    Ok(())
}
