//! Servers configured from `deploy/`: a `nats-server` running `deploy/nats/auth.conf`
//! with its password variables defined, a `redis-server` with the users of
//! `deploy/redis/users.acl`, and a connection per role that reports the server's
//! permission errors. Shared by the credential and isolation tests.

use anyhow::{Context, Result};
use async_nats::jetstream;
use tokio::sync::mpsc;
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::streams::ensure_streams;
use toolfleet_common::{FleetClient, Names, TurnEvent, TurnRequest};
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_packs as packs;
use toolfleet_worker::WorkerConfig;

use crate::fleet::{coordinator_settings, worker_settings, Running};
use crate::{read_repo_file, NatsServer, RedisServer};
use std::time::Duration;

pub const COORDINATOR_PASSWORD: &str = "coordinator-test-password";
pub const WORKER_PASSWORD: &str = "worker-test-password";
pub const FRONTEND_PASSWORD: &str = "frontend-test-password";
pub const FRONTEND2_PASSWORD: &str = "frontend2-test-password";
pub const GATEWAY_PASSWORD: &str = "gateway-test-password";

/// How long a test waits for a server's permissions error.
pub const ERROR_WAIT: Duration = Duration::from_secs(5);
/// How long a test waits to be sure a message does not arrive.
pub const SILENCE: Duration = Duration::from_millis(1500);

/// Whether `heard` (a next message, an error from the server) stays unfinished for
/// [`SILENCE`]: nothing arrived.
pub async fn silent<T>(heard: impl std::future::Future<Output = T>) -> bool {
    tokio::time::timeout(SILENCE, heard).await.is_err()
}
/// How long a JetStream request may take before it counts as refused.
pub const JS_TIMEOUT: Duration = Duration::from_secs(1);
pub const EVENT_WAIT: Duration = Duration::from_secs(10);

pub fn deploy_file(path: &str) -> Result<String> {
    read_repo_file(&format!("deploy/{path}"))
}

/// `deploy/nats/auth.conf` with its password variables defined.
pub fn nats_auth_config() -> Result<String> {
    Ok(format!(
        "TOOLFLEET_NATS_COORDINATOR_PASSWORD: \"{COORDINATOR_PASSWORD}\"\n\
         TOOLFLEET_NATS_WORKER_PASSWORD: \"{WORKER_PASSWORD}\"\n\
         TOOLFLEET_NATS_FRONTEND_PASSWORD: \"{FRONTEND_PASSWORD}\"\n\
         TOOLFLEET_NATS_FRONTEND2_PASSWORD: \"{FRONTEND2_PASSWORD}\"\n\
         TOOLFLEET_NATS_GATEWAY_PASSWORD: \"{GATEWAY_PASSWORD}\"\n\n{}",
        deploy_file("nats/auth.conf")?
    ))
}

pub fn coordinator_credentials() -> NatsCredentials {
    NatsCredentials::user_and_password("coordinator", COORDINATOR_PASSWORD)
}

/// Where the worker user (account `WORKERS`) reaches the streams' JetStream API.
pub const WORKER_JS_API_PREFIX: &str = "JS.FLEET.API";

pub fn worker_credentials() -> NatsCredentials {
    NatsCredentials::user_and_password("worker", WORKER_PASSWORD)
        .with_js_api_prefix(WORKER_JS_API_PREFIX)
}

pub fn frontend_credentials() -> NatsCredentials {
    NatsCredentials::user_and_password("frontend", FRONTEND_PASSWORD)
}

/// The HTTP gateway's user of `deploy/nats/auth.conf`.
pub fn gateway_credentials() -> NatsCredentials {
    NatsCredentials::user_and_password("gateway", GATEWAY_PASSWORD)
}

/// The second frontend user of `deploy/nats/auth.conf`.
pub fn frontend2_credentials() -> NatsCredentials {
    NatsCredentials::user_and_password("frontend2", FRONTEND2_PASSWORD)
}

/// A connection as one role, with the server errors it receives.
pub struct RoleConnection {
    pub client: async_nats::Client,
    credentials: NatsCredentials,
    server_errors: mpsc::UnboundedReceiver<async_nats::ServerError>,
}

