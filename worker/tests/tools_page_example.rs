//! docs/TOOLS.md's "Writing a tool" shows `examples/writing_a_tool.rs` verbatim, so the
//! example that `cargo check --examples` compiles is the one readers copy. This test
//! owns that check only; it must never start a worker.

#[test]
fn the_tools_page_shows_the_example_verbatim() {
    let page = include_str!("../../docs/TOOLS.md");
    let example = include_str!("../examples/writing_a_tool.rs");
    let block = format!("```rust\n{example}```\n");
    assert!(
        page.contains(&block),
        "docs/TOOLS.md's \"Writing a tool\" must show worker/examples/writing_a_tool.rs verbatim"
    );
}
