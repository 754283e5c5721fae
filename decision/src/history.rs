//! Rendering a turn's results as history: the rule is part of the wire protocol, so it
//! lives in `toolfleet_common::history` (a frontend renders the same history from a
//! `final` whose history was left out); re-exported here.

pub use toolfleet_common::history::*;
