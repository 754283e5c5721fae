//! The servers file of the `mcp` pack (`TOOLFLEET_MCP_SERVERS`, JSON): MCP servers by
//! name, each reached over stdio (a command the worker runs) or Streamable HTTP (a URL).
//!
//! Owns the file's format and its checks; it never connects (see `server.rs`).
//!
//! ```json
//! {"servers": {
//!   "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/srv/docs"],
//!             "env": {"NODE_ENV": "production"}, "cwd": "/srv", "timeout_ms": 5000},
//!   "search": {"url": "http://127.0.0.1:8000/mcp", "headers": {"authorization": "Bearer ..."}}
//! }}
//! ```
//!
//! `mcpServers` is accepted for `servers`, so a client's existing file can be reused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toolfleet_common::tool::DEFAULT_TOOL_TIMEOUT_MS;

use crate::json_file::{read_json, JsonFileError};

/// The servers file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServersFile {
    /// The servers by name; the name prefixes their tools (`<name>.<tool>`).
    #[serde(alias = "mcpServers")]
    pub servers: BTreeMap<String, McpServerSpec>,
}

/// One server as declared; every setting may be left out (the checks of [`read_servers`]
/// then ask for what the transport needs).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpServerSpec {
    /// The program to run (stdio transport).
    pub command: Option<String>,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables added to the worker's environment for it.
    pub env: BTreeMap<String, String>,
    /// Its working directory (default: the worker's).
    pub cwd: Option<PathBuf>,
    /// The server's endpoint (Streamable HTTP transport), `http://host:port/path`.
    pub url: Option<String>,
    /// Headers sent with every HTTP request (e.g. `authorization`).
    pub headers: BTreeMap<String, String>,
    /// Per-call timeout of the server's tools, in milliseconds (default 10000; this
    /// field's own default wins over the derived `Default`'s 0 when a file leaves it out).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// What the assistant says it is doing while one of the server's tools runs.
    pub waiting_hint: Option<String>,
}

fn default_timeout_ms() -> u64 {
    DEFAULT_TOOL_TIMEOUT_MS
}

/// How a server is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// A child process speaking JSON-RPC on its stdin and stdout.
    Stdio {
        /// The program.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Extra environment.
        env: BTreeMap<String, String>,
        /// Working directory.
        cwd: Option<PathBuf>,
    },
    /// Streamable HTTP.
    Http {
        /// The endpoint.
        url: String,
        /// Extra headers.
        headers: BTreeMap<String, String>,
    },
}

/// A checked server declaration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpServer {
    /// The name, prefix of its tools.
    pub name: String,
    /// How it is reached.
    pub transport: Transport,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Waiting hint of its tools.
    pub waiting_hint: Option<String>,
}

/// Why the servers file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum McpConfigError {
    /// The file could not be read or is not valid JSON of the expected shape.
    #[error(transparent)]
    File(#[from] JsonFileError),
    /// A server's declaration is unusable.
    #[error("mcp server {server:?}: {reason}")]
    Invalid {
        /// The server.
        server: String,
        /// What is wrong.
        reason: String,
    },
}

/// Reads and checks the servers file at `path`.
pub fn read_servers(path: &Path) -> Result<Vec<McpServer>, McpConfigError> {
    servers(read_json(path)?)
}

/// Checks every server of `file`.
pub fn servers(file: McpServersFile) -> Result<Vec<McpServer>, McpConfigError> {
    file.servers
        .into_iter()
        .map(|(name, spec)| server(name, spec))
        .collect()
}

