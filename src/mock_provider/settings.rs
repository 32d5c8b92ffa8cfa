//! Settings of the mock provider: latency, fault rates, idempotency, the background-responses
//! capability, seed; and the command-line flags that carry them.
//!
//! What the provider *is* (honours keys, has background responses) is fixed at start in
//! [`MockSettings`]; what goes wrong with it ([`FaultSettings`]) can change at run time.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Faults injected into chat-completion requests and into background-response creates and polls
/// alike. Replaceable at run time with `PUT /faults`. On a create, `drop_after_work_rate` creates
/// the response and starts its generation, then breaks the answer, so the client never sees the
/// id; on a poll, it loses that poll's answer.
/// Each rate is the share of requests, in `[0, 1]`, that get the fault; together they may not
/// exceed 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultSettings {
    /// Share of requests answered `error_status` at once, without doing the work.
    pub error_rate: f64,
    /// Status of the injected errors. Default 500.
    pub error_status: u16,
    /// Share of requests answered 429 with `Retry-After: retry_after_s`, without doing the work.
    pub rate_limit_rate: f64,
    /// `Retry-After` of the injected 429s, in seconds. Default 1.
    pub retry_after_s: u64,
    /// Share of requests that wait `hang_ms` before anything else, so the client times out.
    pub hang_rate: f64,
    /// How long a hanging request waits. Default 600000 (ten minutes).
    pub hang_ms: u64,
    /// Share of requests whose work is done, counted and stored under the key, and whose
    /// response is then broken mid-body.
    pub drop_after_work_rate: f64,
}

impl Default for FaultSettings {
    fn default() -> Self {
        Self {
            error_rate: 0.0,
            error_status: 500,
            rate_limit_rate: 0.0,
            retry_after_s: 1,
            hang_rate: 0.0,
            hang_ms: 600_000,
            drop_after_work_rate: 0.0,
        }
    }
}

/// Why fault settings were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidSettings {
    #[error("{name} = {value} is not a rate in [0, 1]")]
    RateOutOfRange { name: &'static str, value: f64 },
    #[error("fault rates add up to {sum}, over 1")]
    RatesOverOne { sum: f64 },
    #[error("error_status {0} is not a 4xx or 5xx status")]
    NotAnErrorStatus(u16),
}

impl FaultSettings {
    /// Refuses rates outside `[0, 1]`, rates that add up to more than 1, and an error status
    /// that is not an error.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        let rates = [
            ("error_rate", self.error_rate),
            ("rate_limit_rate", self.rate_limit_rate),
            ("hang_rate", self.hang_rate),
            ("drop_after_work_rate", self.drop_after_work_rate),
        ];
        for (name, value) in rates {
            if !(0.0..=1.0).contains(&value) {
                return Err(InvalidSettings::RateOutOfRange { name, value });
            }
        }
        let sum: f64 = rates.iter().map(|(_, rate)| rate).sum();
        // A little slack: 0.1 + 0.2 + 0.7 is not exactly 1 in floating point.
        if sum > 1.0 + 1e-9 {
            return Err(InvalidSettings::RatesOverOne { sum });
        }
        if !(400..=599).contains(&self.error_status) {
            return Err(InvalidSettings::NotAnErrorStatus(self.error_status));
        }
        Ok(())
    }
}

/// Everything the mock provider does, fixed at start except `faults`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockSettings {
    /// Mean time a generation takes, in milliseconds.
    pub latency_ms: u64,
    /// Uniform spread around `latency_ms`: each generation takes `latency_ms ± latency_jitter_ms`
    /// (never less than zero).
    pub latency_jitter_ms: u64,
    /// Injected faults; `PUT /faults` replaces them while the mock runs.
    pub faults: FaultSettings,
    /// Whether a repeated `Idempotency-Key` gets the first request's reply instead of a new
    /// generation. Default true; false imitates a provider that ignores the header. Applies to
    /// background-response creates too: a repeated key gets the first response's id.
    pub honour_idempotency_key: bool,
    /// Whether `POST /v1/responses` and `GET /v1/responses/{id}` exist. Default true; false
    /// answers them 404, like a provider without background responses.
    pub background_responses: bool,
    /// Seed of the fault and latency draws, so a run can be replayed.
    pub seed: u64,
}

impl Default for MockSettings {
    fn default() -> Self {
        Self {
            latency_ms: 0,
            latency_jitter_ms: 0,
            faults: FaultSettings::default(),
            honour_idempotency_key: true,
            background_responses: true,
            seed: 0,
        }
    }
}

