//! # toolfleet-decision
//!
//! What a party that talks to a model needs and a worker never does: reading the model's
//! decision (OpenAI Chat, OpenAI Responses, Anthropic, the simple form and the `parallel`
//! meta-tool) into tool calls, composing the acknowledgement spoken while they run, and
//! rendering the joined results as history the model reads next.
//!
//! Pure functions over JSON: this crate never does I/O, never talks to NATS or Redis, and
//! never decides whether a call may run (the coordinator's validation does).
//!
//! | module | what lives there |
//! |---|---|
//! | [`parse`] | `parse_decision`: every supported decision shape into `Decision` |
//! | [`ack`] | `compose_acknowledgement` from the tools' waiting hints |
//! | [`history`] | `render_history`: results as OpenAI and Anthropic history |

pub mod ack;
pub mod history;
pub mod parse;

pub use ack::compose_acknowledgement;
pub use history::render_history;
pub use parse::{
    parse_decision, Decision, DecisionCall, DecisionError, DecisionErrorKind, ToolCallsDecision,
};
