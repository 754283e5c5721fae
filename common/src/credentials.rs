//! NATS credentials of one role: user, password, the inbox prefix its replies use, and
//! the TLS files of the connection.
//!
//! A server with per-role users (`deploy/nats/auth.conf`) lets each user subscribe only
//! to its own inbox prefix, `_INBOX_<user>`, so one role cannot read another's replies.
//! Without a user nothing changes: no credentials are sent and inboxes start `_INBOX`.
//!
//! A user may reach the streams from another NATS account (`deploy/nats/auth.conf` puts
//! workers in `WORKERS`, the streams in `FLEET`): its JetStream API then lives under the
//! prefix its account imports it at (`TOOLFLEET_NATS_JS_API_PREFIX`, e.g.
//! `JS.FLEET.API`), and [`NatsCredentials::jetstream`] opens the context there.
//!
//! Every process builds its NATS connect options with [`NatsCredentials::apply`], so TLS
//! (`TOOLFLEET_NATS_CA_FILE`, `TOOLFLEET_NATS_CERT_FILE`, `TOOLFLEET_NATS_KEY_FILE`, see
//! `tls.rs`, or a `tls://` URL) is turned on in one place for all of them.

use std::fmt;

use crate::env::{env_string, ConfigError};
use crate::tls::{TlsFiles, NATS_TLS};

/// The inbox prefix of clients without a user.
pub const DEFAULT_INBOX_PREFIX: &str = "_INBOX";

/// How one process connects and authenticates to NATS.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NatsCredentials {
    /// User name (`TOOLFLEET_NATS_USER`).
    pub user: Option<String>,
    /// Password (`TOOLFLEET_NATS_PASSWORD`).
    pub password: Option<String>,
    /// Inbox prefix (`TOOLFLEET_NATS_INBOX_PREFIX`); see [`NatsCredentials::inbox_prefix`].
    pub inbox_prefix: Option<String>,
    /// Where this user reaches the JetStream API (`TOOLFLEET_NATS_JS_API_PREFIX`);
    /// `$JS.API` when unset.
    pub js_api_prefix: Option<String>,
    /// Root CA and client certificate (`TOOLFLEET_NATS_CA_FILE`,
    /// `TOOLFLEET_NATS_CERT_FILE`, `TOOLFLEET_NATS_KEY_FILE`); any of them makes TLS
    /// required.
    pub tls: TlsFiles,
}

impl fmt::Debug for NatsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsCredentials")
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("inbox_prefix", &self.inbox_prefix())
            .field("js_api_prefix", &self.js_api_prefix)
            .field("tls", &self.tls)
            .finish()
    }
}

impl NatsCredentials {
    /// No credentials.
    pub fn none() -> Self {
        Self::default()
    }

