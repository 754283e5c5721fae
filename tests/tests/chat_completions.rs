//! `POST /v1/chat/completions` driven by the official `openai` Python client (from PyPI,
//! provisioned by the test: `tests/python/requirements-openai.txt`) against a real fleet
//! and gateway, with a scripted model server standing in for the paid upstream
//! (`toolfleet_dev::upstream`). Every scenario runs unstreamed and streamed; the two must
//! give the same content, calls, finish reason and usage.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use toolfleet_dev::upstream::{
    calls_answer, text_answer, tool_messages, Scripted, ScriptedUpstream,
};
use toolfleet_gateway::keys::{self, ChatLimits, StopAfter};
use toolfleet_tests::fleet::Fleet;
use toolfleet_tests::gateway::{create_key, stack, GatewayNode};
use toolfleet_tests::ops::metric_value;
use toolfleet_tests::pg::TestDatabase;
use toolfleet_tests::python::{script_json, venv};
use toolfleet_tests::tls::{TestCertificates, TlsProxy};
use toolfleet_tests::{free_port, strings_at};

const REQUIREMENTS: &str = "tests/python/requirements-openai.txt";

/// What the client saw without and with streaming, every request the model server got
/// (both runs), and the gateway's `/metrics` afterwards.
struct Run {
    plain: Value,
    streamed: Value,
    requests: Vec<Value>,
    metrics: String,
}

/// How the gateway under test is set up beyond the defaults.
#[derive(Default)]
struct Setup {
    /// Limits stored on the API key.
    limits: ChatLimits,
    /// The model server behind TLS (a proxy with a test CA the gateway is told to trust).
    https: bool,
}

/// `upstream` behind a TLS-terminating proxy with a throwaway CA (kept alive with it).
async fn behind_tls(upstream: &ScriptedUpstream) -> Result<(TestCertificates, TlsProxy)> {
    let certificates = TestCertificates::generate().await?;
    let backend = upstream
        .base_url
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .parse()?;
    let proxy = TlsProxy::start(&certificates, backend).await?;
    Ok((certificates, proxy))
}

/// Runs `scenario` of `tests/python/openai_client.py` against a fleet whose gateway's
/// model server answers from `script`.
async fn run(scenario: &str, script: Vec<Scripted>) -> Result<Run> {
    run_with(scenario, script, Setup::default()).await
}

/// [`run`] with `setup`.
async fn run_with(scenario: &str, script: Vec<Scripted>, setup: Setup) -> Result<Run> {
    let limits = setup.limits;
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let upstream = ScriptedUpstream::start(script).await?;
    let db = TestDatabase::create().await?;
    let ops = format!("127.0.0.1:{}", free_port()?);
    let mut env = vec![
        ("TOOLFLEET_UPSTREAM_BASE_URL", upstream.base_url.clone()),
        ("TOOLFLEET_HTTP_ADDR", ops.clone()),
    ];
    let mut _tls = None;
    if setup.https {
        let (certificates, proxy) = behind_tls(&upstream).await?;
        env[0].1 = format!("https://localhost:{}/v1", proxy.port);
        env.push((
            "TOOLFLEET_UPSTREAM_CA_FILE",
            certificates.ca_file().display().to_string(),
        ));
        _tls = Some((certificates, proxy));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let gateway = GatewayNode::start(&fleet, &db, &env).await?;
    let key = create_key(&db, "acme").await?;
    if limits != ChatLimits::default() {
        let admin = db.admin().await?;
        let listed = keys::list(&admin, Some("acme")).await?;
        let id = &listed.first().context("the key is listed")?.id;
        let set = keys::set_chat_limits(&admin, id, limits).await?;
        assert_eq!(set.chat, limits);
    }
    let base = format!("{}/v1", gateway.base);
    let seen = script_json(
        &python,
        "tests/python/openai_client.py",
        &[&base, &key, scenario],
    )
    .await?;
    let metrics = reqwest::get(format!("http://{ops}/metrics"))
        .await?
        .error_for_status()?
        .text()
        .await?;
    Ok(Run {
        plain: seen["plain"].clone(),
        streamed: seen["streamed"].clone(),
        requests: upstream.requests(),
        metrics,
    })
}

/// The fields both modes must agree on.
fn essence(outcome: &Value) -> Value {
    json!({
        "content": outcome["content"],
        "tool_calls": outcome["tool_calls"],
        "finish_reason": outcome["finish_reason"],
        "usage": outcome["usage"],
        "error": outcome["error"],
    })
}

fn assert_parity(run: &Run) {
    assert_eq!(
        essence(&run.plain),
        essence(&run.streamed),
        "plain vs streamed"
    );
}

/// `answer` reporting `prompt` and `completion` tokens.
fn with_usage(answer: Scripted, prompt: u64, completion: u64) -> Scripted {
    match answer {
        Scripted::Answer(mut response) => {
            response["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": completion,
                                       "total_tokens": prompt + completion});
            Scripted::Answer(response)
        }
        other => other,
    }
}

