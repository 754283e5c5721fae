//! A worker cannot forge the result of a call it was not given: NATS lets a worker user
//! publish results only on its own tools' subjects (`<p>.results.<turn>.<tool>`, against
//! `deploy/nats/auth.conf`), and the coordinator refuses a result whose tool differs
//! from its subject's or from its call's, so the honest result still ends the call.

use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_tests::fleet::{
    call, final_of, forged_result, read_ack, read_to_end, result_of, timed_turn, value_at, Fleet,
};
use toolfleet_tests::secured::{worker_credentials, RoleConnection, SecuredServers, SILENCE};

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
    let mut stream = fleet
        .client
        .submit(timed_turn("acme", 8000, vec![slow]))
        .await?;
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
