//! The house has no import circle: within each crate of the workspace, no source file names an
//! item of a file that (directly or through others) names one of its own. Read from the `use`
//! lines and the paths in the code, as a newcomer reads them: a file is a room, `crate::a::b`,
//! `super::x` and a child module's name are arrows to the file that defines them. A parent that
//! only declares its children (`mod x;`) is not tied to them by that. Across crates Cargo itself
//! forbids a circle. `cargo test --test it house` runs this; a failure names every circle and
//! the arrows that close it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose sources are checked, by their source root.
const CRATES: &[&str] = &["src", "crates/core/src", "lab/src"];

#[test]
fn no_source_file_is_part_of_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut circles = Vec::new();
    for source_root in CRATES {
        let house = House::read(&root.join(source_root));
        assert!(
            house.rooms.len() > 5,
            "{source_root}: too few files read ({}): the walk is broken",
            house.rooms.len()
        );
        for circle in house.circles() {
            circles.push(format!("{source_root}: {}", house.describe(&circle)));
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// The service's binary holds none of the tools that try it from outside: they are
/// `replyd-lab`'s.
#[test]
fn the_service_binary_has_no_test_tool_command() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .arg("--help")
        .output()
        .expect("replyd runs");
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).expect("the help is text");
    assert!(
        help.lines()
            .any(|line| line.trim_start().starts_with("worker")),
        "the help lists no commands:\n{help}"
    );
    for tool in ["mock-provider", "produce", "browsers"] {
        assert!(
            !help.lines().any(|line| line.trim_start().starts_with(tool)),
            "`{tool}` is a command of the service binary:\n{help}"
        );
    }
}

