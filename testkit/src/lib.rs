//! What the tests and the developer tools (`toolfleet-dev`) need to start their own
//! servers on this machine: the server's executable ([`find_binary`]) and loopback ports
//! nothing listens on ([`free_port`], [`free_ports`]). [`find_binary`] is
//! `toolfleet_common::host`'s, re-exported, which the `toolfleet` command's local fleet uses
//! too, so a server is found the same way, and named the same way when it is missing,
//! wherever it is started.
//!
//! # Layout
//!
//! | item | what it does |
//! |---|---|
//! | [`find_binary`] | `$NAME_BIN`, else `PATH`, else the system folders; [`BinaryNotFound`] says what to install |
//! | [`free_port`] | one loopback port free a moment ago, none handed out before in this process |
//! | [`free_ports`] | several distinct ones, none handed out before in this process |
//! | [`child_command`] | a server or node started as a child: no stdin, stderr shared, `RUST_LOG` passed on |
//!
//! Owns no process and no port: a port is free when handed out, and another process may
//! take it before the caller binds it.

use std::ffi::OsStr;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::Mutex;

pub use toolfleet_common::host::{binary_env_var, find_binary, BinaryNotFound};

/// Ports [`free_ports`] handed out in this process: two clusters started together draw
/// at the same time, and a port one of them released could otherwise come back to the
/// other before its server bound it.
static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// `n` distinct free loopback ports, none handed out by this function before in this
/// process: every listener stays open until all are chosen, so the kernel cannot hand
/// the same port out twice (a node's client port equal to another's cluster port would
/// fail a cluster's start).
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    let mut held = Vec::new();
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        if held.len() >= 10 * n + 100 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                "no free loopback ports",
            ));
        }
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        let port = listener.local_addr()?.port();
        if !handed_out.contains(&port) && !ports.contains(&port) {
            ports.push(port);
        }
        held.push(listener);
    }
    handed_out.extend_from_slice(&ports);
    Ok(ports)
}

/// One free loopback port, never handed out before in this process (see
/// [`free_ports`]): a test's own listener and another test's server drawn at the same
/// time cannot be given the same port.
pub fn free_port() -> std::io::Result<u16> {
    let ports = free_ports(1)?;
    ports.first().copied().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            "no free loopback port",
        )
    })
}

/// The log filter a child process gets: the parent's `RUST_LOG`, else `warn`, so a
/// node's warnings show in the caller's output and its chatter only when asked for.
pub fn child_log_filter() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())
}

/// A command for a program started as a child of a test or a developer tool: no stdin,
/// `stdout` as given (discarded, or piped when the caller reads it), stderr shared with
/// the caller (a failing child explains itself in the caller's output) and `RUST_LOG`
/// from [`child_log_filter`].
pub fn child_command(program: impl AsRef<OsStr>, stdout: Stdio) -> Command {
    let mut command = Command::new(program);
    command
        .env("RUST_LOG", child_log_filter())
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::inherit());
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_and_never_handed_out_twice() {
        let first = free_ports(8).expect("ports");
        let second = free_ports(8).expect("ports");
        let mut all: Vec<u16> = first.iter().chain(&second).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 16);
    }
}
