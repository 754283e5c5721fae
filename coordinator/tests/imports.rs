//! The coordinator's modules import each other one way: no two of them import each
//! other, directly or in a loop. Reads `src/` and lists every loop it finds (the groups
//! of modules that reach each other), so a change that closes one fails here first.
//!
//! A module's imports are its `crate::<module>` paths, `use crate::{a, b::c}` groups
//! included, outside its `#[cfg(test)]` tests and its comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module of `src/` (crate roots left out) and the modules it imports.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let entries = std::fs::read_dir(src).unwrap_or_else(|e| panic!("reading {src:?}: {e}"));
    let mut sources = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if module == "lib" || module == "main" {
            continue;
        }
        let text =
            std::fs::read_to_string(entry.path()).unwrap_or_else(|e| panic!("reading {name}: {e}"));
        sources.insert(module.to_string(), code_of(&text));
    }
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    sources
        .iter()
        .map(|(module, code)| {
            let used = referenced(code)
                .into_iter()
                .filter(|m| m != module && modules.contains(m))
                .collect();
            (module.clone(), used)
        })
        .collect()
}

/// `text` without its `#[cfg(test)] mod tests` and its line comments.
fn code_of(text: &str) -> String {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    text.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first segment of every `crate::` path in `code`, groups unfolded.
fn referenced(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let head = item.trim().split("::").next().unwrap_or_default();
                found.insert(ident(head));
            }
        } else {
            found.insert(ident(rest));
        }
    }
    found
}

/// The identifier `text` starts with.
fn ident(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The groups of two or more modules that reach each other (Tarjan's strongly
/// connected components).
fn loops(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.found.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn no_two_coordinator_modules_import_each_other_directly_or_in_a_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = imports(&src);
    assert!(graph.len() > 20, "too few modules read from {src:?}");
    assert!(
        graph["intake"].contains("admission"),
        "imports not read: {:?}",
        graph["intake"]
    );
    let found = loops(&graph);
    assert!(found.is_empty(), "modules importing each other: {found:?}");
}

#[test]
fn a_loop_of_three_modules_is_found() {
    let edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")];
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in edges {
        graph.entry(from.into()).or_default().insert(to.into());
        graph.entry(to.into()).or_default();
    }
    assert_eq!(loops(&graph), vec![vec!["a", "b", "c"]]);
}

#[test]
fn grouped_and_nested_paths_count_as_imports() {
    let code = code_of(
        "use crate::{results, sharing::dispatch};\nlet x = crate::fault::point(); // crate::narrate\n",
    );
    let found: Vec<String> = referenced(&code).into_iter().collect();
    assert_eq!(found, ["fault", "results", "sharing"]);
}