/// A circle is found where one is built: the check reads a small crate with one.
#[test]
fn a_circle_between_two_files_is_found() {
    let dir = std::env::temp_dir().join(format!("house-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(dir.join("store")).unwrap();
    let files = [
        ("lib.rs", "pub mod config;\npub mod store;\npub mod leaf;\n"),
        (
            "config.rs",
            "use crate::store::parse_url;\npub struct DatabaseSettings;\n",
        ),
        (
            "store/mod.rs",
            "mod tasks;\nuse crate::config::DatabaseSettings;\npub fn parse_url() {}\n",
        ),
        (
            "store/tasks.rs",
            "use super::parse_url;\nuse crate::leaf::Leaf;\n",
        ),
        (
            "leaf.rs",
            "// use crate::config::DatabaseSettings; (a comment is no arrow)\npub struct Leaf;\n",
        ),
    ];
    for (path, text) in files {
        std::fs::write(dir.join(path), text).unwrap();
    }
    let house = House::read(&dir);
    let circles: Vec<String> = house.circles().iter().map(|c| house.describe(c)).collect();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert!(
        circles[0].starts_with("config.rs, store/mod.rs:"),
        "{}",
        circles[0]
    );
}

/// One crate's files and the arrows between them.
struct House {
    /// Each file by its module path (`["store", "tasks"]`), the crate root being `[]`.
    rooms: BTreeMap<Vec<String>, PathBuf>,
    /// From a file's module path to the module paths it names, with the names it took.
    arrows: BTreeMap<Vec<String>, BTreeMap<Vec<String>, BTreeSet<String>>>,
    root: PathBuf,
}

impl House {
    fn read(root: &Path) -> House {
        let mut rooms = BTreeMap::new();
        walk(root, root, &mut rooms);
        let mut house = House {
            rooms,
            arrows: BTreeMap::new(),
            root: root.to_path_buf(),
        };
        let modules: Vec<Vec<String>> = house.rooms.keys().cloned().collect();
        for module in modules {
            let text = std::fs::read_to_string(&house.rooms[&module]).unwrap();
            for path in paths_in(&in_file_scope(&code_only(&text))) {
                if let Some((target, name)) = house.resolve(&module, &path)
                    && target != module
                {
                    house
                        .arrows
                        .entry(module.clone())
                        .or_default()
                        .entry(target)
                        .or_default()
                        .insert(name);
                }
            }
        }
        house
    }

    /// The file a path names from `module`, and the name taken from it: the deepest module
    /// the path walks through. `None` for another crate's path or std's.
    fn resolve(&self, module: &[String], path: &[String]) -> Option<(Vec<String>, String)> {
        let (mut at, rest): (Vec<String>, &[String]) = match path.first()?.as_str() {
            "crate" => (Vec::new(), &path[1..]),
            "self" => (module.to_vec(), &path[1..]),
            "super" => {
                let mut at = module.to_vec();
                let mut rest = path;
                while rest.first().is_some_and(|s| s == "super") {
                    at.pop()?;
                    rest = &rest[1..];
                }
                (at, rest)
            }
            // A child module named without `self::` (`use tasks::X;` in `store/mod.rs`).
            first => {
                let mut child = module.to_vec();
                child.push(first.to_owned());
                if !self.rooms.contains_key(&child) {
                    return None;
                }
                (module.to_vec(), path)
            }
        };
        let mut name = String::from("*");
        for segment in rest {
            let mut deeper = at.clone();
            deeper.push(segment.clone());
            if self.rooms.contains_key(&deeper) {
                at = deeper;
            } else {
                name = segment.clone();
                break;
            }
        }
        Some((at, name))
    }

    /// The circles: the strongly connected groups of more than one file (Tarjan's algorithm).
    fn circles(&self) -> Vec<Vec<Vec<String>>> {
        struct Walk<'a> {
            house: &'a House,
            index: BTreeMap<&'a [String], usize>,
            low: BTreeMap<&'a [String], usize>,
            stack: Vec<&'a [String]>,
            on_stack: BTreeSet<&'a [String]>,
            found: Vec<Vec<Vec<String>>>,
        }
        fn visit<'a>(walk: &mut Walk<'a>, at: &'a [String]) {
            let n = walk.index.len();
            walk.index.insert(at, n);
            walk.low.insert(at, n);
            walk.stack.push(at);
            walk.on_stack.insert(at);
            if let Some(targets) = walk.house.arrows.get(at) {
                for target in targets.keys() {
                    let target = target.as_slice();
                    if !walk.index.contains_key(target) {
                        visit(walk, target);
                        let low = walk.low[target].min(walk.low[at]);
                        walk.low.insert(at, low);
                    } else if walk.on_stack.contains(target) {
                        let low = walk.index[target].min(walk.low[at]);
                        walk.low.insert(at, low);
                    }
                }
            }
            if walk.low[at] == walk.index[at] {
                let mut group = Vec::new();
                loop {
                    let member = walk.stack.pop().expect("the visited file is on the stack");
                    walk.on_stack.remove(member);
                    group.push(member.to_vec());
                    if member == at {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    walk.found.push(group);
                }
            }
        }
        let mut walk = Walk {
            house: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            found: Vec::new(),
        };
        for module in self.rooms.keys() {
            if !walk.index.contains_key(module.as_slice()) {
                visit(&mut walk, module);
            }
        }
        walk.found
    }

    /// A circle's files, then each arrow inside it with the names it takes.
    fn describe(&self, circle: &[Vec<String>]) -> String {
        let file = |m: &Vec<String>| {
            self.rooms[m]
                .strip_prefix(&self.root)
                .unwrap()
                .display()
                .to_string()
        };
        let files: Vec<String> = circle.iter().map(file).collect();
        let mut arrows = Vec::new();
        for from in circle {
            for (to, names) in self.arrows.get(from).into_iter().flatten() {
                if circle.contains(to) {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    arrows.push(format!(
                        "{} -> {} ({})",
                        file(from),
                        file(to),
                        names.join(", ")
                    ));
                }
            }
        }
        format!("{}: {}", files.join(", "), arrows.join("; "))
    }
}

/// Every `.rs` file under `dir`, by its module path from `root`.
fn walk(root: &Path, dir: &Path, rooms: &mut BTreeMap<Vec<String>, PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(root, &path, rooms);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let relative = path.strip_prefix(root).unwrap().with_extension("");
        let mut module: Vec<String> = relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        // `lib.rs` and `main.rs` are the crate root; `x/mod.rs` is `x`.
        if module.len() == 1 && (module[0] == "lib" || module[0] == "main") {
            module.clear();
        } else if module.last().is_some_and(|m| m == "mod") {
            module.pop();
        }
        // A binary's `main.rs` beside `lib.rs` is a crate of its own: only the library is read.
        if module.is_empty()
            && path.file_name().is_some_and(|f| f == "main.rs")
            && dir.join("lib.rs").exists()
        {
            continue;
        }
        rooms.insert(module, path);
    }
}