impl RoleConnection {
    pub async fn open(nats: &NatsServer, credentials: &NatsCredentials) -> Result<Self> {
        let (tx, server_errors) = mpsc::unbounded_channel();
        let options = credentials.apply(async_nats::ConnectOptions::new().event_callback(
            move |event| {
                let tx = tx.clone();
                async move {
                    if let async_nats::Event::ServerError(error) = event {
                        let _ = tx.send(error);
                    }
                }
            },
        ));
        let client = tokio::time::timeout(EVENT_WAIT, options.connect(nats.url()))
            .await
            .context("connect timed out")??;
        Ok(Self {
            client,
            credentials: credentials.clone(),
            server_errors,
        })
    }

    /// Waits (bounded) for the server to report an error to this connection.
    pub async fn expect_server_error(&mut self) -> Result<async_nats::ServerError> {
        tokio::time::timeout(ERROR_WAIT, self.server_errors.recv())
            .await
            .context("no permissions error from the server")?
            .context("event channel closed")
    }

    pub fn jetstream(&self) -> jetstream::Context {
        let mut js = self.credentials.jetstream(self.client.clone());
        js.set_timeout(JS_TIMEOUT);
        js
    }
}

/// The Redis URLs of the roles `deploy/redis/users.acl` defines.
pub struct RedisRoles {
    /// The coordinators' user (`toolfleet`).
    pub coordinator: String,
    /// The demo pack's workers' user (`worker`).
    pub worker: String,
}

/// The rules of one `users.acl` line after the user name, a selector `( … )` kept as
/// one rule.
fn acl_rules(words: &str) -> Vec<String> {
    let mut rules = Vec::new();
    let mut selector: Option<String> = None;
    for word in words.split_whitespace() {
        match selector.as_mut() {
            Some(open) => {
                open.push(' ');
                open.push_str(word);
            }
            None if word.starts_with('(') => selector = Some(word.to_string()),
            None => rules.push(word.to_string()),
        }
        if selector.as_ref().is_some_and(|s| s.ends_with(')')) {
            rules.extend(selector.take());
        }
    }
    rules
}

/// Loads the users of `deploy/redis/users.acl` into `redis` (`ACL SETUSER`) and returns
/// the URLs of the fleet's roles.
pub async fn apply_redis_acl(redis: &RedisServer) -> Result<RedisRoles> {
    let mut conn = redis.client()?.get_multiplexed_async_connection().await?;
    let mut urls = std::collections::HashMap::new();
    for line in deploy_file("redis/users.acl")?.lines() {
        let Some(rest) = line.strip_prefix("user ") else {
            continue;
        };
        let Some((user, words)) = rest.split_once(' ') else {
            continue;
        };
        if user == "default" {
            continue;
        }
        let rules = acl_rules(words);
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(user)
            .arg(&rules)
            .query_async(&mut conn)
            .await?;
        if let Some(password) = rules.iter().find_map(|r| r.strip_prefix('>')) {
            let url = format!("redis://{user}:{password}@127.0.0.1:{}/", redis.port());
            urls.insert(user.to_string(), url);
        }
    }
    Ok(RedisRoles {
        coordinator: urls
            .remove("toolfleet")
            .context("users.acl has no toolfleet user")?,
        worker: urls
            .remove("worker")
            .context("users.acl has no worker user")?,
    })
}

/// Servers with per-role users; the streams exist (created by the coordinator user).
pub struct SecuredServers {
    pub nats: NatsServer,
    pub redis: RedisServer,
    /// The coordinators' Redis URL.
    pub redis_url: String,
    /// The demo workers' Redis URL.
    pub worker_redis_url: String,
    pub names: Names,
}

impl SecuredServers {
    pub async fn start() -> Result<Self> {
        crate::init_test_tracing();
        let nats = NatsServer::start_with_config(&nats_auth_config()?).await?;
        let redis = RedisServer::start().await?;
        let roles = apply_redis_acl(&redis).await?;
        let names = Names::default();
        let coordinator = RoleConnection::open(&nats, &coordinator_credentials()).await?;
        ensure_streams(&coordinator.jetstream(), &names).await?;
        Ok(Self {
            nats,
            redis,
            redis_url: roles.coordinator,
            worker_redis_url: roles.worker,
            names,
        })
    }

    pub async fn messages_in(&self, stream: &str) -> Result<u64> {
        let coordinator = RoleConnection::open(&self.nats, &coordinator_credentials()).await?;
        let mut stream = coordinator.jetstream().get_stream(stream).await?;
        Ok(stream.info().await?.state.messages)
    }

    /// A coordinator on the coordinator user, serving HTTP on `http_port`.
    pub fn coordinator(&self, http_port: u16) -> Running {
        Running::coordinator(self.coordinator_config(http_port))
    }

