//! The library half of the `toolfleet` command: what tests drive in-process as well as
//! from the command line: [`conformance`], the protocol check of a worker in any
//! language, [`cluster`], local NATS and Redis clusters with their faults, and
//! [`upstream`], a scripted model server for the gateway's chat completions; everything
//! else of the command lives in the binary (`main.rs`).

pub mod cluster;
pub mod conformance;
pub mod upstream;
