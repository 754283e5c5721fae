//! The README's "Writing a tool" shows `examples/writing_a_tool.rs` verbatim, so the
//! example that `cargo check --examples` compiles is the one readers copy. This test
//! owns that check only; it must never start a worker.

#[test]
fn the_readme_shows_the_example_verbatim() {
    let readme = include_str!("../../README.md");
    let example = include_str!("../examples/writing_a_tool.rs");
    let block = format!("```rust\n{example}```\n");
    assert!(
        readme.contains(&block),
        "README.md's \"Writing a tool\" must show worker/examples/writing_a_tool.rs verbatim"
    );
}
