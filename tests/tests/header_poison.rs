//! A header block that does not parse costs its own message the headers, never the
//! coordinator's NATS connection: turn requests and results carrying each malformed form
//! are still handled, and honest turns running beside them all end with their `final`.
//! The messages are written as raw `HPUB` frames over TCP, as a hostile publisher with
//! publish rights would send them (nats-server forwards header blocks unchecked).

use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::eventually_named;
use toolfleet_tests::fleet::{call, forged_result, read_to_end, tool_calls, turn, Fleet};
use toolfleet_tests::poison::{RawPublisher, POISON};

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_header_blocks_never_cost_the_coordinator_its_connection() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let mut publisher = RawPublisher::connect(fleet.nats.port()).await?;
    let nats = fleet.client.nats();
    let mut replies = nats.subscribe("_INBOX.poison.>").await?;
    nats.flush().await?;

    // Honest turns in flight while the poison arrives.
    let honest_call = || call("c1", "test.behave", json!({"sleep_ms": 300, "value": 1}));
    let mut honest = Vec::new();
    for _ in 0..4 {
        honest.push(
            fleet
                .client
                .submit(turn("acme", tool_calls(vec![honest_call()])))
                .await?,
        );
    }

    // Each poisoned turn request is still a turn: answered on its own reply inbox.
    for (i, header) in POISON.iter().enumerate() {
        let request = turn(
            "acme",
            tool_calls(vec![call("p1", "test.behave", json!({"value": i}))]),
        );
        let mut request = serde_json::to_value(request)?;
        request["turn_id"] = json!(format!("poison-{i}"));
        let reply = format!("_INBOX.poison.{i}");
        publisher
            .hpub(
                &fleet.names.turn_submit(),
                Some(&reply),
                header,
                &serde_json::to_vec(&request)?,
            )
            .await
            .with_context(|| format!("poison {i}"))?;
    }
    let mut finals = std::collections::BTreeSet::new();
    while finals.len() < POISON.len() {
        let message = tokio::time::timeout(EVENT_WAIT, replies.next())
            .await
            .context("a poisoned turn was never answered")?
            .context("subscription closed")?;
        if let TurnEvent::Final(event) = serde_json::from_slice(&message.payload)? {
            assert_eq!(event.results.len(), 1);
            assert_eq!(event.results[0].state, CallState::Done, "{event:?}");
            finals.insert(event.turn_id);
        }
    }

    // A stored result with a malformed header block is taken off the results stream
    // once (acknowledged), not redelivered until its deliveries run out.
    let forged = forged_result("x1", "test.behave", json!(1), "rogue")?;
    for header in POISON {
        publisher
            .hpub(
                &fleet
                    .names
                    .tool_result_subject("no-such-turn", "test.behave"),
                None,
                header,
                &forged,
            )
            .await?;
    }
    let js = async_nats::jetstream::new(nats.clone());
    eventually_named("the poisoned results acknowledged", EVENT_WAIT, || {
        let js = js.clone();
        let stream = fleet.names.results_stream();
        async move {
            let mut stream = js.get_stream(stream).await.ok()?;
            let info = stream.info().await.ok()?;
            (info.state.messages == 0).then_some(())
        }
    })
    .await?;

    for mut stream in honest {
        let events = read_to_end(&mut stream, EVENT_WAIT).await?;
        let last = events.last().context("no events")?;
        assert!(matches!(last, TurnEvent::Final(_)), "{last:?}");
    }
    Ok(())
}