    /// The settings of [`SecuredServers::coordinator`], to change before starting one.
    pub fn coordinator_config(&self, http_port: u16) -> CoordinatorConfig {
        CoordinatorConfig {
            http_addr: Some(loopback(http_port)),
            nats_credentials: coordinator_credentials(),
            ..coordinator_settings(self.nats.url(), self.redis_url.clone(), &self.names)
        }
    }

    /// A worker with the demo pack on the worker user, serving HTTP on `http_port`.
    pub fn demo_worker(&self, http_port: u16) -> Result<Running> {
        let config = WorkerConfig {
            http_addr: Some(loopback(http_port)),
            nats_credentials: worker_credentials(),
            // The worker user may not create consumers: the coordinator does.
            consumers: toolfleet_worker::ConsumerMode::Bind,
            ..worker_settings(self.nats.url(), self.worker_redis_url.clone(), &self.names)
        };
        let tools = packs::tools_for(&["demo"]).map_err(anyhow::Error::msg)?;
        Ok(Running::worker(config, tools))
    }

    pub async fn frontend(&self) -> Result<FleetClient> {
        self.frontend_as(&frontend_credentials()).await
    }

    /// A coordinator process (`fleet-node coordinator`, so it exports metrics) on the
    /// coordinator user, serving HTTP on `http_port`, with `extra` environment. Killed
    /// when the handle drops.
    pub fn coordinator_node(
        &self,
        http_port: u16,
        extra: &[(&str, &str)],
    ) -> Result<tokio::process::Child> {
        let mut cmd = tokio::process::Command::new(crate::fleet::fleet_node_path()?);
        cmd.arg("coordinator")
            .env("TOOLFLEET_NATS_URL", self.nats.url())
            .env("TOOLFLEET_NATS_USER", "coordinator")
            .env("TOOLFLEET_NATS_PASSWORD", COORDINATOR_PASSWORD)
            .env("TOOLFLEET_REDIS_URL", &self.redis_url)
            .env("TOOLFLEET_PREFIX", self.names.prefix())
            .env("TOOLFLEET_HTTP_ADDR", format!("127.0.0.1:{http_port}"))
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true);
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd.spawn().context("spawning fleet-node coordinator")
    }

    /// A frontend client on `credentials`.
    pub async fn frontend_as(&self, credentials: &NatsCredentials) -> Result<FleetClient> {
        Ok(FleetClient::connect_with(&self.nats.url(), self.names.prefix(), credentials).await?)
    }
}

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

/// The count of turn requests the coordinator serving HTTP on `port` refused with
/// `code` (0 before its first).
pub async fn refused_turns(port: u16, code: &str) -> Result<f64> {
    let (_, text) = crate::http_get(port, "/metrics").await?;
    let label = format!("code=\"{code}\"");
    Ok(crate::metric_value(&text, "toolfleet_turns_refused_total", &[&label]).unwrap_or(0.0))
}

/// Runs `request` on `frontend` to its end (each event within [`EVENT_WAIT`]): its last
/// event.
pub async fn last_event(frontend: &FleetClient, request: TurnRequest) -> Result<TurnEvent> {
    let mut stream = frontend.submit(request).await?;
    let events = crate::fleet::read_to_end(&mut stream, EVENT_WAIT).await?;
    events.last().cloned().context("no event")
}

/// Asserts that `request` on `frontend` ends in a turn-level `code` error that a retry
/// cannot change, and that the coordinator serving HTTP on `port` counted it as its
/// first refusal with that code.
pub async fn assert_refused_once(
    frontend: &FleetClient,
    request: TurnRequest,
    port: u16,
    code: &str,
) -> Result<()> {
    match last_event(frontend, request).await? {
        TurnEvent::Error { error, .. } => {
            assert_eq!(error.code, code);
            assert!(!error.retryable);
        }
        other => anyhow::bail!("the turn was not refused with `{code}`: {other:?}"),
    }
    assert_eq!(refused_turns(port, code).await?, 1.0);
    Ok(())
}

/// Asserts that an `acme` turn answered at once ("hello") runs to its final for
/// `frontend`: what a caller that breaks no rule still gets.
pub async fn assert_a_turn_runs(frontend: &FleetClient) -> Result<()> {
    let request = crate::fleet::turn(
        "acme",
        serde_json::json!({"type": "final", "text": "hello"}),
    );
    assert!(matches!(
        last_event(frontend, request).await?,
        TurnEvent::Final(_)
    ));
    Ok(())
}
