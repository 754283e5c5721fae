//! The library half of the `toolfleet` command: what tests drive in-process as well as
//! from the command line. Today that is [`conformance`], the protocol check of a worker
//! in any language; everything else of the command lives in the binary (`main.rs`).

pub mod conformance;
