//! Where a process finds the fleet: the default URLs, the prefix, and [`Endpoints`]
//! (NATS, credentials, Redis, their TLS files, prefix), which the coordinator's, worker's
//! and gateway's configs start from. The `env_*` readers and [`ConfigError`] live in
//! [`crate::env`] (below credentials, TLS and streams, which read their own variables)
//! and are re-exported here for the configs that read both.
//!
//! Also owns the settings coordinator and worker both read, with the same variable and
//! range ([`shutdown_grace_from_env`], [`topology_check_from_env`]), and the tool
//! consumers' [`ACK_WAIT_MS`] range, which either may set: the two cannot disagree.
//!
//! Never holds a process's own settings (each config module does) and never reads a
//! file.

pub use crate::env::{env_in, env_ms, env_ms_in, env_or, env_string, in_range, ConfigError};

/// Ack wait of the tool consumers, in ms, whichever process sets it.
pub const ACK_WAIT_MS: std::ops::RangeInclusive<u64> = 500..=600_000;

/// Shutdown grace, in ms (0: stop at once).
pub const SHUTDOWN_GRACE_MS: std::ops::RangeInclusive<u64> = 0..=600_000;
/// Topology checks, in ms.
pub const TOPOLOGY_CHECK_MS: std::ops::RangeInclusive<u64> = 100..=60_000;

/// `TOOLFLEET_SHUTDOWN_GRACE_MS`: how long a stopping process waits for the work it has
/// in flight.
pub fn shutdown_grace_from_env(
    default: std::time::Duration,
) -> Result<std::time::Duration, ConfigError> {
    env_ms_in("TOOLFLEET_SHUTDOWN_GRACE_MS", default, SHUTDOWN_GRACE_MS)
}

/// `TOOLFLEET_TOPOLOGY_CHECK_MS`: how often a process checks the JetStream objects it
/// relies on.
pub fn topology_check_from_env(
    default: std::time::Duration,
) -> Result<std::time::Duration, ConfigError> {
    env_ms_in("TOOLFLEET_TOPOLOGY_CHECK_MS", default, TOPOLOGY_CHECK_MS)
}

/// Default NATS URL.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// Default Redis URL.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379/";

/// Where a process finds the fleet: NATS (with its role's credentials), Redis, and the
/// prefix of every subject and key. The coordinator and worker configs start from it.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// NATS URL (`TOOLFLEET_NATS_URL`).
    pub nats_url: String,
    /// NATS user, password, inbox prefix and TLS files (`TOOLFLEET_NATS_USER`,
    /// `TOOLFLEET_NATS_PASSWORD`, `TOOLFLEET_NATS_INBOX_PREFIX`, `TOOLFLEET_NATS_CA_FILE`,
    /// `TOOLFLEET_NATS_CERT_FILE`, `TOOLFLEET_NATS_KEY_FILE`).
    pub nats_credentials: crate::credentials::NatsCredentials,
    /// Redis URL (`TOOLFLEET_REDIS_URL`).
    pub redis_url: String,
    /// Redis TLS files (`TOOLFLEET_REDIS_CA_FILE`, `TOOLFLEET_REDIS_CERT_FILE`,
    /// `TOOLFLEET_REDIS_KEY_FILE`); any of them requires a `rediss://` URL.
    pub redis_tls: crate::tls::TlsFiles,
    /// Subject and key prefix (`TOOLFLEET_PREFIX`).
    pub prefix: String,
    /// Pairs of jobs and results streams the turns are spread over
    /// (`TOOLFLEET_STREAM_PARTITIONS`, 1 to 64, default 1); the same in every process
    /// of a fleet.
    pub stream_partitions: u32,
}

impl Endpoints {
    /// Local servers, no credentials, the default prefix.
    pub fn local() -> Self {
        Self {
            nats_url: DEFAULT_NATS_URL.to_string(),
            nats_credentials: crate::credentials::NatsCredentials::none(),
            redis_url: DEFAULT_REDIS_URL.to_string(),
            redis_tls: crate::tls::TlsFiles::none(),
            prefix: crate::names::DEFAULT_PREFIX.to_string(),
            stream_partitions: 1,
        }
    }

    /// The names of every subject, stream and key of the fleet these endpoints reach.
    pub fn names(&self) -> crate::Names {
        crate::Names::new(self.prefix.clone()).with_partitions(self.stream_partitions)
    }

