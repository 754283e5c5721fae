//! The library half of the `toolfleet` command: what tests drive in-process as well as
//! from the command line: [`conformance`], the protocol check of a worker in any
//! language, and [`cluster`], local NATS and Redis clusters with their faults; everything else of the command lives in the binary (`main.rs`).

pub mod cluster;
pub mod conformance;