/// Checks one declaration: a usable name, exactly one of `command` and `url` (with only
/// that transport's settings), an `http://` URL, a timeout above zero.
fn server(name: String, spec: McpServerSpec) -> Result<McpServer, McpConfigError> {
    let invalid = |reason: &str| McpConfigError::Invalid {
        server: name.clone(),
        reason: reason.to_string(),
    };
    let name_ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
    if !name_ok {
        return Err(invalid(
            "a server name is ASCII letters, digits, '_' and '-' (it prefixes the tool names)",
        ));
    }
    if spec.timeout_ms == 0 {
        return Err(invalid("timeout_ms must be above zero"));
    }
    let stdio_settings = !spec.args.is_empty() || !spec.env.is_empty() || spec.cwd.is_some();
    let transport = match (spec.command, spec.url) {
        (Some(_), None) if !spec.headers.is_empty() => {
            return Err(invalid("headers apply to a url, not to a command"));
        }
        (Some(command), None) => Transport::Stdio {
            command,
            args: spec.args,
            env: spec.env,
            cwd: spec.cwd,
        },
        (None, Some(_)) if stdio_settings => {
            return Err(invalid(
                "args, env and cwd apply to a command, not to a url",
            ));
        }
        (None, Some(url)) if !url.starts_with("http://") => {
            return Err(invalid(
                "only http:// URLs are supported; reach https through a TLS-terminating proxy",
            ));
        }
        (None, Some(url)) => {
            for (name, value) in &spec.headers {
                let usable = reqwest::header::HeaderName::try_from(name.as_str()).is_ok()
                    && reqwest::header::HeaderValue::try_from(value.as_str()).is_ok();
                if !usable {
                    return Err(invalid(&format!(
                        "header {name:?} is not a valid HTTP header"
                    )));
                }
            }
            Transport::Http {
                url,
                headers: spec.headers,
            }
        }
        _ => {
            return Err(invalid(
                "give exactly one of command (stdio) and url (HTTP)",
            ))
        }
    };
    Ok(McpServer {
        name,
        transport,
        timeout: Duration::from_millis(spec.timeout_ms),
        waiting_hint: spec.waiting_hint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Vec<McpServer>, McpConfigError> {
        servers(
            serde_json::from_str(json).map_err(|source| JsonFileError::Parse {
                path: "-".into(),
                source,
            })?,
        )
    }

    #[test]
    fn a_stdio_and_an_http_server() {
        let servers = parse(
            r#"{"mcpServers": {
                "files": {"command": "python3", "args": ["s.py"], "env": {"A": "1"}, "timeout_ms": 500},
                "search": {"url": "http://127.0.0.1:1/mcp", "headers": {"x-key": "k"}}
            }}"#,
        )
        .expect("valid");
        assert_eq!(servers.len(), 2);
        assert_eq!(servers[0].name, "files");
        assert_eq!(servers[0].timeout, Duration::from_millis(500));
        assert!(
            matches!(&servers[0].transport, Transport::Stdio { command, .. } if command == "python3")
        );
        assert!(
            matches!(&servers[1].transport, Transport::Http { headers, .. } if headers["x-key"] == "k")
        );
        assert_eq!(
            servers[1].timeout,
            Duration::from_millis(DEFAULT_TOOL_TIMEOUT_MS)
        );
    }

    #[test]
    fn unusable_declarations_are_named() {
        for bad in [
            r#"{"servers": {"a.b": {"command": "x"}}}"#,
            r#"{"servers": {"a": {}}}"#,
            r#"{"servers": {"a": {"command": "x", "url": "http://h/"}}}"#,
            r#"{"servers": {"a": {"url": "https://h/"}}}"#,
            r#"{"servers": {"a": {"url": "http://h/", "args": ["x"]}}}"#,
            r#"{"servers": {"a": {"command": "x", "headers": {"k": "v"}}}}"#,
            r#"{"servers": {"a": {"command": "x", "timeout_ms": 0}}}"#,
            r#"{"servers": {"a": {"url": "http://h/", "headers": {"bad name": "v"}}}}"#,
        ] {
            assert!(
                matches!(parse(bad), Err(McpConfigError::Invalid { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            parse(r#"{"servers": {"a": {"command": "x", "colour": 1}}}"#),
            Err(McpConfigError::File(JsonFileError::Parse { .. }))
        ));
    }
}
