//! Reading the settings: the file, then `REPLYD_*` variables, into the typed tree, with every
//! problem of the sources in one report: unknown keys (with the nearest known one and where
//! each came from), values of the wrong type (each one, not only the first), then the tree's
//! own contradictions ([`Settings::validate`]'s rules).

use std::path::Path;

use figment::providers::{Env, Format, Toml};
use figment::{Figment, Provider as _};

use super::{ConfigError, Dict, ENV_PREFIX, FREE_FORM, Problem, Settings, Value, problem};

impl Settings {
    /// Reads `file` (if given) and then `REPLYD_*` variables (`__` separates levels), and
    /// validates the result. Every problem is reported at once.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::new();
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError(vec![problem(
                    "--config",
                    format!("{} does not exist", file.display()),
                )]));
            }
            figment = figment.merge(Toml::file(file));
        }
        // Only nested keys (`REPLYD_KAFKA__TOPIC`) are settings; other `REPLYD_*` variables
        // (`REPLYD_LOG_JSON` for the CLI, the infra script's) are not ours to refuse.
        figment = figment.merge(
            Env::prefixed(ENV_PREFIX)
                .filter(|key| key.as_str().contains("__"))
                .split("__"),
        );
        Self::from_figment(&figment)
    }

    /// Settings from TOML text alone (tests, tools), checked like [`Settings::load`].
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_figment(&Figment::from(Toml::string(text)))
    }

    /// Extracts and validates: unknown keys (with the nearest known one), values of the wrong
    /// type (each one, not only the first) and contradictions, all in one report.
    pub fn from_figment(figment: &Figment) -> Result<Self, ConfigError> {
        let mut given = match figment.data() {
            Ok(mut profiles) => profiles
                .remove(&figment::Profile::Default)
                .unwrap_or_default(),
            Err(e) => return Err(ConfigError(figment_problems(e, figment))),
        };
        let known = serde_json::to_value(Settings::default())
            .expect("the settings tree serializes: plain fields only");
        let mut problems = Vec::new();
        let mut unknown = Vec::new();
        unknown_keys(&given, &known, "", &mut unknown);
        for path in &unknown {
            remove_path(&mut given, path);
            let mut message = format!("unknown setting{}", source_of(figment, path));
            if let Some(near) = nearest_key(path, &known) {
                message.push_str(&format!("; did you mean `{near}`?"));
            }
            problems.push(problem(path.clone(), message));
        }
        // serde stops at the first bad value; take it out and try again, so every bad value
        // is named in one run. Bounded by the number of keys given.
        let mut settings = None;
        for _ in 0..=count_keys(&given) {
            match Figment::from(figment::providers::Serialized::defaults(&given))
                .extract::<Settings>()
            {
                Ok(s) => {
                    settings = Some(s);
                    break;
                }
                Err(errors) => {
                    let mut removed = false;
                    for e in errors {
                        let path = e.path.join(".");
                        problems.push(problem(
                            if path.is_empty() {
                                "settings".into()
                            } else {
                                path.clone()
                            },
                            format!("{}{}", e.kind, source_of(figment, &path)),
                        ));
                        removed |= !path.is_empty() && remove_path(&mut given, &path);
                    }
                    if !removed {
                        break;
                    }
                }
            }
        }
        if let Some(settings) = &settings {
            problems.extend(settings.problems());
        }
        match settings {
            Some(settings) if problems.is_empty() => Ok(settings),
            _ => Err(ConfigError(problems)),
        }
    }
}

/// Figment's own errors (a file that does not parse) as problems.
fn figment_problems(errors: figment::Error, figment: &Figment) -> Vec<Problem> {
    errors
        .into_iter()
        .map(|e| {
            let path = e.path.join(".");
            problem(
                if path.is_empty() {
                    "--config".into()
                } else {
                    path.clone()
                },
                format!("{}{}", e.kind, source_of(figment, &path)),
            )
        })
        .collect()
}

/// ` (in FILE)` or ` (from REPLYD_A__B)`: where a key was given.
fn source_of(figment: &Figment, path: &str) -> String {
    if path.is_empty() {
        return String::new();
    }
    match figment.find_metadata(path) {
        Some(meta) if meta.name.contains("environment") => format!(
            " (from {ENV_PREFIX}{})",
            path.replace('.', "__").to_uppercase()
        ),
        Some(meta) => match &meta.source {
            Some(source) => format!(" (in {source})"),
            None => format!(" (in {})", meta.name),
        },
        None => String::new(),
    }
}

/// Paths of `given` that `known` (the default settings, serialized) has no field for.
fn unknown_keys(given: &Dict, known: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    for (key, value) in given {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match known.get(key) {
            None => out.push(path),
            Some(inner) if !FREE_FORM.contains(&path.as_str()) => {
                if let (Value::Dict(_, dict), serde_json::Value::Object(_)) = (value, inner) {
                    unknown_keys(dict, inner, &path, out);
                }
            }
            Some(_) => {}
        }
    }
}

/// The known setting nearest to an unknown `path`: a close spelling in the same section, or
/// the same name in another section (`worker.session_timeout_ms` → `kafka.session_timeout_ms`).
fn nearest_key(path: &str, known: &serde_json::Value) -> Option<String> {
    let mut all = Vec::new();
    collect_paths(known, "", &mut all);
    let (section, leaf) = path.rsplit_once('.').unwrap_or(("", path));
    let score = |candidate: &str| {
        let (c_section, c_leaf) = candidate.rsplit_once('.').unwrap_or(("", candidate));
        let leaf_score = strsim::jaro_winkler(leaf, c_leaf);
        let same_section = c_section == section;
        if same_section && leaf_score >= 0.85 {
            Some(leaf_score + 1.0)
        } else if c_leaf == leaf {
            Some(1.0)
        } else if strsim::jaro_winkler(path, candidate) >= 0.9 {
            Some(strsim::jaro_winkler(path, candidate))
        } else {
            None
        }
    };
    all.into_iter()
        .filter_map(|c| score(&c).map(|s| (s, c)))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

fn collect_paths(value: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_json::Value::Object(map) = value {
        for (key, inner) in map {
            let path = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            // Sections are suggestions too (`[wroker]` → `worker`).
            out.push(path.clone());
            if !FREE_FORM.contains(&path.as_str()) {
                collect_paths(inner, &path, out);
            }
        }
    }
}

fn remove_path(dict: &mut Dict, path: &str) -> bool {
    match path.split_once('.') {
        None => dict.remove(path).is_some(),
        Some((head, rest)) => match dict.get_mut(head) {
            Some(Value::Dict(_, inner)) => remove_path(inner, rest),
            _ => false,
        },
    }
}

fn count_keys(dict: &Dict) -> usize {
    dict.values()
        .map(|v| match v {
            Value::Dict(_, inner) => 1 + count_keys(inner),
            _ => 1,
        })
        .sum()
}