fn customer() -> Value {
    json!({"customerId": "cust_001"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_of_three_parallel_fleet_calls_then_the_answer() -> Result<()> {
    let script = vec![
        calls_answer(&[
            ("call_inv", "crm__getOpenInvoices", customer()),
            ("call_appt", "crm__listUpcomingAppointments", customer()),
            ("call_echo", "test__behave", json!({"value": "echo"})),
        ]),
        text_answer("You have open invoices and upcoming appointments."),
    ];
    let run = run("one_round", script).await?;
    assert_parity(&run);
    assert_eq!(
        run.plain["content"],
        "You have open invoices and upcoming appointments."
    );
    assert_eq!(run.plain["finish_reason"], "stop");
    assert_eq!(run.plain["toolfleet"]["rounds"], 1);
    assert_eq!(run.plain["toolfleet"]["fleet_calls"], 3);
    // Per mode: the first request, then one with every result in the model's order.
    assert_eq!(run.requests.len(), 4);
    let offered = strings_at(&run.requests[0]["tools"], "/function/name", "tools offered")?;
    assert!(offered.contains(&"crm__getOpenInvoices"), "{offered:?}");
    for second in [&run.requests[1], &run.requests[3]] {
        let results = tool_messages(second);
        let ids: Vec<&str> = results.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["call_inv", "call_appt", "call_echo"]);
        assert!(results[2].1.contains("echo"), "{:?}", results[2]);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rounds_run_before_the_answer() -> Result<()> {
    let script = vec![
        with_usage(
            calls_answer(&[("r1", "test__behave", json!({"value": 1}))]),
            110,
            7,
        ),
        with_usage(
            calls_answer(&[
                ("r2a", "test__behave", json!({"value": 2})),
                ("r2b", "crm__getOpenInvoices", customer()),
            ]),
            240,
            31,
        ),
        with_usage(text_answer("Two rounds done."), 300, 12),
    ];
    let run = run("two_rounds", script).await?;
    assert_parity(&run);
    assert_eq!(run.plain["content"], "Two rounds done.");
    // Every round the model answered is billed, streamed (include_usage) and not.
    for mode in [&run.plain, &run.streamed] {
        let usage = &mode["usage"];
        let counts = [
            &usage["prompt_tokens"],
            &usage["completion_tokens"],
            &usage["total_tokens"],
        ];
        assert_eq!(counts, [650, 50, 700], "{usage}");
    }
    assert_eq!(run.plain["toolfleet"]["rounds"], 2);
    let last = &run.requests[2];
    let ids: Vec<String> = tool_messages(last).into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, ["r1", "r2a", "r2b"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_mixing_fleet_and_caller_tools_returns_every_call_in_order() -> Result<()> {
    let script = vec![
        calls_answer(&[
            ("m1", "crm__getOpenInvoices", customer()),
            ("m2", "get_weather", json!({"city": "Lyon"})),
            ("m3", "test__behave", json!({"value": "fleet"})),
        ]),
        text_answer("Sunny, and your invoices are listed."),
    ];
    let run = run("mixed", script).await?;
    assert_parity(&run);
    for seen in [&run.plain, &run.streamed] {
        assert_eq!(seen["finish_reason"], "tool_calls");
        let ids = strings_at(&seen["tool_calls"], "/id", "calls")?;
        assert_eq!(ids, ["m1", "m2", "m3"], "never a subset, never reordered");
        assert_eq!(seen["toolfleet"]["fleet_call_ids"], json!(["m1", "m3"]));
        assert_eq!(
            seen["continued"]["content"],
            "Sunny, and your invoices are listed."
        );
    }
    // The continued requests carry the caller's result and the fleet's, in call order.
    let continued: Vec<&Value> = run
        .requests
        .iter()
        .filter(|r| !tool_messages(r).is_empty())
        .collect();
    assert_eq!(continued.len(), 2);
    for request in continued {
        let results = tool_messages(request);
        let ids: Vec<&str> = results.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["m1", "m2", "m3"]);
        assert_eq!(results[1].1, "sunny");
        assert!(results[2].1.contains("fleet"), "{:?}", results[2]);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rounds_cap_ends_the_loop_with_a_clear_answer() -> Result<()> {
    let again = calls_answer(&[("again", "test__behave", json!({"value": "more"}))]);
    let run = run("rounds_cap", vec![again]).await?;
    assert_parity(&run);
    assert_eq!(run.plain["finish_reason"], "length");
    assert!(
        run.plain["content"]
            .as_str()
            .is_some_and(|c| c.contains("after 1 rounds")),
        "{}",
        run.plain
    );
    assert_eq!(run.plain["toolfleet"]["stopped"], "max_rounds");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_error_passes_through_with_its_status_and_body() -> Result<()> {
    let body = json!({"error": {"message": "the model is overloaded", "type": "server_error", "code": "overloaded"}});
    let run = run("one_round", vec![Scripted::Fail(500, body)]).await?;
    assert_parity(&run);
    assert_eq!(run.plain["error"]["status"], 500);
    assert_eq!(
        run.plain["error"]["body"]["message"],
        "the model is overloaded"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_limits_cap_the_loop_and_the_gateway_counts_what_ran() -> Result<()> {
    // The model asks for two calls every time; the key allows one round.
    let again = calls_answer(&[
        ("lim_a", "test__behave", json!({"value": "a"})),
        ("lim_b", "test__behave", json!({"value": "b"})),
    ]);
    let limits = ChatLimits {
        max_rounds: Some(1),
        max_calls_per_round: None,
        stop_after: Some(StopAfter::Burst),
    };
    let run = run_with(
        "one_round",
        vec![again],
        Setup {
            limits,
            ..Setup::default()
        },
    )
    .await?;
    assert_parity(&run);
    assert_eq!(run.plain["finish_reason"], "length", "{}", run.plain);
    assert_eq!(run.plain["toolfleet"]["stopped"], "max_rounds");
    assert_eq!(run.plain["toolfleet"]["rounds"], 1);
    // After the burst the key's gate took the tools away: the second request of each run
    // said `tool_choice: none`.
    let gated = run
        .requests
        .iter()
        .filter(|r| r["tool_choice"] == "none")
        .count();
    assert_eq!(gated, 2, "{:?}", run.requests);

    let metric = |name: &str, labels: &[&str]| metric_value(&run.metrics, name, labels);
    assert_eq!(
        metric(
            "toolfleet_chat_completions_total",
            &["outcome=\"max_rounds\""]
        ),
        Some(2.0),
        "{}",
        run.metrics
    );
    assert_eq!(metric("toolfleet_chat_rounds_total", &[]), Some(2.0));
    assert_eq!(metric("toolfleet_chat_fleet_calls_total", &[]), Some(4.0));
    // Four upstream requests (two per run), none failed.
    assert_eq!(
        metric("gen_ai_client_operation_duration_seconds_count", &[]),
        Some(4.0)
    );
    assert_eq!(
        metric(
            "gen_ai_client_operation_duration_seconds_count",
            &["error_type"]
        ),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_model_server_is_reached_with_the_configured_ca() -> Result<()> {
    let script = vec![
        calls_answer(&[("tls_a", "test__behave", json!({"value": "over tls"}))]),
        text_answer("Done over TLS."),
    ];
    let run = run_with(
        "one_round",
        script,
        Setup {
            https: true,
            ..Setup::default()
        },
    )
    .await?;
    assert_parity(&run);
    assert_eq!(run.plain["content"], "Done over TLS.", "{}", run.plain);
    assert_eq!(run.plain["toolfleet"]["rounds"], 1);
    // Every request reached the model server through the TLS proxy.
    assert_eq!(run.requests.len(), 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_model_server_with_an_unknown_ca_is_a_clear_502() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let upstream = ScriptedUpstream::start(vec![text_answer("never seen")]).await?;
    let (_certificates, proxy) = behind_tls(&upstream).await?;
    let db = TestDatabase::create().await?;
    // No TOOLFLEET_UPSTREAM_CA_FILE: the system's roots do not know the test CA.
    let base_url = format!("https://localhost:{}/v1", proxy.port);
    let gateway = GatewayNode::start(
        &fleet,
        &db,
        &[("TOOLFLEET_UPSTREAM_BASE_URL", base_url.as_str())],
    )
    .await?;
    let key = create_key(&db, "acme").await?;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .bearer_auth(&key)
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .timeout(Duration::from_secs(30))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 502);
    let body: Value = response.json().await?;
    assert_eq!(body["error"]["code"], "upstream_unavailable", "{body}");
    assert!(upstream.requests().is_empty());
    Ok(())
}

/// Sends one unstreamed chat completion with `key`; the answer's JSON.
async fn complete(base: &str, key: &str, body: &Value) -> Result<Value> {
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await?;
    let status = response.status();
    let answer: Value = response.json().await?;
    if !status.is_success() {
        bail!("{status}: {answer}");
    }
    Ok(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_conversations_with_the_same_call_ids_each_get_their_own_results() -> Result<()> {
    // A model server that numbers its calls `call_0` in every conversation: user one's
    // conversation (its first round) asks for cust_001's appointments, user two's (which
    // already holds two answers of the model, so it gets entry 2) for cust_002's.
    let appointments = |customer: &str| {
        calls_answer(&[(
            "call_0",
            "crm__listUpcomingAppointments",
            json!({"customerId": customer}),
        )])
    };
    let script = vec![
        appointments("cust_001"),
        text_answer("Here are your appointments."),
        appointments("cust_002"),
        text_answer("Here are your appointments."),
    ];
    let upstream = ScriptedUpstream::start(script).await?;
    let env = [("TOOLFLEET_UPSTREAM_BASE_URL", upstream.base_url.as_str())];
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&env).await?;
    // One frontend (one key of the tenant) serving both users.
    let key = create_key(&db, "acme").await?;

    let first = json!({"model": "m", "messages": [
        {"role": "user", "content": "I am cust_001. What are my appointments?"}]});
    let answer = complete(&gateway.base, &key, &first).await?;
    assert_eq!(answer["toolfleet"]["rounds"], 1, "{answer}");
    let second = json!({"model": "m", "messages": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "The clinic's assistant."},
        {"role": "user", "content": "I am cust_002. What are my appointments?"}]});
    let answer = complete(&gateway.base, &key, &second).await?;
    assert_eq!(answer["toolfleet"]["rounds"], 1, "{answer}");

    // What the model was told each call returned.
    let results: Vec<String> = upstream
        .requests()
        .iter()
        .flat_map(tool_messages)
        .map(|(id, content)| {
            assert_eq!(id, "call_0");
            content
        })
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].contains("dental cleaning"), "{}", results[0]);
    assert!(
        results[1].contains("physiotherapy") && !results[1].contains("dental cleaning"),
        "user two got another conversation's results: {}",
        results[1]
    );
    Ok(())
}