/// The text without comments (line and block) and string literals, so a path in a doc comment
/// or a message is no arrow.
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match (chars[i], chars.get(i + 1)) {
            ('/', Some('/')) => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ('/', Some('*')) => {
                while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            // A raw string (`r#"..."#`, the SQL): skipped to its closing quote and hashes.
            ('r', Some('#')) if chars.get(i + 2) == Some(&'"') => {
                i += 3;
                while i + 1 < chars.len() && !(chars[i] == '"' && chars[i + 1] == '#') {
                    i += 1;
                }
                i += 2;
                out.push_str("\"\"");
            }
            ('"', _) => {
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A char literal such as '"' or '{': skipped whole (a lifetime has no closing quote).
            ('\'', _) if chars.get(i + 2) == Some(&'\'') || chars.get(i + 1) == Some(&'\\') => {
                let end = chars[i + 1..]
                    .iter()
                    .position(|&c| c == '\'')
                    .map(|p| i + 1 + p);
                i = end.map_or(i + 1, |e| e + 1);
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// The code with its inline test module's paths said from the file's own module: inside
/// `mod tests { .. }`, `super::` is the file and `super::super::` its parent.
fn in_file_scope(code: &str) -> String {
    let Some(start) = code.find("#[cfg(test)]\nmod tests {") else {
        return code.to_owned();
    };
    let tests = code[start..]
        .replace("super::super::", "\u{0}")
        .replace("super::", "self::")
        .replace('\u{0}', "super::");
    format!("{}{tests}", &code[..start])
}

/// The module paths in code: every `a::b::c` run of identifiers (a `use` tree's braces
/// expanded, one path per leaf), each as its segments.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut paths = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !ident(bytes[i]) || (i > 0 && (ident(bytes[i - 1]) || bytes[i - 1] == b':')) {
            i += 1;
            continue;
        }
        let (prefix, end) = read_path(code, i);
        if code[end..].starts_with("::{") {
            for leaf in use_tree(code, end + 2) {
                let mut path = prefix.clone();
                path.extend(leaf);
                paths.push(path);
            }
        } else if prefix.len() > 1 {
            paths.push(prefix);
        }
        i = end.max(i + 1);
    }
    paths
}

/// The identifiers of `a::b::c` starting at `start`, and where the run ends.
fn read_path(code: &str, start: usize) -> (Vec<String>, usize) {
    let bytes = code.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut segments = Vec::new();
    let mut i = start;
    loop {
        let begin = i;
        while i < bytes.len() && ident(bytes[i]) {
            i += 1;
        }
        if i == begin {
            break;
        }
        segments.push(code[begin..i].to_owned());
        if code[i..].starts_with("::")
            && code[i + 2..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
        {
            i += 2;
        } else {
            break;
        }
    }
    (segments, i)
}

/// The leaves of a `use` tree's braces opening at `open` (`{a, b::{c, d}, e::f}`), each as
/// its segments.
fn use_tree(code: &str, open: usize) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut leaves = Vec::new();
    let mut i = open + 1;
    loop {
        while i < bytes.len() && (bytes[i] == b',' || bytes[i].is_ascii_whitespace()) {
            i += 1;
        }
        if i >= bytes.len() || bytes[i] == b'}' {
            break;
        }
        let (segments, end) = read_path(code, i);
        if segments.is_empty() {
            // `*` or something this reading does not follow: skip to the next item.
            i += 1;
            continue;
        }
        if code[end..].starts_with("::{") {
            let inner_open = end + 2;
            for leaf in use_tree(code, inner_open) {
                let mut path = segments.clone();
                path.extend(leaf);
                leaves.push(path);
            }
            i = matching_brace(code, inner_open) + 1;
        } else {
            leaves.push(segments);
            i = end;
            // `as name`: the rest of the item is not a path.
            while i < bytes.len() && bytes[i] != b',' && bytes[i] != b'}' {
                i += 1;
            }
        }
    }
    leaves
}

fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0;
    for (i, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + i;
                }
            }
            _ => {}
        }
    }
    code.len()
}