    /// Reads the endpoints from the environment, [`Endpoints::local`] where unset.
    pub fn from_env() -> Result<Self, ConfigError> {
        let d = Self::local();
        // Read where the streams are made; refused here so a bad value stops the start.
        env_in(
            crate::streams::STREAM_REPLICAS_ENV,
            1,
            crate::streams::STREAM_REPLICAS_RANGE,
        )?;
        crate::streams::parse_storage(&env_string(crate::streams::STREAM_STORAGE_ENV, "file"))?;
        Ok(Self {
            nats_url: env_string("TOOLFLEET_NATS_URL", &d.nats_url),
            nats_credentials: crate::credentials::NatsCredentials::from_env()?,
            redis_url: env_string("TOOLFLEET_REDIS_URL", &d.redis_url),
            redis_tls: crate::tls::TlsFiles::from_env(&crate::tls::REDIS_TLS)?,
            prefix: prefix_token(env_string(PREFIX_ENV, &d.prefix))?,
            stream_partitions: env_in(
                crate::streams::STREAM_PARTITIONS_ENV,
                d.stream_partitions,
                crate::streams::STREAM_PARTITIONS_RANGE,
            )?,
        })
    }
}

/// The variable naming the prefix of every subject and key.
pub const PREFIX_ENV: &str = "TOOLFLEET_PREFIX";

/// `prefix` when it is one NATS subject token that is also safe in a Redis Cluster key:
/// not empty, no `.` (it would split the token), no wildcard (`*`, `>`), no whitespace or
/// control character, no `{`/`}` (they would change which slot a key's hash tag names).
pub fn prefix_token(prefix: String) -> Result<String, ConfigError> {
    let refuse = |reason: &str| ConfigError {
        name: PREFIX_ENV.to_string(),
        value: prefix.clone(),
        reason: reason.to_string(),
    };
    if prefix.is_empty() {
        return Err(refuse("empty: one NATS subject token such as `fleet`"));
    }
    if let Some(c) = prefix
        .chars()
        .find(|c| matches!(c, '.' | '*' | '>' | '{' | '}') || c.is_whitespace() || c.is_control())
    {
        return Err(refuse(&format!(
            "{c:?} is not allowed: one NATS subject token such as `fleet` (no `.`, `*`, `>`, \
             braces or spaces)"
        )));
    }
    Ok(prefix)
}

/// The NATS servers of `TOOLFLEET_NATS_URL`: one URL or a comma-separated list
/// (`nats://a:4222,nats://b:4222,...`), any of which may be connected to; the client
/// also learns the cluster's other servers from the one it reaches and fails over to
/// them. Pass it wherever `async_nats` takes server addresses.
#[derive(Debug, Clone, Copy)]
pub struct NatsUrls<'a>(pub &'a str);

impl async_nats::ToServerAddrs for NatsUrls<'_> {
    type Iter = std::vec::IntoIter<async_nats::ServerAddr>;

    fn to_server_addrs(&self) -> std::io::Result<Self::Iter> {
        let servers = self
            .0
            .split(',')
            .map(str::trim)
            .filter(|part| !part.is_empty())
            .map(str::parse::<async_nats::ServerAddr>)
            .collect::<std::io::Result<Vec<_>>>()?;
        if servers.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "TOOLFLEET_NATS_URL names no server",
            ));
        }
        Ok(servers.into_iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_one_subject_token() {
        assert_eq!(
            prefix_token("fleet-2".into()).ok().as_deref(),
            Some("fleet-2")
        );
        for bad in ["a.b", "", "fl*", "a>", "a b", "{x}"] {
            let refused = prefix_token(bad.into()).expect_err(bad);
            assert_eq!(refused.name, PREFIX_ENV);
            assert_eq!(refused.value, bad);
        }
    }

    #[test]
    fn nats_urls_take_one_server_or_a_list() {
        use async_nats::ToServerAddrs;
        let one = NatsUrls("nats://127.0.0.1:4222")
            .to_server_addrs()
            .expect("parses");
        assert_eq!(one.count(), 1);
        let three = NatsUrls("nats://127.0.0.1:4222, nats://127.0.0.1:4223,nats://127.0.0.1:4224")
            .to_server_addrs()
            .expect("parses");
        assert_eq!(three.count(), 3);
        assert!(NatsUrls("").to_server_addrs().is_err());
        assert!(NatsUrls("nats://a:1,http://[::").to_server_addrs().is_err());
    }
}
