//! Python for the tests that drive the fleet with real Python clients (the example
//! worker on nats-py today; the `openai` and `mcp` packages tomorrow).
//!
//! Owns provisioning and starting: [`venv`] creates a virtual environment per requirements file,
//! keyed by the file's hash, installs the requirements into it once, and reuses it while
//! the file is unchanged, so `cargo test --workspace` needs nothing but `python3` on the
//! machine; [`worker`] starts a Python SDK worker against a test fleet. Never installs into the machine's own Python, and never skips a test because
//! a package is missing: a machine without `python3` or its `venv` module gets one line
//! naming the Debian packages to install.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::process::Command;

use crate::fleet::{Fleet, Running};

/// Longest a `pip install` of one requirements file may take.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);

/// The Debian packages that give a machine `python3` with `venv` and `pip`.
const INSTALL_HINT: &str = "apt-get install -y python3 python3-venv python3-pip";

/// `python3` on `PATH`.
pub fn python3() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("python3"))
        .find(|p| p.is_file())
        .with_context(|| format!("python3 not found: {INSTALL_HINT}"))
}

/// The interpreter of [`venv`] with the SDK's own requirements (`sdk/python`), what a
/// Python worker or frontend of the tests runs on.
pub async fn sdk_venv(root: impl AsRef<Path>) -> Result<PathBuf> {
    venv(root, "sdk/python/requirements.txt").await
}

/// Where most Python worker tests start: the interpreter of [`sdk_venv`] under `root`,
/// then a fresh fleet with one coordinator.
pub async fn sdk_fleet(root: impl AsRef<Path>) -> Result<(PathBuf, Fleet, Running)> {
    let python = sdk_venv(root).await?;
    let fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    Ok((python, fleet, coordinator))
}

/// The Python interpreter of a virtual environment under `root` holding the packages of
/// the repository's `requirements` file (a path relative to the repository root),
/// created and installed on first use. Pass `env!("CARGO_TARGET_TMPDIR")` as `root` so
/// the environment lives with the build and survives between runs.
pub async fn venv(root: impl AsRef<Path>, requirements: &str) -> Result<PathBuf> {
    let file = crate::repo_path(requirements);
    let contents = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let digest = hex(&Sha256::digest(&contents)[..8]);
    let dir = root.as_ref().join(format!("python-venv-{digest}"));
    let python = dir.join("bin").join("python");
    if python.is_file() {
        return Ok(python);
    }
    // One provisioning at a time in this process: the tests of one binary wait for the
    // first one's environment instead of building their own beside it.
    static PROVISIONING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = PROVISIONING.lock().await;
    if python.is_file() {
        return Ok(python);
    }
    std::fs::create_dir_all(root.as_ref())?;
    // Built beside its final place and renamed into it, so a half-built environment is
    // never reused and concurrent test binaries do not share one while it is built.
    let building = root
        .as_ref()
        .join(format!("python-venv-{digest}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&building);
    let system = python3()?;
    let made = run(Command::new(&system).arg("-m").arg("venv").arg(&building)).await;
    made.with_context(|| format!("python3 -m venv failed: {INSTALL_HINT}"))?;
    let mut pip = Command::new(building.join("bin").join("python"));
    pip.args(PIP_INSTALL)
        .arg("-r")
        .arg(&file)
        .env("PIP_NO_INPUT", "1");
    let what = format!("pip install -r {requirements}");
    if let Err(failed) = crate::output_of(&mut pip, INSTALL_TIMEOUT, &what).await {
        let _ = std::fs::remove_dir_all(&building);
        return Err(failed);
    }
    if std::fs::rename(&building, &dir).is_err() {
        // Another test binary finished first: use its environment.
        let _ = std::fs::remove_dir_all(&building);
    }
    if !python.is_file() {
        bail!("no interpreter at {} after provisioning", python.display());
    }
    Ok(python)
}

/// `python` arguments that install quietly with pip, without its version check (the
/// packages or requirements follow).
pub const PIP_INSTALL: [&str; 5] = [
    "-m",
    "pip",
    "install",
    "--quiet",
    "--disable-pip-version-check",
];

/// Starts `python <args>` (a worker on the SDK of `sdk/python`, imported from the
/// repository) against `fleet` with heartbeat 500 ms, ack wait 1 s and `extra`
/// environment; killed when dropped.
pub fn worker(
    python: &Path,
    fleet: &Fleet,
    args: &[&str],
    extra: &[(&str, &str)],
) -> Result<tokio::process::Child> {
    worker_command(python, fleet, args, extra)
        .spawn()
        .context("starting the Python worker")
}

/// The command [`worker`] runs (its stderr inherited), for a test that pipes its output
/// or waits for its exit.
pub fn worker_command(
    python: &Path,
    fleet: &Fleet,
    args: &[&str],
    extra: &[(&str, &str)],
) -> Command {
    let mut command = sdk_command(python, fleet.names.prefix());
    command
        .args(args)
        .envs(fleet.servers_env())
        .env("TOOLFLEET_HTTP_ADDR", "off")
        .envs(extra.iter().copied());
    command
}

/// `python` in the repository root with the SDK of `sdk/python` importable, under
/// `prefix` with heartbeat 500 ms and ack wait 1 s, as a [`crate::child_command`]; the
/// caller adds the script and where the servers are.
pub fn sdk_command(python: &Path, prefix: &str) -> Command {
    let mut command = crate::child_command(python, Stdio::null());
    command
        .current_dir(crate::repo_path(""))
        .env("PYTHONPATH", crate::repo_path("sdk/python"))
        .env("TOOLFLEET_PREFIX", prefix)
        .env("TOOLFLEET_HEARTBEAT_MS", "500")
        .env("TOOLFLEET_ACK_WAIT_MS", "1000");
    command
}

/// Sends SIGTERM to a worker started by [`worker`] and waits (at most 15 s) for it to
/// exit; its exit status.
pub async fn terminate(child: &mut tokio::process::Child) -> Result<std::process::ExitStatus> {
    let pid = child.id().context("the Python worker has no pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .context("the Python worker did not stop")?
        .context("waiting for the Python worker")
}

/// Runs `command` to completion (at most two minutes), quietly; an error unless it
/// succeeds.
async fn run(command: &mut Command) -> Result<()> {
    command.stdout(Stdio::null());
    crate::output_of(command, Duration::from_secs(120), "the command").await?;
    Ok(())
}

/// Runs the repository's Python script `script` on `python` with `args` (at most two
/// minutes); the JSON it printed.
pub async fn script_json(python: &Path, script: &str, args: &[&str]) -> Result<Value> {
    let mut command = Command::new(python);
    command.arg(crate::repo_path(script)).args(args);
    let out = crate::output_of(&mut command, Duration::from_secs(120), script).await?;
    serde_json::from_slice(&out.stdout)
        .with_context(|| String::from_utf8_lossy(&out.stdout).to_string())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
