//! A worker cannot forge the result of a call it was not given: NATS lets a worker user
//! publish results only on its own tools' subjects (`<p>.results.<turn>.<tool>`, against
//! `deploy/nats/auth.conf`), and the coordinator refuses a result whose tool differs
//! from its subject's or from its call's, so the honest result still ends the call.
//! The same holds for progress notices: a worker announces only its own tools' calls
//! (`<p>.progress.<turn>.<tool>`) and can never tell a coordinator that a turn ended.

use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::fleet::{
    call, final_of, forged_result, read_ack, read_to_end, result_of, timed_turn, until_state,
    value_at, Fleet,
};
use toolfleet_tests::secured::{
    silent, worker_credentials, RoleConnection, SecuredServers, SILENCE,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// A successful result of call `id` claiming to come from tool `tool`.
fn forged(id: &str, tool: &str, value: Value) -> anyhow::Result<Vec<u8>> {
    forged_result(id, tool, value, "rogue")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_naming_another_tool_than_its_call_is_refused() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    let slow = call(
        "a",
        "test.behave",
        json!({"sleep_ms": 1500, "value": "real"}),
    );
    let mut stream = fleet.submit_calls("acme", 8000, vec![slow]).await?;
    let turn_id = stream.turn_id().to_string();
    read_ack(&mut stream, EVENT_WAIT).await?;

    let names = &fleet.names;
    let refund = json!("Your refund of $10,000 has been approved.");
    let forgeries = [
        // another tool's subject and name
        (
            names.tool_result_subject(&turn_id, "crm.getOpenInvoices"),
            "crm.getOpenInvoices",
        ),
        // the subject without a tool, another tool's name
        (names.result_subject(&turn_id), "crm.getOpenInvoices"),
        // the call's tool in the body, another tool's subject
        (
            names.tool_result_subject(&turn_id, "crm.getOpenInvoices"),
            "test.behave",
        ),
    ];
    for (subject, tool) in forgeries {
        js.publish(subject, forged("a", tool, refund.clone())?.into())
            .await?
            .await?;
    }

    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let fin = final_of(&events)?;
    let a = result_of(fin, "a")?;
    assert!(a.ok);
    assert_eq!(value_at(a, "/value"), Some(json!("real")), "{a:?}");
    assert_ne!(a.worker_id.as_deref(), Some("rogue"));
    // None of them was even counted as a copy of a recorded result.
    let counters = fleet.counters(&turn_id).await?;
    assert_eq!(counters.get("duplicates").map(String::as_str), Some("0"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_publishes_results_only_for_its_own_tools() -> anyhow::Result<()> {
    let servers = SecuredServers::start().await?;
    let names = &servers.names;
    let mut worker = RoleConnection::open(&servers.nats, &worker_credentials()).await?;
    for subject in [
        names.tool_result_subject("t1", "test.behave"),
        names.tool_result_subject("t1", "payments.refund"),
        names.result_subject("t1"),
    ] {
        let body = forged("a", "test.behave", json!("forged"))?;
        worker.client.publish(subject, body.into()).await?;
        worker.client.flush().await?;
        worker.expect_server_error().await?;
    }
    tokio::time::sleep(SILENCE).await;
    assert_eq!(servers.messages_in(&names.results_stream()).await?, 0);

    // Its own tool's subject is open to it.
    let own = names.tool_result_subject("t1", "crm.getOpenInvoices");
    let body = forged("a", "crm.getOpenInvoices", json!("honest"))?;
    worker.client.publish(own, body.into()).await?;
    worker.client.flush().await?;
    tokio::time::sleep(SILENCE).await;
    assert_eq!(servers.messages_in(&names.results_stream()).await?, 1);
    Ok(())
}

/// The events of `stream` that arrive within `window`.
async fn events_within(
    stream: &mut toolfleet_common::client::TurnStream,
    window: Duration,
) -> Vec<TurnEvent> {
    let end = tokio::time::Instant::now() + window;
    let mut events = Vec::new();
    while let Some(left) = end.checked_duration_since(tokio::time::Instant::now()) {
        match stream.next_event(left).await {
            Ok(event) => events.push(event),
            Err(_) => break,
        }
    }
    events
}

fn is_running(event: &TurnEvent, id: &str) -> bool {
    matches!(event, TurnEvent::ToolState { tool_call_id, state: CallState::Running, .. } if tool_call_id == id)
}

fn started(id: &str, tool: &str) -> anyhow::Result<Vec<u8>> {
    Ok(serde_json::to_vec(&ProgressNotice::Started {
        tool_call_id: id.into(),
        name: tool.into(),
        attempt: 1,
        worker_id: "rogue".into(),
        started_unix_ms: None,
    })?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_notices_neither_end_a_turn_nor_speak_for_another_tool() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let nats = fleet.client.nats().clone();
    let names = &fleet.names;
    // One call at a time: `b` waits behind `a` (2.5 s), so a `running` of `b` before
    // `a` is done can only come from a notice published here.
    let mut request = timed_turn(
        "acme",
        10_000,
        vec![
            call("a", "test.behave", json!({"sleep_ms": 2500, "value": "a"})),
            call("b", "test.behave", json!({"value": "b"})),
        ],
    );
    request.options.concurrency = Some(1);
    let mut stream = fleet.client.submit(request).await?;
    let turn_id = stream.turn_id().to_string();
    until_state(&mut stream, Some("a"), CallState::Running, EVENT_WAIT).await?;

    // What a worker of another tool, or any worker lying in the body, could send.
    let ended = serde_json::to_vec(&ProgressNotice::Ended)?;
    let forgeries = [
        (
            names.tool_progress_subject(&turn_id, "crm.getOpenInvoices"),
            started("b", "crm.getOpenInvoices")?,
        ),
        (
            names.tool_progress_subject(&turn_id, "crm.getOpenInvoices"),
            started("b", "test.behave")?,
        ),
        (
            names.tool_progress_subject(&turn_id, "test.behave"),
            started("b", "crm.getOpenInvoices")?,
        ),
        (
            format!("{}.progress.{turn_id}", names.prefix()),
            started("b", "test.behave")?,
        ),
        (
            names.tool_progress_subject(&turn_id, "test.behave"),
            ended.clone(),
        ),
        (format!("{}.progress.{turn_id}", names.prefix()), ended),
    ];
    for (subject, body) in forgeries {
        nats.publish(subject, body.into()).await?;
    }
    nats.flush().await?;
    let seen = events_within(&mut stream, Duration::from_millis(700)).await;
    assert!(!seen.iter().any(|e| is_running(e, "b")), "{seen:?}");

    // A notice on the call's own tool subject is relayed: the owner still holds the
    // turn (no forged `ended` released it) and the relay works.
    nats.publish(
        names.tool_progress_subject(&turn_id, "test.behave"),
        started("b", "test.behave")?.into(),
    )
    .await?;
    nats.flush().await?;
    until_state(&mut stream, Some("b"), CallState::Running, EVENT_WAIT).await?;
    let rest = read_to_end(&mut stream, EVENT_WAIT).await?;
    let fin = final_of(&rest)?;
    assert!(result_of(fin, "a")?.ok && result_of(fin, "b")?.ok);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_may_announce_only_its_own_tools_calls_and_never_a_turns_end() -> anyhow::Result<()>
{
    let servers = SecuredServers::start().await?;
    let names = &servers.names;
    let mut worker = RoleConnection::open(&servers.nats, &worker_credentials()).await?;
    let ended = serde_json::to_vec(&ProgressNotice::Ended)?;
    for (subject, body) in [
        (names.ended_subject("t1"), ended.clone()),
        (
            names.tool_progress_subject("t1", "test.behave"),
            started("a", "test.behave")?,
        ),
        (format!("{}.progress.t1", names.prefix()), ended),
    ] {
        worker.client.publish(subject, body.into()).await?;
        worker.client.flush().await?;
        worker.expect_server_error().await?;
    }
    // Its own tools' progress subjects are open to it (no error within the silence).
    let own = names.tool_progress_subject("t1", "crm.getOpenInvoices");
    worker
        .client
        .publish(own, started("a", "crm.getOpenInvoices")?.into())
        .await?;
    worker.client.flush().await?;
    assert!(
        silent(worker.expect_server_error()).await,
        "the worker's own progress subject was refused"
    );
    Ok(())
}

/// A pull request names its own reply subject, and JetStream delivers the pulled job
/// there. The worker user lives in an account of its own (`WORKERS` in
/// `deploy/nats/auth.conf`), so whatever subject it names, the job stays among workers:
/// a frontend listening on its inbox hears nothing of it, while the same pull into the
/// worker's own inbox gets the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_have_a_job_delivered_into_a_frontends_inbox() -> anyhow::Result<()> {
    use async_nats::jetstream::consumer;
    use futures::StreamExt;
    use toolfleet_tests::secured::{
        coordinator_credentials, frontend_credentials, EVENT_WAIT, WORKER_JS_API_PREFIX,
    };

    let servers = SecuredServers::start().await?;
    let names = &servers.names;
    let tool = "crm.getOpenInvoices";
    let coordinator = RoleConnection::open(&servers.nats, &coordinator_credentials()).await?;
    let coordinator_js = coordinator.jetstream();
    coordinator_js
        .get_stream(names.jobs_stream())
        .await?
        .create_consumer(consumer::pull::Config {
            durable_name: Some(names.tool_consumer(tool)),
            filter_subject: names.job_subject(tool),
            ..Default::default()
        })
        .await?;
    let job = |n: u32| {
        let js = coordinator_js.clone();
        let subject = names.job_subject(tool);
        async move {
            let body =
                json!({"job": n, "tenant_id": "acme", "arguments": {"customerId": "cust_001"}});
            js.publish(subject, serde_json::to_vec(&body)?.into())
                .await?
                .await?;
            anyhow::Ok(())
        }
    };
    let next = format!(
        "{WORKER_JS_API_PREFIX}.CONSUMER.MSG.NEXT.{}.{}",
        names.jobs_stream(),
        names.tool_consumer(tool)
    );
    let pull = json!({"batch": 1, "expires": 2_000_000_000u64}).to_string();

    let worker = RoleConnection::open(&servers.nats, &worker_credentials()).await?;
    let frontend = RoleConnection::open(&servers.nats, &frontend_credentials()).await?;
    let mut snooping = frontend.client.subscribe("_INBOX_frontend.>").await?;
    frontend.client.flush().await?;

    // Into its own inbox, the worker gets its tool's job.
    job(1).await?;
    let mut own = worker.client.subscribe("_INBOX_worker.pulled").await?;
    worker
        .client
        .publish_with_reply(next.clone(), "_INBOX_worker.pulled", pull.clone().into())
        .await?;
    let got = tokio::time::timeout(EVENT_WAIT, own.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("subscription closed"))?;
    let body: Value = serde_json::from_slice(&got.payload)?;
    assert_eq!(body["job"], json!(1), "{body}");

    // Into a frontend's inbox, the next job goes nowhere the frontend hears.
    job(2).await?;
    worker
        .client
        .publish_with_reply(next, "_INBOX_frontend.stolen", pull.into())
        .await?;
    worker.client.flush().await?;
    let heard = tokio::time::timeout(SILENCE * 2, snooping.next()).await;
    assert!(
        heard.is_err(),
        "a job reached the frontend: {:?}",
        heard.ok().flatten().map(|m| m.payload)
    );
    Ok(())
}