    /// `user` with `password`, replies on `_INBOX_<user>`.
    pub fn user_and_password(user: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            user: Some(user.into()),
            password: Some(password.into()),
            inbox_prefix: None,
            js_api_prefix: None,
            tls: TlsFiles::none(),
        }
    }

    /// These credentials reaching the JetStream API under `prefix`.
    pub fn with_js_api_prefix(self, prefix: impl Into<String>) -> Self {
        Self {
            js_api_prefix: Some(prefix.into()),
            ..self
        }
    }

    /// These credentials over TLS with `tls`.
    pub fn with_tls(self, tls: TlsFiles) -> Self {
        Self { tls, ..self }
    }

    /// Reads `TOOLFLEET_NATS_USER`, `TOOLFLEET_NATS_PASSWORD`,
    /// `TOOLFLEET_NATS_INBOX_PREFIX`, `TOOLFLEET_NATS_JS_API_PREFIX` and the TLS files
    /// (`tls.rs`). A user without a password (or the reverse) is an error, and so is an
    /// inbox or API prefix that is not a plain subject, a TLS file that does not exist, or a client certificate without its
    /// key (or the reverse).
    pub fn from_env() -> Result<Self, ConfigError> {
        let read = |name: &str| Some(env_string(name, "")).filter(|v| !v.is_empty());
        let credentials = Self {
            user: read("TOOLFLEET_NATS_USER"),
            password: read("TOOLFLEET_NATS_PASSWORD"),
            inbox_prefix: read("TOOLFLEET_NATS_INBOX_PREFIX"),
            js_api_prefix: read("TOOLFLEET_NATS_JS_API_PREFIX"),
            tls: TlsFiles::from_env(&NATS_TLS)?,
        };
        match (&credentials.user, &credentials.password) {
            (Some(_), None) => {
                return Err(ConfigError {
                    name: "TOOLFLEET_NATS_PASSWORD".into(),
                    value: String::new(),
                    reason: "TOOLFLEET_NATS_USER is set, so a password is required".into(),
                })
            }
            (None, Some(_)) => {
                return Err(ConfigError {
                    name: "TOOLFLEET_NATS_USER".into(),
                    value: String::new(),
                    reason: "TOOLFLEET_NATS_PASSWORD is set, so a user is required".into(),
                })
            }
            _ => {}
        }
        if let Some(user) = &credentials.user {
            if user.contains('.') || !valid_prefix(user) {
                return Err(ConfigError {
                    name: "TOOLFLEET_NATS_USER".into(),
                    value: user.clone(),
                    reason: "must be one subject token (it names the user's subjects)".into(),
                });
            }
        }
        for (name, prefix) in [
            ("TOOLFLEET_NATS_INBOX_PREFIX", &credentials.inbox_prefix),
            ("TOOLFLEET_NATS_JS_API_PREFIX", &credentials.js_api_prefix),
        ] {
            if let Some(prefix) = prefix.as_ref().filter(|p| !valid_prefix(p)) {
                return Err(ConfigError {
                    name: name.into(),
                    value: prefix.clone(),
                    reason: "must be a subject without wildcards or empty tokens".into(),
                });
            }
        }
        Ok(credentials)
    }

    /// The inbox prefix in use: the configured one, else `_INBOX_<user>` when a user is
    /// set, else [`DEFAULT_INBOX_PREFIX`].
    pub fn inbox_prefix(&self) -> String {
        match (&self.inbox_prefix, &self.user) {
            (Some(prefix), _) => prefix.clone(),
            (None, Some(user)) => format!("{DEFAULT_INBOX_PREFIX}_{user}"),
            (None, None) => DEFAULT_INBOX_PREFIX.to_string(),
        }
    }

    /// A JetStream context on `client` at this user's API prefix.
    pub fn jetstream(&self, client: async_nats::Client) -> async_nats::jetstream::Context {
        match &self.js_api_prefix {
            Some(prefix) => async_nats::jetstream::with_prefix(client, prefix),
            None => async_nats::jetstream::new(client),
        }
    }

    /// `options` with these credentials, inbox prefix and TLS files. With any TLS file
    /// the connection must use TLS (a server that does not offer it is refused); the CA
    /// file replaces the system's root certificates. A `tls://` URL asks for TLS by
    /// itself.
    pub fn apply(&self, options: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
        let mut options = options.custom_inbox_prefix(self.inbox_prefix());
        if self.tls.is_set() {
            options = options.require_tls(true);
        }
        if let Some(ca_file) = &self.tls.ca_file {
            options = options.add_root_certificates(ca_file.clone());
        }
        if let Some(client) = &self.tls.client {
            options =
                options.add_client_certificate(client.cert_file.clone(), client.key_file.clone());
        }
        match (&self.user, &self.password) {
            (Some(user), Some(password)) => {
                options.user_and_password(user.clone(), password.clone())
            }
            _ => options,
        }
    }
}

fn valid_prefix(prefix: &str) -> bool {
    prefix.split('.').all(|token| {
        !token.is_empty()
            && !token
                .chars()
                .any(|c| c == '*' || c == '>' || c.is_whitespace())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbox_prefix_follows_the_user() {
        assert_eq!(NatsCredentials::none().inbox_prefix(), "_INBOX");
        let worker = NatsCredentials::user_and_password("worker", "secret");
        assert_eq!(worker.inbox_prefix(), "_INBOX_worker");
        let custom = NatsCredentials {
            inbox_prefix: Some("_INBOX_web".into()),
            ..worker.clone()
        };
        assert_eq!(custom.inbox_prefix(), "_INBOX_web");
    }

    #[test]
    fn debug_hides_the_password() {
        let shown = format!(
            "{:?}",
            NatsCredentials::user_and_password("worker", "hunter2")
        );
        assert!(!shown.contains("hunter2"));
        assert!(shown.contains("worker"));
    }

    #[test]
    fn prefixes_are_plain_subjects() {
        assert!(valid_prefix("_INBOX_web"));
        assert!(valid_prefix("fleet.inbox.web"));
        assert!(!valid_prefix("_INBOX.>"));
        assert!(!valid_prefix("a..b"));
        assert!(!valid_prefix(""));
    }
}
