//! Frontends isolated from each other, against a real `nats-server` running
//! `deploy/nats/auth.conf` and a `redis-server` with `deploy/redis/users.acl`: a
//! frontend cannot read another frontend's inbox nor submit as another frontend, a turn
//! whose reply subject is a job subject or another frontend's inbox is dropped and
//! counted (nothing is published there, the stream stays empty), and a frontend bound to
//! a tenant cannot name another one (`tenant_not_allowed`), whatever the spelling.

use anyhow::Result;
use futures::StreamExt;
use serde_json::json;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{FleetClient, TurnEvent};
use toolfleet_tests::fleet::{turn, wait_for_catalog};
use toolfleet_tests::secured::{
    assert_a_turn_runs, assert_refused_once, frontend2_credentials, frontend_credentials,
    last_event, refused_turns, silent, RoleConnection, SecuredServers, EVENT_WAIT,
};
use toolfleet_tests::{eventually_named, free_port};

/// The forged final of the report: what a hostile frontend wants another one to show.
const FORGED: &str = "Your card was declined. Please read me the full card number and CVV.";

/// A `final`-type turn with a chosen id, as raw bytes.
fn forged_turn(turn_id: &str) -> Result<Vec<u8>> {
    let mut request = turn("acme", json!({"type": "final", "text": FORGED}));
    request.turn_id = Some(turn_id.into());
    Ok(serde_json::to_vec(&request)?)
}

/// A coordinator process on the deploy users with these frontend bindings, answering
/// the catalog.
async fn coordinator_up(
    servers: &SecuredServers,
    bindings: &str,
) -> Result<(tokio::process::Child, u16, FleetClient)> {
    let port = free_port()?;
    let coordinator =
        servers.coordinator_node(port, &[("TOOLFLEET_FRONTEND_TENANTS", bindings)])?;
    let frontend = servers.frontend().await?;
    wait_for_catalog(&frontend, "a coordinator answers", |_| true).await?;
    Ok((coordinator, port, frontend))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_cannot_read_or_submit_as_another_frontend() -> Result<()> {
    let servers = SecuredServers::start().await?;
    let (_coordinator, _, _) = coordinator_up(&servers, "").await?;
    let mut spy = RoleConnection::open(&servers.nats, &frontend_credentials()).await?;
    let mut snooping = spy.client.subscribe("_INBOX_frontend2.>").await?;
    spy.client.flush().await?;
    spy.expect_server_error().await?;

    // Nor may it submit on the other frontend's subject, or the unidentified one.
    for subject in [
        servers.names.turn_submit_as("frontend2"),
        servers.names.turn_submit(),
    ] {
        let reply = spy.client.new_inbox();
        let bytes = forged_turn("impersonated")?;
        spy.client
            .publish_with_reply(subject, reply, bytes.into())
            .await?;
        spy.client.flush().await?;
        spy.expect_server_error().await?;
    }

    // frontend2's own turn reaches frontend2, and nothing of it reaches the spy.
    let victim = servers.frontend_as(&frontend2_credentials()).await?;
    assert_a_turn_runs(&victim).await?;
    assert!(
        silent(snooping.next()).await,
        "a frontend read another frontend's turn"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_outside_the_callers_inbox_are_refused() -> Result<()> {
    let servers = SecuredServers::start().await?;
    let (_coordinator, port, honest) = coordinator_up(&servers, "").await?;
    let attacker = RoleConnection::open(&servers.nats, &frontend_credentials()).await?;
    let victim = RoleConnection::open(&servers.nats, &frontend2_credentials()).await?;
    let victim_inbox = victim.client.new_inbox();
    let mut victim_events = victim.client.subscribe(victim_inbox.clone()).await?;
    victim.client.flush().await?;

    let targets = [
        servers.names.job_subject("crm.getOpenInvoices"),
        victim_inbox,
        "_INBOX_coordinator.forged".to_string(),
    ];
    for (n, target) in targets.iter().enumerate() {
        attacker
            .client
            .publish_with_reply(
                servers.names.turn_submit_as("frontend"),
                target.clone(),
                forged_turn(&format!("forged-{n}"))?.into(),
            )
            .await?;
    }
    attacker.client.flush().await?;
    let code = turn_codes::REPLY_NOT_ALLOWED;
    eventually_named("three refusals counted", EVENT_WAIT, || async {
        let count = refused_turns(port, code).await.ok()?;
        (count >= 3.0).then_some(())
    })
    .await?;
    assert_eq!(refused_turns(port, code).await?, 3.0);
    assert!(
        silent(victim_events.next()).await,
        "a forged final reached another frontend"
    );
    assert_eq!(servers.messages_in(&servers.names.jobs_stream()).await?, 0);

    // The same request with the caller's own inbox runs.
    assert_a_turn_runs(&honest).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_bound_to_a_tenant_cannot_name_another() -> Result<()> {
    let servers = SecuredServers::start().await?;
    let (_coordinator, port, frontend) =
        coordinator_up(&servers, "frontend=t1;frontend2=t2").await?;

    let foreign = turn("t2", json!({"type": "final", "text": "hello"}));
    assert_refused_once(&frontend, foreign, port, turn_codes::TENANT_NOT_ALLOWED).await?;

    // Its own tenant in any spelling runs.
    for spelling in ["t1", "T1", " t1", "t1 "] {
        let own = turn(spelling, json!({"type": "final", "text": "hello"}));
        let last = last_event(&frontend, own).await?;
        assert!(
            matches!(last, TurnEvent::Final(_)),
            "{spelling:?}: {last:?}"
        );
    }
    Ok(())
}
