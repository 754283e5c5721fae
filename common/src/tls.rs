//! TLS of one connection, to NATS or to Redis: the root CA to trust and the client
//! certificate to show, as files named by environment variables.
//!
//! | variable | NATS | Redis |
//! |---|---|---|
//! | PEM root CA to trust (TLS required when set) | `TOOLFLEET_NATS_CA_FILE` | `TOOLFLEET_REDIS_CA_FILE` |
//! | PEM client certificate (mutual TLS) | `TOOLFLEET_NATS_CERT_FILE` | `TOOLFLEET_REDIS_CERT_FILE` |
//! | PEM key of that certificate | `TOOLFLEET_NATS_KEY_FILE` | `TOOLFLEET_REDIS_KEY_FILE` |
//!
//! Owns [`TlsFiles`] and the names of those variables ([`NATS_TLS`], [`REDIS_TLS`]).
//! Only checks that the files exist: `credentials.rs` hands them to async-nats and
//! `redis_client.rs` to the redis crate, which read them when connecting. Never reads
//! or prints a key.

use std::path::{Path, PathBuf};

use crate::env::ConfigError;

/// The names of the three TLS variables of one server kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TlsVariables {
    /// PEM root CA to trust.
    pub ca_file: &'static str,
    /// PEM client certificate.
    pub cert_file: &'static str,
    /// PEM key of the client certificate.
    pub key_file: &'static str,
}

/// The TLS variables of the NATS connection.
pub const NATS_TLS: TlsVariables = TlsVariables {
    ca_file: "TOOLFLEET_NATS_CA_FILE",
    cert_file: "TOOLFLEET_NATS_CERT_FILE",
    key_file: "TOOLFLEET_NATS_KEY_FILE",
};

/// The TLS variables of the Redis connection.
pub const REDIS_TLS: TlsVariables = TlsVariables {
    ca_file: "TOOLFLEET_REDIS_CA_FILE",
    cert_file: "TOOLFLEET_REDIS_CERT_FILE",
    key_file: "TOOLFLEET_REDIS_KEY_FILE",
};

/// A client certificate and its key, both PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The certificate (chain), PEM.
    pub cert_file: PathBuf,
    /// Its private key, PEM.
    pub key_file: PathBuf,
}

/// The TLS files of one connection. Empty ([`TlsFiles::none`]) means the URL's scheme
/// alone decides: `tls://` or `rediss://` use TLS with the system's root certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM root certificates trusted instead of the system's. When set, the connection
    /// must use TLS.
    pub ca_file: Option<PathBuf>,
    /// The certificate this client shows, for servers that verify clients (mutual TLS).
    pub client: Option<ClientCertificate>,
}

impl TlsFiles {
    /// No files.
    pub fn none() -> Self {
        Self::default()
    }

    /// Trusts the root CA in `ca_file`.
    pub fn trusting(ca_file: impl Into<PathBuf>) -> Self {
        Self {
            ca_file: Some(ca_file.into()),
            client: None,
        }
    }

    /// These files, showing the certificate in `cert_file` with the key in `key_file`.
    pub fn with_client_certificate(
        self,
        cert_file: impl Into<PathBuf>,
        key_file: impl Into<PathBuf>,
    ) -> Self {
        Self {
            client: Some(ClientCertificate {
                cert_file: cert_file.into(),
                key_file: key_file.into(),
            }),
            ..self
        }
    }

    /// Whether any file is set, which makes TLS required.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client.is_some()
    }

    /// Reads the files named by `variables`. A file that does not exist is an error
    /// naming its variable, and so is a certificate without a key (or the reverse).
    pub fn from_env(variables: &TlsVariables) -> Result<Self, ConfigError> {
        Self::from_lookup(variables, |name| std::env::var(name).ok())
    }

    fn from_lookup(
        variables: &TlsVariables,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let read = |name: &'static str| -> Result<Option<PathBuf>, ConfigError> {
            let Some(value) = lookup(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
            else {
                return Ok(None);
            };
            existing_file(name, Path::new(&value)).map(Some)
        };
        let ca_file = read(variables.ca_file)?;
        let client = match (read(variables.cert_file)?, read(variables.key_file)?) {
            (Some(cert_file), Some(key_file)) => Some(ClientCertificate {
                cert_file,
                key_file,
            }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(ConfigError {
                    name: variables.key_file.into(),
                    value: String::new(),
                    reason: format!("{} is set, so a key file is required", variables.cert_file),
                })
            }
            (None, Some(_)) => {
                return Err(ConfigError {
                    name: variables.cert_file.into(),
                    value: String::new(),
                    reason: format!(
                        "{} is set, so a certificate is required",
                        variables.key_file
                    ),
                })
            }
        };
        Ok(Self { ca_file, client })
    }
}

/// `path` when it names a file; else an error naming `variable`.
fn existing_file(variable: &str, path: &Path) -> Result<PathBuf, ConfigError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(path.to_path_buf()),
        Ok(_) => Err(ConfigError {
            name: variable.into(),
            value: path.display().to_string(),
            reason: "not a file".into(),
        }),
        Err(error) => Err(ConfigError {
            name: variable.into(),
            value: path.display().to_string(),
            reason: error.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<TlsFiles, ConfigError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TlsFiles::from_lookup(&NATS_TLS, |name| vars.get(name).cloned())
    }

    #[test]
    fn nothing_set_is_no_tls() {
        let files = read(&[]).expect("reads");
        assert_eq!(files, TlsFiles::none());
        assert!(!files.is_set());
        let blank = read(&[("TOOLFLEET_NATS_CA_FILE", "  ")]).expect("reads");
        assert!(!blank.is_set());
    }

    #[test]
    fn existing_files_are_taken() {
        let dir = std::env::temp_dir().join(format!("toolfleet-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (ca, cert, key) = (dir.join("ca.pem"), dir.join("c.pem"), dir.join("k.pem"));
        for file in [&ca, &cert, &key] {
            std::fs::write(file, "-----BEGIN-----").expect("written");
        }
        let path = |p: &PathBuf| p.display().to_string();
        let files = read(&[
            ("TOOLFLEET_NATS_CA_FILE", &path(&ca)),
            ("TOOLFLEET_NATS_CERT_FILE", &path(&cert)),
            ("TOOLFLEET_NATS_KEY_FILE", &path(&key)),
        ])
        .expect("reads");
        assert_eq!(
            files,
            TlsFiles::trusting(&ca).with_client_certificate(&cert, &key)
        );
        assert!(files.is_set());
        let half = read(&[("TOOLFLEET_NATS_CERT_FILE", &path(&cert))]).expect_err("refused");
        assert_eq!(half.name, "TOOLFLEET_NATS_KEY_FILE");
        let half = read(&[("TOOLFLEET_NATS_KEY_FILE", &path(&key))]).expect_err("refused");
        assert_eq!(half.name, "TOOLFLEET_NATS_CERT_FILE");
        let folder = read(&[("TOOLFLEET_NATS_CA_FILE", &path(&dir))]).expect_err("refused");
        assert_eq!(folder.name, "TOOLFLEET_NATS_CA_FILE");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_missing_file_names_its_variable() {
        let error =
            read(&[("TOOLFLEET_NATS_CA_FILE", "/nonexistent/ca.pem")]).expect_err("refused");
        assert_eq!(error.name, "TOOLFLEET_NATS_CA_FILE");
        assert_eq!(error.value, "/nonexistent/ca.pem");
    }
}