/// Flags of the `mock-provider` subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct MockProviderArgs {
    /// Address to listen on; port 0 picks a free port (the bound one is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Mean time a generation takes, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Uniform spread around --latency-ms, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_jitter_ms: u64,
    /// Share of requests answered --error-status at once.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub error_rate: f64,
    /// Status of the injected errors.
    #[arg(long, default_value_t = 500)]
    pub error_status: u16,
    /// Share of requests answered 429.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub rate_limit_rate: f64,
    /// `Retry-After` of the injected 429s, in seconds.
    #[arg(long, default_value_t = 1)]
    pub retry_after_s: u64,
    /// Share of requests that hang for --hang-ms before anything else.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub hang_rate: f64,
    /// How long a hanging request waits, in milliseconds.
    #[arg(long, default_value_t = 600_000)]
    pub hang_ms: u64,
    /// Share of requests whose work is done and whose response is then broken mid-body.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub drop_after_work_rate: f64,
    /// Whether a repeated Idempotency-Key returns the first reply instead of generating anew.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub honour_idempotency_key: bool,
    /// Whether the background-responses endpoints exist (false: they answer 404).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub background_responses: bool,
    /// Seed of the fault and latency draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl From<MockProviderArgs> for MockSettings {
    fn from(args: MockProviderArgs) -> Self {
        MockSettings {
            latency_ms: args.latency_ms,
            latency_jitter_ms: args.latency_jitter_ms,
            faults: FaultSettings {
                error_rate: args.error_rate,
                error_status: args.error_status,
                rate_limit_rate: args.rate_limit_rate,
                retry_after_s: args.retry_after_s,
                hang_rate: args.hang_rate,
                hang_ms: args.hang_ms,
                drop_after_work_rate: args.drop_after_work_rate,
            },
            honour_idempotency_key: args.honour_idempotency_key,
            background_responses: args.background_responses,
            seed: args.seed,
        }
    }
}

fn parse_rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .parse()
        .map_err(|e| format!("`{text}` is not a number: {e}"))?;
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!("{rate} is not a rate in [0, 1]"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: MockProviderArgs,
    }

    #[test]
    fn flags_default_to_the_settings_defaults() {
        let cli = Cli::try_parse_from(["mock"]).unwrap();
        assert_eq!(cli.args.listen.to_string(), "127.0.0.1:0");
        assert_eq!(MockSettings::from(cli.args), MockSettings::default());
    }

    #[test]
    fn flags_become_settings() {
        let cli = Cli::try_parse_from([
            "mock",
            "--latency-ms=20",
            "--error-rate=0.25",
            "--error-status=502",
            "--honour-idempotency-key=false",
            "--background-responses=false",
            "--seed=9",
        ])
        .unwrap();
        let settings = MockSettings::from(cli.args);
        assert_eq!(settings.latency_ms, 20);
        assert_eq!(settings.faults.error_rate, 0.25);
        assert_eq!(settings.faults.error_status, 502);
        assert!(!settings.honour_idempotency_key);
        assert!(!settings.background_responses);
        assert_eq!(settings.seed, 9);
        assert!(Cli::try_parse_from(["mock", "--hang-rate=1.5"]).is_err());
    }

    #[test]
    fn contradictory_faults_are_refused_with_the_reason() {
        let over = FaultSettings {
            error_rate: 0.6,
            hang_rate: 0.6,
            ..FaultSettings::default()
        };
        assert_eq!(
            over.validate(),
            Err(InvalidSettings::RatesOverOne { sum: 1.2 })
        );
        let negative = FaultSettings {
            hang_rate: -0.1,
            ..FaultSettings::default()
        };
        assert!(matches!(
            negative.validate(),
            Err(InvalidSettings::RateOutOfRange {
                name: "hang_rate",
                ..
            })
        ));
        let not_error = FaultSettings {
            error_status: 200,
            ..FaultSettings::default()
        };
        assert_eq!(
            not_error.validate(),
            Err(InvalidSettings::NotAnErrorStatus(200))
        );
        let exactly_one = FaultSettings {
            error_rate: 0.1,
            rate_limit_rate: 0.2,
            drop_after_work_rate: 0.7,
            ..FaultSettings::default()
        };
        assert_eq!(exactly_one.validate(), Ok(()));
    }
}
