//! Tool packs the worker binary can host, chosen by name (`TOOLFLEET_PACKS=demo,test`).

pub mod crm;
pub mod testing;

use crate::tool::Tool;

/// Pack names the binary knows.
pub const PACKS: &[&str] = &["demo", "test"];

/// The tools of the named packs.
pub fn tools_for(packs: &[&str]) -> Result<Vec<Tool>, String> {
    let mut tools = Vec::new();
    for pack in packs {
        match pack.trim() {
            "demo" | "crm" => tools.extend(crm::tools()),
            "test" => tools.extend(testing::tools()),
            "" => {}
            other => return Err(format!("unknown tool pack {other:?} (known: {PACKS:?})")),
        }
    }
    Ok(tools)
}
