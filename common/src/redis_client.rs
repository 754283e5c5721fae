//! The one place a Redis connection is made, for every process: one server or a Redis
//! Cluster, chosen by `TOOLFLEET_REDIS_URL`.
//!
//! - `redis://host:6379` (or `rediss://`, `unix://`): one server, through a
//!   `ConnectionManager` that reconnects by itself.
//! - `redis+cluster://host-a:6379,host-b:6379,...` (`rediss+cluster://` over TLS) or a
//!   comma-separated list of `redis://` or `rediss://` URLs: a Redis Cluster, through the
//!   `redis` crate's cluster client, which follows the slot map (`MOVED`, `ASK`, a
//!   failover) by itself. The nodes listed are only where the slot map is first read;
//!   one is enough.
//!
//! `rediss://` is TLS (rustls): the server's certificate is checked against the system's
//! root certificates, or against the CA of `TOOLFLEET_REDIS_CA_FILE` when set
//! ([`RedisOptions::tls`]); `TOOLFLEET_REDIS_CERT_FILE` and `TOOLFLEET_REDIS_KEY_FILE`
//! add a client certificate. With any of those files set, a `redis://` URL is refused.
//!
//! Owns [`RedisConnection`], which implements `redis::aio::ConnectionLike`, so commands,
//! pipelines and scripts are written once for both. A pipeline or script must touch
//! keys of one slot only (share a `{hash tag}`); [`RedisConnection::in_order`] sends two
//! commands of different slots in order, in one round trip where the server allows it.
//! Never decides which keys a process uses (`names.rs` does).

use std::path::Path;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{
    ClientTlsConfig, Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, TlsCertificates, Value,
};

use crate::tls::TlsFiles;

/// The scheme that selects the cluster client for a single address.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";
/// The same over TLS.
pub const CLUSTER_TLS_SCHEME: &str = "rediss+cluster://";

/// What `TOOLFLEET_REDIS_URL` names: one server, or the seed nodes of a cluster.
#[derive(Debug, Clone)]
pub enum RedisTarget {
    /// One Redis server (boxed: with TLS parameters it is far larger than a list).
    Single(Box<ConnectionInfo>),
    /// A Redis Cluster, by some of its nodes.
    Cluster(Vec<ConnectionInfo>),
}

/// A setting that does not name Redis.
#[derive(Debug, thiserror::Error)]
#[error("TOOLFLEET_REDIS_URL {url:?}: {reason}")]
pub struct BadRedisUrl {
    /// The setting as given (its password replaced).
    pub url: String,
    /// What is wrong with it.
    pub reason: String,
}

impl RedisTarget {
    /// Parses the setting: one URL, a `redis+cluster://a,b` URL, or a comma-separated
    /// list of URLs (a cluster).
    pub fn parse(setting: &str) -> Result<Self, BadRedisUrl> {
        let bad = |reason: String| BadRedisUrl {
            url: redact(setting),
            reason,
        };
        let setting = setting.trim();
        if setting.is_empty() {
            return Err(bad("empty".into()));
        }
        let (cluster_scheme, rest) = if let Some(rest) = setting.strip_prefix(CLUSTER_SCHEME) {
            (Some("redis://"), rest)
        } else if let Some(rest) = setting.strip_prefix(CLUSTER_TLS_SCHEME) {
            (Some("rediss://"), rest)
        } else {
            (None, setting)
        };
        let parts: Vec<&str> = rest.split(',').map(str::trim).collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(bad("an empty entry in the list".into()));
        }
        let infos = match cluster_scheme {
            Some(scheme) => {
                // `redis+cluster://user:pass@a:1,b:2/0`: the credentials of the first
                // entry apply to every node.
                let credentials = parts[0]
                    .rsplit_once('@')
                    .map(|(c, _)| format!("{c}@"))
                    .unwrap_or_default();
                parts
                    .iter()
                    .map(|part| {
                        let address = part.rsplit_once('@').map(|(_, a)| a).unwrap_or(part);
                        format!("{scheme}{credentials}{address}")
                            .into_connection_info()
                            .map_err(|e| bad(e.to_string()))
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => parts
                .iter()
                .map(|part| part.into_connection_info().map_err(|e| bad(e.to_string())))
                .collect::<Result<Vec<_>, _>>()?,
        };
        match (cluster_scheme, infos.len()) {
            (None, 1) => Ok(Self::Single(Box::new(
                infos
                    .into_iter()
                    .next()
                    .ok_or_else(|| bad("no address".into()))?,
            ))),
            _ => Ok(Self::Cluster(infos)),
        }
    }

    /// Whether this names a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Whether every server named is reached over TLS (`rediss://`).
    pub fn is_tls(&self) -> bool {
        let nodes = match self {
            Self::Single(info) => std::slice::from_ref(info.as_ref()),
            Self::Cluster(nodes) => nodes.as_slice(),
        };
        nodes
            .iter()
            .all(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }))
    }

