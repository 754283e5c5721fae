//! TLS for the tests: a throwaway CA with a server certificate (for `127.0.0.1` and
//! `localhost`) and a client certificate, made by the `openssl` command in a temporary
//! directory ([`TestCertificates`]); and [`TlsServers`]: a `nats-server` and a
//! `redis-server` that take only TLS clients, with fleet processes, frontend clients and
//! Redis connections pointed at them by the TLS settings alone.
//!
//! Owns the certificate files (removed on `Drop`) and the servers' TLS configuration.
//! Never turns TLS on for the other tests' servers.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::redis_client::{self, RedisConnection, RedisOptions};
use toolfleet_common::tls::TlsFiles;
use toolfleet_common::{FleetClient, Names};

use crate::{NatsServer, RedisServer, RedisTlsFiles};

/// Longest one `openssl` command may take.
const OPENSSL_TIMEOUT: Duration = Duration::from_secs(30);

/// Days the certificates are valid.
const VALID_DAYS: &str = "2";

/// The `openssl req` arguments for a new unencrypted P-256 key, written to the file
/// named by the argument that follows them.
const NEW_KEY: [&str; 6] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
    "-keyout",
];

/// How long `nats-server` waits for a client's TLS handshake, in seconds: above its
/// half-second default, for a loaded test machine.
const NATS_TLS_TIMEOUT_S: u32 = 5;

/// A CA, a server certificate for `127.0.0.1` and `localhost`, and a client certificate,
/// all PEM files (EC P-256 keys) in a temporary directory.
pub struct TestCertificates {
    dir: tempfile::TempDir,
}

impl TestCertificates {
    /// Makes the CA and both certificates with `openssl` (`$OPENSSL_BIN`, else `openssl`
    /// on `PATH` or in the system folders).
    pub async fn generate() -> Result<Self> {
        let openssl = crate::find_binary("openssl")?;
        let dir = tempfile::Builder::new()
            .prefix("toolfleet-tls-")
            .tempdir()
            .context("creating a temporary directory for certificates")?;
        let certificates = Self { dir };
        certificates
            .openssl(
                &openssl,
                &[
                    &["req", "-x509"][..],
                    &NEW_KEY,
                    &[
                        "ca.key",
                        "-out",
                        "ca.pem",
                        "-days",
                        VALID_DAYS,
                        "-subj",
                        "/CN=toolfleet test CA",
                        "-addext",
                        "basicConstraints=critical,CA:TRUE",
                        "-addext",
                        "keyUsage=critical,keyCertSign,cRLSign",
                    ],
                ]
                .concat(),
            )
            .await?;
        certificates
            .sign(
                &openssl,
                "server",
                "/CN=localhost",
                "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n",
            )
            .await?;
        certificates
            .sign(
                &openssl,
                "client",
                "/CN=toolfleet test client",
                "extendedKeyUsage=clientAuth\n",
            )
            .await?;
        Ok(certificates)
    }

    /// Makes `<name>.key` and `<name>.pem`, a certificate for `subject` signed by the CA
    /// with the extensions `extensions` (lines of an `openssl` extensions file).
    async fn sign(
        &self,
        openssl: &Path,
        name: &str,
        subject: &str,
        extensions: &str,
    ) -> Result<()> {
        let ext = format!("{name}.ext");
        std::fs::write(
            self.dir.path().join(&ext),
            format!(
                "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n{extensions}"
            ),
        )?;
        let (key, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        self.openssl(
            openssl,
            &[
                &["req", "-new"][..],
                &NEW_KEY,
                &[&key, "-out", &csr, "-subj", subject],
            ]
            .concat(),
        )
        .await?;
        self.openssl(
            openssl,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                VALID_DAYS,
                "-extfile",
                &ext,
            ],
        )
        .await
    }

