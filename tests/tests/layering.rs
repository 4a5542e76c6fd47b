//! No circle of imports between the files of any crate of the workspace (the library crates,
//! the facade, the benches and both bindings): each file is a module, and a
//! file's `crate::`, `super::` and `self::` paths (in `use` trees and inline) are edges to the
//! deepest module file they name. A module's edges to its own descendants are not counted (a
//! `mod.rs` declaring and re-exporting its children), nor test modules (`#[cfg(test)] mod
//! tests`, `tests.rs`), nor comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path inside its crate: `[]` for `lib.rs`, `["cpu"]` for `cpu/mod.rs` or `cpu.rs`.
type Module = Vec<String>;

/// The module a source file under `src/` defines, or `None` for test modules and binaries.
fn module_of(relative: &Path) -> Option<Module> {
    let parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let (file, dirs) = parts.split_last()?;
    if file == "tests.rs" || dirs.iter().any(|d| d == "tests" || d == "bin") || file == "main.rs" {
        return None;
    }
    let stem = file.strip_suffix(".rs")?;
    let mut module: Module = dirs.to_vec();
    if stem != "mod" && stem != "lib" {
        module.push(stem.to_string());
    }
    Some(module)
}

/// The source without comments and without its trailing `#[cfg(test)] mod tests`.
fn code_of(source: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let mut end = lines.len();
    for (i, line) in lines.iter().enumerate() {
        let next = lines[i + 1..].iter().find(|l| !l.trim().is_empty()).map(|l| l.trim());
        if line.trim() == "#[cfg(test)]" && next.is_some_and(|n| n.starts_with("mod tests")) {
            end = i;
            break;
        }
    }
    lines[..end]
        .iter()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path of a `use` tree (`a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`).
fn expand_use_tree(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap_or(&tree).to_string()];
    };
    let prefix = &tree[..open];
    let inner = tree[open + 1..].strip_suffix('}').unwrap_or(&tree[open + 1..]);
    // Split the group at its top-level commas.
    let (mut depth, mut start, mut items) = (0usize, 0usize, Vec::new());
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    items
        .into_iter()
        .filter(|item| !item.is_empty())
        .flat_map(|item| match item {
            "self" => vec![prefix.trim_end_matches("::").to_string()],
            _ => expand_use_tree(&format!("{prefix}{item}")),
        })
        .collect()
}

/// The `crate::`/`super::`/`self::` paths `code` names, in `use` trees and inline.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let boundary = at == 0 || !rest[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        let tail = &rest[at + 4..];
        match (boundary, tail.find(';')) {
            (true, Some(end)) => {
                paths.extend(expand_use_tree(&tail[..end]));
                rest = &tail[end..];
            }
            _ => rest = tail,
        }
    }
    // Inline paths: `crate::a::b(...)`, `super::x::Y`.
    for root in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(root) {
            // Not the tail of a longer path (`super::super::x`, `foo::crate_x`).
            let tail_of_path = code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':');
            if !tail_of_path {
                let path: String = code[at..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let path = path.trim_end_matches(':');
                // `crate::{…}` opens a `use` tree, read above.
                if path.contains("::") {
                    paths.push(path.to_string());
                }
            }
        }
    }
    paths
        .into_iter()
        .map(|p| p.split("::").map(str::to_string).collect::<Vec<_>>())
        .filter(|p| matches!(p.first().map(String::as_str), Some("crate" | "super" | "self")))
        .collect()
}

/// The deepest module of `modules` that `path`, written in `from`, names.
fn resolve(from: &Module, path: &[String], modules: &BTreeSet<Module>) -> Option<Module> {
    // `super` is the parent of the file's module (`a/mod.rs` and `a.rs` are both module `a`);
    // `self` is the module itself.
    let mut base: Module = match path.first()?.as_str() {
        "crate" => Vec::new(),
        _ => from.clone(),
    };
    let mut segments = path.iter().skip(1).peekable();
    if path[0] == "super" {
        base.pop()?;
        while segments.peek().is_some_and(|s| s.as_str() == "super") {
            segments.next();
            base.pop()?;
        }
    }
    let mut target = base.clone();
    let mut deepest = modules.contains(&base).then(|| base.clone());
    for segment in segments {
        target.push(segment.clone());
        if modules.contains(&target) {
            deepest = Some(target.clone());
        }
    }
    deepest
}

