//! `use toolfleet_worker::prelude::*;` brings what a tool file needs: the `#[tool]`
//! attribute, the `ToolError` derive (the same name as the type: one import brings both), [`serve`](crate::serve), the tool types, the serde and schemars derives and
//! `json!`. The derives still need `serde` and `schemars` among the crate's own
//! dependencies (their generated code names those crates). Re-exports only.

pub use crate::{serve, tool, Tool, ToolContext, ToolError, ToolOutput, WorkerConfig};
pub use schemars::JsonSchema;
pub use serde::{Deserialize, Serialize};
pub use serde_json::json;
pub use tokio_util::sync::CancellationToken;
