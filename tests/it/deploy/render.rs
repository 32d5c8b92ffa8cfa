//! Running helm and the other tools from the repository's root, and reading what the chart
//! renders: the helpers every room of the deploy tests shares, kept in a leaf so each room
//! names them without the others.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::helpers::{infra, unique};

pub(super) const KUBERNETES_VERSION: &str = "1.31.0";

pub(super) fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub(super) fn chart() -> PathBuf {
    root().join("deploy/helm/replyd")
}

pub(super) fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"))
}

pub(super) fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `helm template` with `values` files and `--set` pairs.
pub(super) fn render(values: &[&str], set: &[&str]) -> Output {
    let chart = chart();
    let mut args = vec![
        "template",
        "replyd",
        chart.to_str().unwrap(),
        "--namespace",
        "replyd",
        "--kube-version",
        KUBERNETES_VERSION,
    ];
    for file in values {
        args.extend(["-f", file]);
    }
    for pair in set {
        args.extend(["--set", pair]);
    }
    run(&infra("HELM"), &args)
}

pub(super) const PRODUCTION: &str = "deploy/helm/replyd/ci/production-values.yaml";

/// The example values files the chart ships (`ci/*.yaml`), relative to the repository.
pub(super) fn example_values() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(chart().join("ci"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".yaml"))
        .map(|name| format!("deploy/helm/replyd/ci/{name}"))
        .collect();
    files.sort();
    assert!(files.iter().any(|f| f == PRODUCTION), "{files:?}");
    files
}

/// The rendered value sets: default, the one-process install, and every example values file
/// (named by its file, `production` for the production-like one).
pub(super) fn renderings() -> Vec<(String, String)> {
    let mut sets = vec![
        ("default".to_owned(), render(&[], &[])),
        ("serve".to_owned(), render(&[], &["mode=serve"])),
    ];
    for file in example_values() {
        let name = if file == PRODUCTION {
            "production".to_owned()
        } else {
            file.rsplit('/')
                .next()
                .unwrap()
                .trim_end_matches(".yaml")
                .to_owned()
        };
        sets.push((name, render(&[&file], &[])));
    }
    sets.into_iter()
        .map(|(name, out)| {
            assert!(
                out.status.success(),
                "helm template ({name}): {}",
                text(&out)
            );
            (name, String::from_utf8(out.stdout).unwrap())
        })
        .collect()
}

pub(super) fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(unique("deploy"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The example values file that scales through prometheus-adapter instead of KEDA.
pub(super) const ADAPTER: &str = "deploy/helm/replyd/ci/prometheus-adapter-values.yaml";

/// Every object of a rendering.
pub(super) fn documents(rendered: &str) -> Vec<yaml_serde::Value> {
    use serde::Deserialize as _;
    yaml_serde::Deserializer::from_str(rendered)
        .map(|doc| yaml_serde::Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// The objects of `kind` in a rendering.
pub(super) fn of_kind<'a>(docs: &'a [yaml_serde::Value], kind: &str) -> Vec<&'a yaml_serde::Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// `helm template` of `values` files and `set` pairs, which must succeed, as objects.
pub(super) fn rendered(values: &[&str], set: &[&str]) -> Vec<yaml_serde::Value> {
    let out = render(values, set);
    assert!(out.status.success(), "{values:?} {set:?}: {}", text(&out));
    documents(&String::from_utf8(out.stdout).unwrap())
}

pub(super) fn str_of(value: &yaml_serde::Value) -> &str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("a string: {value:?}"))
}

/// The rendered object of `kind` named `name`.
pub(super) fn object<'a>(
    docs: &'a [yaml_serde::Value],
    kind: &str,
    name: &str,
) -> &'a yaml_serde::Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind}/{name}"))
}

/// The `replyd.toml` of the rendered ConfigMap.
pub(super) fn config_of(manifests: &str) -> String {
    let start = manifests
        .find("  replyd.toml: |\n")
        .expect("the ConfigMap holds replyd.toml");
    manifests[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}
