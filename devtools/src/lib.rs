//! The library half of `toolfleet-dev`, what the integration tests drive in-process as
//! well as the benchmark and the chaos run:
//!
//! | module | what lives there |
//! |---|---|
//! | [`cluster`] | local NATS and Redis clusters with their faults (kill, restart, `iptables` partitions) |
//! | [`upstream`] | a scripted OpenAI-compatible model server for the gateway's chat completions |
//!
//! Nothing here is part of a fleet or of the `toolfleet` command users install.

pub mod cluster;
pub mod upstream;
