//! The library half of the `toolfleet` command, what tests and the developer tools
//! (`toolfleet-dev`) drive in-process as well as from the command line:
//!
//! | module | what lives there |
//! |---|---|
//! | [`conformance`] | `toolfleet conformance`: a worker of any language checked against PROTOCOL §7 |
//! | [`local`] | a local fleet: servers started when none answer, coordinator and worker in-process, the gateway as a child process |
//! | [`process`] | the global flags naming the fleet, telemetry around a command (`toolfleet` and `toolfleet-dev`) |
//! | [`node`] | one coordinator or worker in this process, as the hidden commands run them |
//!
//! Everything else of the command (its flags, the terminal rendering, `admin`) lives in
//! the binary (`main.rs`).

pub mod conformance;
pub mod local;
pub mod node;
pub mod process;
