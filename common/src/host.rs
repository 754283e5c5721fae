//! This machine, as a program that starts servers on it sees it: a server's executable
//! ([`find_binary`]) and a loopback port nothing listens on ([`free_port`]). The
//! `toolfleet` command's local fleet, the developer tools and the integration tests
//! (through `toolfleet-testkit`) share these, so a server is found the same way, and named
//! the same way when it is missing, wherever it is started.
//!
//! Owns no process and no port: a port is free when handed out, and another process may
//! take it before the caller binds it.

use std::net::TcpListener;
use std::path::PathBuf;

/// Folders searched after `PATH`: where Debian's packages put servers and tools, which
/// a non-root `PATH` often lacks (`/usr/sbin/nats-server`, `/sbin/iptables`).
const SYSTEM_FOLDERS: [&str; 4] = ["/usr/sbin", "/usr/bin", "/usr/local/bin", "/sbin"];

/// An executable [`find_binary`] did not find.
#[derive(Debug, thiserror::Error)]
pub enum BinaryNotFound {
    /// Neither on `PATH` nor in the system folders.
    #[error("{name} not found: apt-get install {name} (or set {env_var} to its path)")]
    Missing {
        /// The executable's name.
        name: String,
        /// The variable that names its path.
        env_var: String,
    },
    /// The variable that names its path names no file.
    #[error("{env_var}={path} does not name a file")]
    NotAFile {
        /// The variable.
        env_var: String,
        /// What it holds.
        path: String,
    },
}

/// The variable that overrides where `name` is found: `nats-server` → `NATS_SERVER_BIN`.
pub fn binary_env_var(name: &str) -> String {
    let mut var: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' => c.to_ascii_uppercase(),
            'A'..='Z' | '0'..='9' => c,
            _ => '_',
        })
        .collect();
    var.push_str("_BIN");
    var
}

/// The executable `name`: the path in `$NAME_BIN` ([`binary_env_var`]) when set, else
/// the first `name` on `PATH`, else in `/usr/sbin`, `/usr/bin`, `/usr/local/bin`, `/sbin`.
pub fn find_binary(name: &str) -> Result<PathBuf, BinaryNotFound> {
    let env_var = binary_env_var(name);
    if let Some(path) = std::env::var_os(&env_var) {
        let path = PathBuf::from(path);
        return match path.is_file() {
            true => Ok(path),
            false => Err(BinaryNotFound::NotAFile {
                env_var,
                path: path.display().to_string(),
            }),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SYSTEM_FOLDERS.map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| BinaryNotFound::Missing {
            name: name.to_string(),
            env_var,
        })
}

/// A port on 127.0.0.1 that was free a moment ago: found by binding port 0 and dropping
/// the listener, so another process may take it before the caller binds it.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binary_variable_is_the_name_in_capitals_with_underscores() {
        assert_eq!(binary_env_var("nats-server"), "NATS_SERVER_BIN");
        assert_eq!(binary_env_var("redis-cli"), "REDIS_CLI_BIN");
        assert_eq!(binary_env_var("openssl"), "OPENSSL_BIN");
    }

    #[test]
    fn a_binary_on_no_path_is_missing_with_what_to_install() {
        let error = find_binary("toolfleet-no-such-binary").expect_err("no such binary");
        assert!(matches!(
            &error,
            BinaryNotFound::Missing { name, env_var }
                if name == "toolfleet-no-such-binary" && env_var == "TOOLFLEET_NO_SUCH_BINARY_BIN"
        ));
    }

    #[test]
    fn a_binary_in_a_system_folder_is_found() {
        // `sh` is in /usr/bin (or /bin, which Debian links to /usr/bin) on every machine
        // these tests run on.
        let found = find_binary("sh").expect("sh");
        assert!(found.is_file());
    }

    #[test]
    fn a_free_port_can_be_bound() {
        let port = free_port().expect("a port");
        TcpListener::bind(("127.0.0.1", port)).expect("bind the free port");
    }
}