    /// The Redis user the setting connects as (empty for the default user).
    pub fn username(&self) -> String {
        let first = match self {
            Self::Single(info) => Some(info.as_ref()),
            Self::Cluster(nodes) => nodes.first(),
        };
        first
            .and_then(|info| info.redis_settings().username())
            .unwrap_or_default()
            .to_string()
    }
}

/// The setting with any password replaced by `***`, for errors and logs.
pub fn redact(setting: &str) -> String {
    setting
        .split(',')
        .map(|part| match part.rsplit_once('@') {
            Some((before, after)) => match before.rsplit_once(':') {
                Some((user, _)) if !user.ends_with('/') => format!("{user}:***@{after}"),
                _ => part.to_string(),
            },
            None => part.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// How a connection behaves.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// How long a reply may take before the command counts as failed; `None` keeps the
    /// client's default.
    pub response_timeout: Option<Duration>,
    /// Root CA and client certificate of a `rediss://` connection (`Endpoints::redis_tls`).
    /// Any file set requires `rediss://`.
    pub tls: TlsFiles,
}

impl RedisOptions {
    /// Default options over TLS with `tls`.
    pub fn with_tls(tls: TlsFiles) -> Self {
        Self {
            tls,
            ..Self::default()
        }
    }
}

/// A connection to one Redis server or to a Redis Cluster. Cheap to clone: clones share
/// the connections.
#[derive(Clone)]
pub enum RedisConnection {
    /// One server; reconnects by itself.
    Single(ConnectionManager),
    /// A Redis Cluster; follows its slot map by itself.
    Cluster(ClusterConnection),
}

/// Failure to connect.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The setting does not name Redis.
    #[error(transparent)]
    Url(#[from] BadRedisUrl),
    /// A TLS file could not be read.
    #[error("redis TLS file {path}: {source}")]
    TlsFile {
        /// The file.
        path: String,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// Redis did not answer.
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
}

impl From<ConnectError> for RedisError {
    fn from(error: ConnectError) -> Self {
        match error {
            ConnectError::Redis(e) => e,
            ConnectError::Url(e) => RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "invalid TOOLFLEET_REDIS_URL",
                e.to_string(),
            )),
            e @ ConnectError::TlsFile { .. } => RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "unreadable Redis TLS file",
                e.to_string(),
            )),
        }
    }
}

/// Connects to what `setting` names (see the module docs), with TCP_NODELAY: without
/// it, a command sent while another's reply is outstanding waits for that reply
/// (Nagle), which serializes concurrent scripts.
pub async fn connect(
    setting: &str,
    options: RedisOptions,
) -> Result<RedisConnection, ConnectError> {
    let nodelay = TcpSettings::default().set_nodelay(true);
    let target = RedisTarget::parse(setting)?;
    let certificates = certificates(&options.tls)?;
    if certificates.is_some() && !target.is_tls() {
        return Err(ConnectError::Url(BadRedisUrl {
            url: redact(setting),
            reason: "a Redis TLS file is set (TOOLFLEET_REDIS_CA_FILE, _CERT_FILE, _KEY_FILE), \
                     so every server must be named rediss:// (or rediss+cluster://)"
                .into(),
        }));
    }
    match target {
        RedisTarget::Single(info) => {
            let info = (*info).set_tcp_settings(nodelay);
            let client = match certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates)?,
                None => redis::Client::open(info)?,
            };
            let mut config = ConnectionManagerConfig::new();
            if let Some(timeout) = options.response_timeout {
                config = config.set_response_timeout(Some(timeout));
            }
            Ok(RedisConnection::Single(
                ConnectionManager::new_with_config(client, config).await?,
            ))
        }
        RedisTarget::Cluster(nodes) => {
            let mut builder = ClusterClientBuilder::new(nodes).tcp_settings(nodelay);
            if let Some(certificates) = certificates {
                builder = builder.certs(certificates);
            }
            if let Some(timeout) = options.response_timeout {
                builder = builder.response_timeout(timeout);
            }
            let client = builder.build()?;
            Ok(RedisConnection::Cluster(
                client.get_async_connection().await?,
            ))
        }
    }
}

/// One attempt to reach what `setting` names, without the retries a connection makes
/// (for one server: connect, authenticate, `PING`; a cluster is left to its client):
/// how a process waiting for Redis at start learns why it cannot reach it.
pub async fn probe(setting: &str, options: &RedisOptions) -> Result<(), ConnectError> {
    let RedisTarget::Single(info) = RedisTarget::parse(setting)? else {
        return Ok(());
    };
    let client = match certificates(&options.tls)? {
        Some(certificates) => redis::Client::build_with_tls(*info, certificates)?,
        None => redis::Client::open(*info)?,
    };
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(PROBE_TIMEOUT))
        .set_response_timeout(Some(PROBE_TIMEOUT));
    let mut connection = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let _: String = redis::cmd("PING").query_async(&mut connection).await?;
    Ok(())
}