/// The import edges between the modules of one crate's files (`(relative path, source)`).
fn import_graph(files: &[(PathBuf, String)]) -> BTreeMap<Module, BTreeSet<Module>> {
    let parsed: Vec<(Module, String)> =
        files.iter().filter_map(|(path, source)| Some((module_of(path)?, code_of(source)))).collect();
    let modules: BTreeSet<Module> = parsed.iter().map(|(m, _)| m.clone()).collect();
    let mut graph: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, code) in &parsed {
        let edges = graph.entry(module.clone()).or_default();
        for path in paths_in(code) {
            let Some(target) = resolve(module, &path, &modules) else { continue };
            // A module's own descendants (its children, re-exported) are not an import back.
            if !target.starts_with(module) {
                edges.insert(target);
            }
        }
    }
    graph
}

/// The sets of two or more modules that import each other, through any chain.
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<BTreeSet<Module>> {
    let reach = |from: &Module| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for next in graph.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&Module, BTreeSet<Module>> = graph.keys().map(|m| (m, reach(m))).collect();
    let mut found: Vec<BTreeSet<Module>> = Vec::new();
    for (m, from_m) in &reachable {
        let circle: BTreeSet<Module> = from_m
            .iter()
            .filter(|other| reachable.get(other).is_some_and(|r| r.contains(*m)))
            .cloned()
            .chain(std::iter::once((*m).clone()))
            .collect();
        if circle.len() > 1 && !found.contains(&circle) {
            found.push(circle);
        }
    }
    found
}

fn sources(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir").map(|e| e.expect("entry").path()) {
            if entry.is_dir() {
                dirs.push(entry);
            } else if entry.extension().is_some_and(|e| e == "rs") {
                let source = std::fs::read_to_string(&entry).expect("read");
                out.push((entry.strip_prefix(root).expect("under root").to_path_buf(), source));
            }
        }
    }
    out
}

/// Every crate of the workspace that has a `src/`: the library crates, the facade, the benches,
/// the test helpers and both bindings (the Python extension and the candle integration).
const CRATES: [&str; 10] = [
    "common",
    "llep",
    "ring-dtp",
    "sco",
    "stream-adamw",
    "flatpeak",
    "benches",
    "tests",
    "python",
    "integrations/candle",
];

#[test]
fn no_crate_has_a_circle_of_imports_between_its_files() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut report = Vec::new();
    for krate in CRATES {
        let files = sources(&workspace.join(krate).join("src"));
        assert!(!files.is_empty(), "{krate}: its sources were found");
        let graph = import_graph(&files);
        let edges = graph.values().map(BTreeSet::len).sum::<usize>();
        assert!(files.len() < 3 || edges > 0, "{krate}: imports were found");
        for circle in circles(&graph) {
            let names: Vec<String> = circle.iter().map(|m| format!("{krate}::{}", m.join("::"))).collect();
            report.push(names.join(" <-> "));
        }
    }
    assert!(report.is_empty(), "circles of imports:\n{}", report.join("\n"));
}

#[test]
fn the_checker_finds_a_circle_and_ignores_children_tests_and_comments() {
    let file = |path: &str, source: &str| (PathBuf::from(path), source.to_string());
    let files = [
        file("lib.rs", "mod a;\nmod b;\npub use a::Thing;\n"),
        file("a/mod.rs", "mod inner;\npub use inner::Thing;\nuse crate::b::{self, helper};\n"),
        file("a/inner.rs", "use super::super::b::Other;\n// use crate::c::Never;\n"),
        file(
            "b.rs",
            "fn f() { crate::a::inner::Thing::new(); }\n#[cfg(test)]\nmod tests {\n    use crate::c::X;\n}\n",
        ),
        file("c.rs", "use crate::{a::Thing, b};\n"),
        file("c/tests.rs", "use crate::a;\n"),
    ];
    let graph = import_graph(&files);
    let m = |s: &str| -> Module { s.split('/').filter(|p| !p.is_empty()).map(str::to_string).collect() };
    assert_eq!(graph[&m("")], BTreeSet::new(), "the root's edges to its children are not counted");
    assert_eq!(graph[&m("a")], [m("b")].into_iter().collect());
    assert_eq!(graph[&m("a/inner")], [m("b")].into_iter().collect());
    assert_eq!(graph[&m("b")], [m("a/inner")].into_iter().collect(), "the test module's import is left out");
    assert_eq!(graph[&m("c")], [m("a"), m("b")].into_iter().collect());
    let found = circles(&graph);
    assert_eq!(found, vec![[m("a/inner"), m("b")].into_iter().collect::<BTreeSet<_>>()]);
}
