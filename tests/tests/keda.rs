//! KEDA's nats-jetstream scaler against the deployment's own NATS accounts: a
//! nats-server on `deploy/nats/auth.conf` with its monitoring port, a coordinator and a
//! demo worker on their users, and every trigger of `deploy/k8s/worker-scaledobject.yaml`
//! looked up on `/jsz` as the scaler does (kedacore/keda,
//! pkg/scalers/nats_jetstream_scaler.go): `GET /jsz?acc=<account>&consumers=true&config=true`,
//! the account's `account_details` entry by name, its stream by name, the stream's
//! consumer by name, and the lag `num_pending + num_ack_pending`.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use toolfleet_common::Names;
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_packs as packs;
use toolfleet_tests::fleet::{coordinator_settings, worker_settings, Running};
use toolfleet_tests::secured::{
    apply_redis_acl, coordinator_credentials, nats_auth_config, worker_credentials, RoleConnection,
};
use toolfleet_tests::{eventually_named, free_port, read_repo_file, NatsServer, RedisServer};
use toolfleet_worker::WorkerConfig;

/// How long the coordinator may take to create the streams and every tool's consumer.
const TOPOLOGY_WAIT: Duration = Duration::from_secs(30);

/// One `nats-jetstream` trigger's lookup keys.
#[derive(Debug)]
struct Trigger {
    account: String,
    stream: String,
    consumer: String,
}

/// The `nats-jetstream` triggers of the worker's ScaledObject.
fn triggers() -> Result<Vec<Trigger>> {
    let text = read_repo_file("deploy/k8s/worker-scaledobject.yaml")?;
    let scaled: serde_norway::Value = serde_norway::from_str(&text)?;
    let list = scaled["spec"]["triggers"]
        .as_sequence()
        .context("no triggers")?;
    let field = |trigger: &serde_norway::Value, key: &str| {
        trigger["metadata"][key]
            .as_str()
            .map(String::from)
            .with_context(|| format!("a trigger without {key}"))
    };
    list.iter()
        .filter(|t| t["type"].as_str() == Some("nats-jetstream"))
        .map(|t| {
            Ok(Trigger {
                account: field(t, "account")?,
                stream: field(t, "stream")?,
                consumer: field(t, "consumer")?,
            })
        })
        .collect()
}

/// `/jsz` as the scaler asks for it, on the monitoring port `port`.
async fn jsz(port: u16, account: &str) -> Result<Value> {
    let url = format!("http://127.0.0.1:{port}/jsz?acc={account}&consumers=true&config=true");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    Ok(client
        .get(&url)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

/// The scaler's reading of `trigger` from its `/jsz` answer: the lag it scales on, or
/// what it does not find. (Where the consumer is missing the scaler falls back to the
/// stream's last sequence, a lag that never drains: counted as not found here.)
fn keda_lag(jsz: &Value, trigger: &Trigger) -> Result<u64, String> {
    let account = named(&jsz["account_details"], "account", &trigger.account)?;
    let stream = named(&account["stream_detail"], "stream", &trigger.stream)?;
    let consumer = named(&stream["consumer_detail"], "consumer", &trigger.consumer)?;
    let count = |key: &str| consumer[key].as_u64().unwrap_or(0);
    Ok(count("num_pending") + count("num_ack_pending"))
}

/// The entry of the `/jsz` list `list` (an account's, a stream's or a consumer's)
/// whose `name` is `name`; `what` names the kind in the error. A missing list reads as
/// an empty one, as the scaler reads it.
fn named<'a>(list: &'a Value, what: &str, name: &str) -> Result<&'a Value, String> {
    list.as_array()
        .into_iter()
        .flatten()
        .find(|entry| entry["name"] == name)
        .ok_or_else(|| format!("{what} {name} not found"))
}

/// Every trigger's lag from the server's `/jsz`, in trigger order.
async fn lags(port: u16, triggers: &[Trigger]) -> Result<Vec<Result<u64, String>>> {
    let mut lags = Vec::new();
    for trigger in triggers {
        lags.push(keda_lag(&jsz(port, &trigger.account).await?, trigger));
    }
    Ok(lags)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_finds_every_triggers_account_stream_and_consumer_and_reads_its_lag() -> Result<()> {
    toolfleet_tests::init_test_tracing();
    let triggers = triggers()?;
    assert!(!triggers.is_empty());
    let monitoring = free_port()?;
    // `http:` is the configuration form of `nats-server -m`, bound to the loopback.
    let config = format!(
        "http: \"127.0.0.1:{monitoring}\"\n\n{}",
        nats_auth_config()?
    );
    let nats = NatsServer::start_with_config(&config).await?;
    let redis = RedisServer::start().await?;
    let roles = apply_redis_acl(&redis).await?;
    let names = Names::default();
    let coordinator = Running::coordinator(CoordinatorConfig {
        nats_credentials: coordinator_credentials(),
        ..coordinator_settings(nats.url(), roles.coordinator.clone(), &names)
    });
    let tools = packs::tools_for(&["demo"]).map_err(anyhow::Error::msg)?;
    let tool_names: Vec<String> = tools.iter().map(|t| t.definition().name.clone()).collect();
    let worker = Running::worker(
        WorkerConfig {
            nats_credentials: worker_credentials(),
            consumers: toolfleet_worker::ConsumerMode::Bind,
            ..worker_settings(nats.url(), roles.worker.clone(), &names)
        },
        tools,
    );

    // The coordinator creates the streams and, from the registry the worker fills,
    // every tool's consumer: each trigger is then found, with nothing waiting.
    let found = eventually_named("every trigger found on /jsz", TOPOLOGY_WAIT, || async {
        let lags = lags(monitoring, &triggers).await.ok()?;
        lags.iter().all(|l| l == &Ok(0)).then_some(())
    });
    if found.await.is_err() {
        let seen = lags(monitoring, &triggers).await?;
        anyhow::bail!("the scaler's lookups: {seen:?}");
    }
    // The global account holds nothing of the fleet's: a trigger naming it finds no
    // stream, and KEDA reports an error instead of a lag.
    for trigger in &triggers {
        let global = Trigger {
            account: "$G".into(),
            stream: trigger.stream.clone(),
            consumer: trigger.consumer.clone(),
        };
        assert!(keda_lag(&jsz(monitoring, "$G").await?, &global).is_err());
    }

    // With the worker gone, a job for the first trigger's tool is its lag, and only
    // its.
    worker.stop().await;
    let first = &triggers[0];
    let tool = tool_names
        .iter()
        .find(|t| names.tool_consumer(t) == first.consumer)
        .context("the first trigger's consumer is no demo tool's")?;
    let publisher = RoleConnection::open(&nats, &coordinator_credentials()).await?;
    publisher
        .jetstream()
        .publish(names.job_subject(tool), "{}".into())
        .await?
        .await?;
    let expected: Vec<Result<u64, String>> =
        (0..triggers.len()).map(|i| Ok(u64::from(i == 0))).collect();
    let waiting = eventually_named("the job counted as lag", TOPOLOGY_WAIT, || async {
        let seen = lags(monitoring, &triggers).await.ok()?;
        (seen == expected).then_some(())
    });
    waiting.await?;
    coordinator.stop().await;
    Ok(())
}