    /// Runs `openssl args` in the certificates' directory (bounded); an error with its
    /// output unless it succeeds.
    async fn openssl(&self, openssl: &Path, args: &[&str]) -> Result<()> {
        let run = Command::new(openssl)
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(OPENSSL_TIMEOUT, run)
            .await
            .with_context(|| format!("openssl {} timed out", args.join(" ")))?
            .context("starting openssl")?;
        if !out.status.success() {
            bail!(
                "openssl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA's certificate, the root every client trusts.
    pub fn ca_file(&self) -> PathBuf {
        self.file("ca.pem")
    }

    /// The servers' certificate (`127.0.0.1`, `localhost`).
    pub fn server_cert(&self) -> PathBuf {
        self.file("server.pem")
    }

    /// The servers' key.
    pub fn server_key(&self) -> PathBuf {
        self.file("server.key")
    }

    /// The clients' certificate, for servers that verify clients.
    pub fn client_cert(&self) -> PathBuf {
        self.file("client.pem")
    }

    /// The clients' key.
    pub fn client_key(&self) -> PathBuf {
        self.file("client.key")
    }

    /// The `tls {}` block of a `nats-server` configuration with the server certificate;
    /// with `verify_clients`, a client must show a certificate signed by the CA.
    pub fn nats_tls_block(&self, verify_clients: bool) -> String {
        let verify = if verify_clients {
            format!("  ca_file: {:?}\n  verify: true\n", self.ca_file())
        } else {
            String::new()
        };
        format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n{verify}  timeout: {NATS_TLS_TIMEOUT_S}\n}}\n",
            self.server_cert(),
            self.server_key(),
        )
    }

    /// The files of a `redis-server` that takes only TLS clients on its certificate.
    pub fn redis_tls_files(&self, verify_clients: bool) -> RedisTlsFiles {
        RedisTlsFiles {
            cert_file: self.server_cert(),
            key_file: self.server_key(),
            ca_file: self.ca_file(),
            verify_clients,
        }
    }
}

/// A `nats-server` (JetStream) and a `redis-server` that take only TLS clients, on one
/// [`TestCertificates`].
pub struct TlsServers {
    /// The NATS server; plain connections are refused.
    pub nats: NatsServer,
    /// The Redis server; it has no plain port.
    pub redis: RedisServer,
    /// The names in use.
    pub names: Names,
    /// Whether both servers require a client certificate.
    pub verify_clients: bool,
    /// The CA and certificates; declared last so the servers stop before their files go.
    pub certificates: TestCertificates,
}

impl TlsServers {
    /// Makes certificates and starts both servers on them; with `verify_clients`, each
    /// server also requires a client certificate signed by the CA.
    pub async fn start(verify_clients: bool) -> Result<Self> {
        crate::init_test_tracing();
        let certificates = TestCertificates::generate().await?;
        let nats =
            NatsServer::start_with_config(&certificates.nats_tls_block(verify_clients)).await?;
        let redis = RedisServer::start_tls(certificates.redis_tls_files(verify_clients)).await?;
        Ok(Self {
            nats,
            redis,
            names: Names::default(),
            verify_clients,
            certificates,
        })
    }

    /// `tls://127.0.0.1:PORT`, the NATS URL that asks for TLS by its scheme.
    pub fn nats_tls_url(&self) -> String {
        format!("tls://127.0.0.1:{}", self.nats.port())
    }

    /// `rediss://127.0.0.1:PORT/`.
    pub fn redis_url(&self) -> String {
        self.redis.url()
    }

    /// The TLS files a client of these servers needs: the CA, and the client
    /// certificate where the servers verify clients.
    pub fn client_tls(&self) -> TlsFiles {
        let tls = TlsFiles::trusting(self.certificates.ca_file());
        match self.verify_clients {
            true => tls.with_client_certificate(
                self.certificates.client_cert(),
                self.certificates.client_key(),
            ),
            false => tls,
        }
    }

