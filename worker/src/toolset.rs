//! [`ToolSet`]: the tools a worker serves, as a handle that may change them while the
//! worker runs (tools that come from elsewhere at run time: an MCP server's list, a
//! plug-in directory).
//!
//! Owns the set only; it never serves anything. [`crate::run_set`] watches it and, on
//! each change, starts serving added tools (consumer, pull loop, registration), stops
//! removed ones (their liveness entries withdrawn, so the coordinators refuse the tool
//! with `no_live_worker` while no worker serves it) and hands replaced ones to their
//! running loop (consumer settings brought in line with the new definition). Changes
//! made in quick succession are applied together, as the latest state.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::watch;

use crate::tool::Tool;

/// The tools of a worker by name; cheap to clone, every clone the same set.
#[derive(Debug, Clone)]
pub struct ToolSet {
    tools: Arc<watch::Sender<BTreeMap<String, Tool>>>,
}

impl ToolSet {
    /// A set holding `tools` (a later tool replaces an earlier one of the same name).
    pub fn new(tools: impl IntoIterator<Item = Tool>) -> Self {
        let tools = tools
            .into_iter()
            .map(|t| (t.definition().name.clone(), t))
            .collect();
        Self {
            tools: Arc::new(watch::Sender::new(tools)),
        }
    }

    /// Adds `tool`, or replaces the tool of the same name.
    pub fn insert(&self, tool: Tool) {
        self.update(|tools| {
            tools.insert(tool.definition().name.clone(), tool);
        });
    }

    /// Removes the tool named `name`; whether it was there.
    pub fn remove(&self, name: &str) -> bool {
        let mut removed = false;
        self.update(|tools| removed = tools.remove(name).is_some());
        removed
    }

    /// Changes the set in one step (the worker sees the result, never a half-done
    /// change): e.g. replace every tool of one source by its new list. A change that
    /// leaves every tool as it was wakes nobody.
    pub fn update(&self, change: impl FnOnce(&mut BTreeMap<String, Tool>)) {
        self.tools.send_if_modified(|tools| {
            let before: Vec<_> = tools.values().cloned().collect();
            change(tools);
            tools.len() != before.len()
                || tools
                    .values()
                    .zip(&before)
                    .any(|(now, was)| !now.same_as(was))
        });
    }

    /// The names of the tools in the set, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tools.borrow().keys().cloned().collect()
    }

    /// The tools in the set, sorted by name.
    pub fn tools(&self) -> Vec<Tool> {
        self.tools.borrow().values().cloned().collect()
    }

    /// A receiver that sees every change from now on.
    pub(crate) fn subscribe(&self) -> watch::Receiver<BTreeMap<String, Tool>> {
        self.tools.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_common::ToolDefinition;

    fn tool(name: &str) -> Tool {
        Tool::from_fn(ToolDefinition::new(name, "t"), |_, _| {
            Box::pin(async { Err(crate::ToolError::fatal("x", "x")) })
        })
    }

    #[tokio::test]
    async fn changes_wake_the_watcher_and_no_ops_do_not() {
        let set = ToolSet::new([tool("a.one")]);
        let mut seen = set.subscribe();
        seen.borrow_and_update();
        let same = set.tools();
        set.update(|tools| {
            tools.clear();
            tools.extend(same.into_iter().map(|t| (t.definition().name.clone(), t)));
        });
        assert!(!seen.has_changed().unwrap_or(true));
        set.insert(tool("a.two"));
        assert!(seen.has_changed().unwrap_or(false));
        assert_eq!(set.names(), ["a.one", "a.two"]);
        seen.borrow_and_update();
        assert!(set.remove("a.one"));
        assert!(!set.remove("a.one"));
        assert!(seen.has_changed().unwrap_or(false));
        // A new tool under an existing name is a change even with the same definition.
        seen.borrow_and_update();
        set.insert(tool("a.two"));
        assert!(seen.has_changed().unwrap_or(false));
    }
}
