//! The documents a user reads: the README stays short, its results summary is the one
//! `flatpeak report --markdown docs/results.md` wrote, and no document or doc comment links
//! outside the repository.

use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the repository root").to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The text between the summary markers (the ones `flatpeak_bench::report::SUMMARY_MARKERS`
/// writes), markers included.
fn summary(text: &str, what: &str) -> String {
    let (begin, end) = ("<!-- summary:begin -->", "<!-- summary:end -->");
    let start = text.find(begin).unwrap_or_else(|| panic!("{what} has no `{begin}`"));
    let stop = text[start..].find(end).unwrap_or_else(|| panic!("{what} has no `{end}`")) + start;
    text[start..stop + end.len()].to_string()
}

#[test]
fn the_readme_is_short_and_its_summary_is_the_generated_one() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= 400, "README.md has {lines} lines (at most 400: details go under docs/)");
    let results = read(&root().join("docs/results.md"));
    assert!(
        results.starts_with("# flatpeak: measured results"),
        "docs/results.md is not the report's document"
    );
    let (ours, generated) = (summary(&readme, "README.md"), summary(&results, "docs/results.md"));
    assert!(generated.lines().count() > 3, "docs/results.md's summary has no rows");
    assert_eq!(ours, generated, "README.md's summary differs from docs/results.md's: copy it from there");
}

/// Markdown link targets `](target)` of `text` that are relative paths (no scheme, no anchor
/// only).
fn relative_links(text: &str) -> Vec<String> {
    text.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &text[at + 2..];
            let target = &rest[..rest.find(')')?];
            let target = target.split('#').next().unwrap_or_default();
            let external = target.contains("://") || target.starts_with("mailto:");
            (!external && !target.is_empty()).then(|| target.to_string())
        })
        .collect()
}

/// `path` with `.` and `..` folded, or `None` when `..` climbs above its start.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// Every file under `dir` with one of `extensions`, skipping build output and tool folders.
fn files(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if path.is_dir() {
            let skip = name.starts_with('.')
                || ["target", "corpus", "artifacts", "node_modules"].contains(&name.as_str());
            if !skip {
                files(&path, extensions, out);
            }
        } else if extensions.iter().any(|e| name.ends_with(e)) {
            out.push(path);
        }
    }
}

#[test]
fn no_document_or_doc_comment_links_outside_the_repository() {
    let root = root();
    let mut docs = Vec::new();
    files(&root, &[".md"], &mut docs);
    assert!(docs.len() >= 5, "found only {docs:?}");
    let mut bad = Vec::new();
    for doc in &docs {
        let text = read(doc);
        let rel = doc.strip_prefix(&root).unwrap_or(doc);
        for target in relative_links(&text) {
            let dir = rel.parent().unwrap_or(Path::new(""));
            match normalize(&dir.join(&target)) {
                Some(p) if root.join(&p).exists() => {}
                _ => bad
                    .push(format!("{}: link `{target}` leaves the repository or is missing", rel.display())),
            }
        }
    }
    let mut sources = Vec::new();
    files(&root, &[".rs", ".md", ".cu", ".py", ".sh", ".toml"], &mut sources);
    // Spelled in pieces, so this file does not name them itself.
    let shared = concat!("sha", "red");
    let design = concat!("DES", "IGN");
    let outside = [
        format!("../{shared}"),
        format!("{shared}/{design}"),
        format!("{design}.md"),
        format!("{shared}/research"),
    ];
    for src in &sources {
        let text = read(src);
        for pattern in &outside {
            if text.contains(pattern.as_str()) {
                bad.push(format!("{}: names `{pattern}`, outside the repository", src.display()));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