    /// The environment of a fleet process that reaches these servers: `tls://` and
    /// `rediss://` URLs and the TLS variables of [`TlsServers::client_tls`] for both.
    pub fn environment(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("TOOLFLEET_NATS_URL", self.nats_tls_url()),
            ("TOOLFLEET_REDIS_URL", self.redis_url()),
        ];
        let tls = self.client_tls();
        let path = |p: &Path| p.display().to_string();
        if let Some(ca) = &tls.ca_file {
            env.push(("TOOLFLEET_NATS_CA_FILE", path(ca)));
            env.push(("TOOLFLEET_REDIS_CA_FILE", path(ca)));
        }
        if let Some(client) = &tls.client {
            env.push(("TOOLFLEET_NATS_CERT_FILE", path(&client.cert_file)));
            env.push(("TOOLFLEET_NATS_KEY_FILE", path(&client.key_file)));
            env.push(("TOOLFLEET_REDIS_CERT_FILE", path(&client.cert_file)));
            env.push(("TOOLFLEET_REDIS_KEY_FILE", path(&client.key_file)));
        }
        env
    }

    /// `fleet-node <role>` (a coordinator, or a worker with the demo and test packs) on
    /// these servers through [`TlsServers::environment`] with `extra` environment on top,
    /// short sweeps and heartbeats; killed when the handle drops.
    pub fn node(&self, role: &str, extra: &[(&str, &str)]) -> Result<Child> {
        let mut command = crate::fleet::node_command(role, self.names.prefix())?;
        command.envs(self.environment());
        command.envs(extra.iter().copied());
        command
            .spawn()
            .with_context(|| format!("spawning fleet-node {role}"))
    }

    /// `python <script>` (a worker on the SDK of `sdk/python`, imported from the
    /// repository) on these servers through [`TlsServers::environment`]; killed when the
    /// handle drops.
    pub fn python_worker(&self, python: &Path, script: &str) -> Result<Child> {
        let mut command = crate::python::sdk_command(python, self.names.prefix());
        command.arg(script);
        command.envs(self.environment());
        command.spawn().context("starting the Python worker")
    }

    /// A frontend client over `tls://` with [`TlsServers::client_tls`].
    pub async fn client(&self) -> Result<FleetClient> {
        let credentials = NatsCredentials::none().with_tls(self.client_tls());
        Ok(
            FleetClient::connect_with(&self.nats_tls_url(), self.names.prefix(), &credentials)
                .await?,
        )
    }

    /// A Redis connection over `rediss://` with `tls`.
    pub async fn redis_with(&self, tls: TlsFiles) -> Result<RedisConnection> {
        Ok(redis_client::connect(&self.redis_url(), RedisOptions::with_tls(tls)).await?)
    }
}

/// A TLS-terminating proxy on a free loopback port: it shows the test server certificate
/// and relays each connection, decrypted, to a plain TCP `backend`. Stops when dropped.
pub struct TlsProxy {
    /// The port it listens on (TLS).
    pub port: u16,
    stop: tokio_util::sync::CancellationToken,
}

impl TlsProxy {
    /// Starts a proxy presenting `certificates`' server certificate in front of `backend`.
    pub async fn start(
        certificates: &TestCertificates,
        backend: std::net::SocketAddr,
    ) -> Result<Self> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let chain = CertificateDer::pem_file_iter(certificates.server_cert())?
            .collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(certificates.server_key())?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let stop = tokio_util::sync::CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = token.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((tcp, _)) = accepted else { continue };
                let (acceptor, token) = (acceptor.clone(), token.clone());
                tokio::spawn(async move {
                    let relay = async {
                        let mut tls = acceptor.accept(tcp).await?;
                        let mut plain = tokio::net::TcpStream::connect(backend).await?;
                        tokio::io::copy_bidirectional(&mut tls, &mut plain).await?;
                        Ok::<_, std::io::Error>(())
                    };
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = relay => {}
                    }
                });
            }
        });
        Ok(Self { port, stop })
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