/// How long [`probe`] waits for the connection and for the answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The PEM contents of `tls`'s files, `None` when no file is set.
fn certificates(tls: &TlsFiles) -> Result<Option<TlsCertificates>, ConnectError> {
    if !tls.is_set() {
        return Ok(None);
    }
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| ConnectError::TlsFile {
            path: path.display().to_string(),
            source,
        })
    };
    let root_cert = tls.ca_file.as_deref().map(read).transpose()?;
    let client_tls = match &tls.client {
        Some(client) => Some(ClientTlsConfig {
            client_cert: read(&client.cert_file)?,
            client_key: read(&client.key_file)?,
        }),
        None => None,
    };
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

impl RedisConnection {
    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Runs `first`, then `second`, and returns `second`'s reply. On one server both go
    /// in one pipeline (one round trip, run in that order); on a cluster, where they may
    /// live in different slots, `second` is sent once `first` succeeded.
    pub async fn in_order(&mut self, first: Cmd, second: Cmd) -> Result<Value, RedisError> {
        match self {
            Self::Single(_) => {
                let mut pipe = redis::pipe();
                pipe.add_command(first).ignore().add_command(second);
                let (reply,): (Value,) = pipe.query_async(self).await?;
                Ok(reply)
            }
            Self::Cluster(_) => {
                let _: Value = first.query_async(self).await?;
                second.query_async(self).await
            }
        }
    }
}

/// `request`, its time recorded in `toolfleet.redis.duration` when it ends.
fn timed<'a, T: Send + 'a>(request: RedisFuture<'a, T>) -> RedisFuture<'a, T> {
    Box::pin(async move {
        let started = std::time::Instant::now();
        let reply = request.await;
        crate::metrics::redis_command_took(started.elapsed().as_secs_f64());
        reply
    })
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        timed(match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        timed(match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        })
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_url_is_one_server() {
        let target = RedisTarget::parse("redis://127.0.0.1:6379").expect("parses");
        assert!(!target.is_cluster());
    }

    #[test]
    fn a_list_or_the_cluster_scheme_is_a_cluster() {
        let list =
            RedisTarget::parse("redis://127.0.0.1:7000, redis://127.0.0.1:7001").expect("parses");
        let RedisTarget::Cluster(nodes) = list else {
            panic!("a list is a cluster");
        };
        assert_eq!(nodes.len(), 2);
        let scheme = RedisTarget::parse("redis+cluster://u:p@127.0.0.1:7000,127.0.0.1:7001")
            .expect("parses");
        let RedisTarget::Cluster(nodes) = scheme else {
            panic!("redis+cluster:// is a cluster");
        };
        assert_eq!(nodes.len(), 2);
        for node in &nodes {
            assert_eq!(node.redis_settings().password(), Some("p"));
            assert_eq!(node.redis_settings().username(), Some("u"));
        }
        let one = RedisTarget::parse("redis+cluster://127.0.0.1:7000").expect("parses");
        assert!(one.is_cluster());
    }

    #[test]
    fn rediss_is_tls_for_one_server_and_a_cluster() {
        for tls in [
            "rediss://127.0.0.1:6380/",
            "rediss+cluster://u:p@127.0.0.1:7000,127.0.0.1:7001",
            "rediss://127.0.0.1:7000,rediss://127.0.0.1:7001",
        ] {
            assert!(RedisTarget::parse(tls).expect("parses").is_tls(), "{tls}");
        }
        for plain in [
            "redis://127.0.0.1:6379/",
            "redis+cluster://127.0.0.1:7000",
            "rediss://127.0.0.1:7000,redis://127.0.0.1:7001",
        ] {
            assert!(
                !RedisTarget::parse(plain).expect("parses").is_tls(),
                "{plain}"
            );
        }
    }

    #[tokio::test]
    async fn tls_files_refuse_a_plain_url_without_its_password() {
        let dir = std::env::temp_dir().join(format!("toolfleet-rtls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, "not used").expect("written");
        let options = RedisOptions::with_tls(TlsFiles::trusting(&ca));
        let refused = connect("redis://u:hunter2@127.0.0.1:1/", options).await;
        std::fs::remove_dir_all(&dir).ok();
        let Err(ConnectError::Url(error)) = refused else {
            panic!("a plain URL with a CA file is refused before connecting");
        };
        assert!(!error.url.contains("hunter2"));
        let missing = RedisOptions::with_tls(TlsFiles::trusting(dir.join("gone.pem")));
        let unreadable = connect("rediss://127.0.0.1:1/", missing).await;
        assert!(matches!(unreadable, Err(ConnectError::TlsFile { .. })));
    }

    #[test]
    fn bad_settings_are_refused_without_their_password() {
        for bad in [
            "",
            "redis://a:1,,redis://b:2",
            "http://x:1",
            "redis+cluster://",
        ] {
            assert!(RedisTarget::parse(bad).is_err(), "{bad:?} is refused");
        }
        let error = RedisTarget::parse("redis://u:secret@a:1,http://b").expect_err("refused");
        assert!(!error.to_string().contains("secret"));
    }
}
