//! `[capacity]`: how much of the provider's capacity the whole deployment may use (I9). The
//! limits are the provider's own, as its account shows them (requests and tokens per minute
//! per model, requests at once); every worker draws from one budget kept in PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Limits of one model (or the provider's default for every model).
#[derive(
    Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(deny_unknown_fields, default)]
pub struct CapacityLimits {
    /// Requests a minute, for the whole deployment. Enforced to the second, as hosted APIs do
    /// (3,000 a minute is 50 in any second). Unset: no configured limit.
    pub requests_per_minute: Option<u64>,
    /// Tokens a minute (the prompt, estimated from its text, plus the most the reply may
    /// have: what a provider counts against this limit when it admits a request). Unset: no
    /// configured limit.
    pub tokens_per_minute: Option<u64>,
    /// Requests in progress at once, for the whole deployment. Unset: no configured limit.
    pub max_concurrent: Option<u32>,
}

impl CapacityLimits {
    pub fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.max_concurrent.is_none()
    }
}

/// `[capacity]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CapacitySettings {
    /// Requests a minute of every model without limits of its own, for the whole deployment
    /// (each model has its own budget, as providers count them per model). Enforced to the
    /// second, as hosted APIs do (3,000 a minute is 50 in any second). Unset: no configured
    /// limit.
    pub requests_per_minute: Option<u64>,
    /// Tokens a minute of every model without limits of its own (the prompt, estimated from
    /// its text, plus the most the reply may have: what a provider counts against this limit
    /// when it admits a request). Unset: no configured limit.
    pub tokens_per_minute: Option<u64>,
    /// Requests in progress at once, per model, for the whole deployment. Unset: no configured
    /// limit.
    pub max_concurrent: Option<u32>,
    /// Per-model limits where they differ from the default: model name → limits, e.g.
    /// `[capacity.models."gpt-4o"]` with `requests_per_minute = 500`.
    pub models: BTreeMap<String, CapacityLimits>,
    /// Where no request limit is configured, follow the provider's own signals: a limit it
    /// reports (`x-ratelimit-limit-requests`) is the rate, cut by 10 % on a refusal; without
    /// one, a `429`'s `Retry-After` pauses every worker of the deployment, and a rate is learned
    /// (a refusal cuts it to 95 % of what got through in the last second, at most once a
    /// second; each second without a refusal takes it back there, then 10 % higher). Default
    /// true.
    pub adaptive: bool,
    /// Output tokens counted against `tokens_per_minute` for a task that names no
    /// `max_output_tokens`. Default 1024.
    pub default_output_tokens: u32,
    /// Characters of prompt counted as one token against `tokens_per_minute`: a prompt's
    /// tokens are estimated from its length before the call, as providers' own rule of thumb
    /// goes (about 4 for English with OpenAI's and Anthropic's tokenizers). Set it to match
    /// your provider's tokenizer on your traffic (its reported usage over the prompt's length).
    /// Default 4.
    pub chars_per_token: u32,
    /// How long a worker's share of `max_concurrent` stays held without being renewed: a
    /// worker that vanished gives its share back after this. Default 10000.
    pub slot_ttl_ms: u64,
}

impl Default for CapacitySettings {
    fn default() -> Self {
        Self {
            requests_per_minute: None,
            tokens_per_minute: None,
            max_concurrent: None,
            models: BTreeMap::new(),
            adaptive: true,
            default_output_tokens: 1024,
            chars_per_token: 4,
            slot_ttl_ms: 10_000,
        }
    }
}

impl CapacitySettings {
    /// The limits of every model without limits of its own.
    pub fn default_limits(&self) -> CapacityLimits {
        CapacityLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            max_concurrent: self.max_concurrent,
        }
    }

    /// The limits of `model`.
    pub fn limits_of(&self, model: &str) -> CapacityLimits {
        self.models
            .get(model)
            .copied()
            .unwrap_or_else(|| self.default_limits())
    }

    /// Whether a worker needs the shared budget at all: a limit somewhere, or adaptation on.
    pub fn governs(&self) -> bool {
        self.adaptive
            || !self.default_limits().is_empty()
            || self.models.values().any(|l| !l.is_empty())
    }

    pub fn slot_ttl(&self) -> Duration {
        Duration::from_millis(self.slot_ttl_ms)
    }

    /// Each contradiction, with the setting it names.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let sections = std::iter::once(("capacity".to_owned(), self.default_limits())).chain(
            self.models
                .iter()
                .map(|(model, limits)| (format!("capacity.models.{model:?}"), *limits)),
        );
        for (section, limits) in sections {
            for (key, value) in [
                ("requests_per_minute", limits.requests_per_minute),
                ("tokens_per_minute", limits.tokens_per_minute),
                ("max_concurrent", limits.max_concurrent.map(u64::from)),
            ] {
                if value == Some(0) {
                    out.push((
                        format!("{section}.{key}"),
                        "0 would admit nothing: leave it unset for no limit".to_owned(),
                    ));
                }
            }
        }
        if self.chars_per_token == 0 {
            out.push((
                "capacity.chars_per_token".to_owned(),
                "must be at least 1".to_owned(),
            ));
        }
        if self.slot_ttl_ms < 1_000 {
            out.push((
                "capacity.slot_ttl_ms".to_owned(),
                format!(
                    "{} is under 1000: a worker renews its share a few times per TTL, and a shorter one would lose it between two renewals",
                    self.slot_ttl_ms
                ),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_without_limits_of_its_own_takes_the_default() {
        let mut settings = CapacitySettings {
            requests_per_minute: Some(3_000),
            ..CapacitySettings::default()
        };
        settings.models.insert(
            "gpt-4o".into(),
            CapacityLimits {
                requests_per_minute: Some(500),
                ..CapacityLimits::default()
            },
        );
        assert_eq!(settings.limits_of("gpt-4o").requests_per_minute, Some(500));
        assert_eq!(
            settings.limits_of("gpt-4o-mini").requests_per_minute,
            Some(3_000)
        );
        assert!(settings.governs());
    }

    #[test]
    fn a_zero_limit_is_refused_naming_it() {
        let mut settings = CapacitySettings::default();
        settings.models.insert(
            "m".into(),
            CapacityLimits {
                max_concurrent: Some(0),
                ..CapacityLimits::default()
            },
        );
        let problems = settings.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].0, "capacity.models.\"m\".max_concurrent");
    }
}
