//! Settings: one typed tree, read from a TOML file and then `REPLYD_*` environment variables
//! (`REPLYD_KAFKA__TOPIC=x` sets `kafka.topic`), then checked by [`Settings::validate`], which
//! refuses contradictions with a message naming the setting. Secrets live in [`Secret`], whose
//! `Debug` and `Display` never show the value, so a settings dump cannot leak a password.

mod load;
pub mod reference;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::api::settings::ApiSettings;
use crate::api::{ApiParts, IntakeLimits};
use crate::probes::ObservabilitySettings;
use crate::provider::ProviderSettings;
use crate::reconcile::ReconcileSettings;
use crate::relay::RelayParts;
use crate::relay::settings::RelaySettings;
use crate::store::DatabaseSettings;
use crate::transport::Transports;
use crate::transport::kafka::settings::KafkaSettings;
use crate::worker::WorkerParts;
use crate::worker::settings::WorkerSettings;
use replyd_core::quota::QuotaSettings;
use replyd_core::retry::RetrySettings;
pub use replyd_core::secret::Secret;

/// Everything `replyd worker` reads.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub kafka: KafkaSettings,
    pub worker: WorkerSettings,
    pub observability: ObservabilitySettings,
    pub provider: ProviderSettings,
    pub retry: RetrySettings,
    pub api: ApiSettings,
    pub relay: RelaySettings,
    pub quota: QuotaSettings,
    pub capacity: crate::capacity::CapacitySettings,
    pub retention: crate::housekeeping::settings::RetentionSettings,
    pub sqs: crate::transport::sqs::settings::SqsSettings,
}

/// One problem with the settings: which setting, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path (`worker.lease_ms`), or `--config` for the file itself.
    pub setting: String,
    pub message: String,
}

/// Every problem found in the settings, reported together so one run shows them all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render_problems(&self.0))]
pub struct ConfigError(pub Vec<Problem>);

fn render_problems(problems: &[Problem]) -> String {
    match problems {
        [one] => format!("{}: {}", one.setting, one.message),
        many => {
            let mut text = format!("{} problems in the settings:", many.len());
            for p in many {
                text.push_str(&format!("\n  - {}: {}", p.setting, p.message));
            }
            text
        }
    }
}

fn problem(setting: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem {
        setting: setting.into(),
        message: message.into(),
    }
}

/// Settings whose keys are free-form (librdkafka property names), not fields.
const FREE_FORM: &[&str] = &[
    "kafka.librdkafka",
    "kafka.producer_librdkafka",
    "provider.extra_headers",
];

/// Environment variables that set settings: `REPLYD_<SECTION>__<KEY>`.
pub const ENV_PREFIX: &str = "REPLYD_";

type Dict = figment::value::Dict;
type Value = figment::value::Value;

impl Settings {
    /// The worker's sections.
    pub fn worker_parts(&self) -> WorkerParts {
        WorkerParts {
            database: self.database.clone(),
            worker: self.worker.clone(),
            provider: self.provider.clone(),
            capacity: self.capacity.clone(),
            retry: self.retry.clone(),
            kafka: self.kafka.clone(),
            sqs: self.sqs.clone(),
        }
    }

    /// The relay's sections, and its reconciler's.
    pub fn relay_parts(&self) -> RelayParts {
        RelayParts {
            database: self.database.clone(),
            relay: self.relay.clone(),
            retention: self.retention.clone(),
            reconcile: self.reconcile_settings(),
            kafka: self.kafka.clone(),
            sqs: self.sqs.clone(),
        }
    }

    /// The API's sections, and the bounds of new work the worker's, Kafka's and the
    /// provider's sections set.
    pub fn api_parts(&self) -> ApiParts {
        ApiParts {
            database: self.database.clone(),
            api: self.api.clone(),
            quota: self.quota.clone(),
            limits: IntakeLimits::of(&self.worker, &self.kafka, &self.provider),
        }
    }

    /// What the quota's reconciler decides by and asks.
    pub fn reconcile_settings(&self) -> ReconcileSettings {
        ReconcileSettings {
            provider: self.provider.clone(),
            policy: self.quota.policy(),
            lease: self.worker.lease(),
            redelivery: self.redelivery_bound(),
        }
    }

    /// Every transport's settings, for the choice between them.
    pub fn transports(&self) -> Transports<'_> {
        Transports {
            kafka: &self.kafka,
            sqs: &self.sqs,
        }
    }

    /// How long a record may wait to be handed to another worker after its worker vanished
    /// mid-task: the group notices (its session timeout; on SQS, the message's visibility runs
    /// out), the task's lease runs out, and a revoked partition drains. The quota's reconciler does not take a task worked within this
    /// bound for abandoned work.
    pub fn redelivery_bound(&self) -> Duration {
        let noticed = self.transports().noticed_after(self.worker.source);
        noticed
            .saturating_add(self.worker.lease())
            .saturating_add(self.worker.drain_timeout())
    }

    /// Refuses settings that contradict each other or cannot work, naming every problem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = self.problems();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError(problems))
        }
    }

    fn problems(&self) -> Vec<Problem> {
        let w = &self.worker;
        let mut out = Vec::new();
        let mut refuse = |setting: &str, message: String| out.push(problem(setting, message));
        for (setting, message) in self.capacity.problems() {
            refuse(&setting, message);
        }
        // Each section's own rules, then the rules that tie sections together.
        for (setting, message) in self
            .transports()
            .problems(w.source, self.relay.sink, w.lease(), w.drain_timeout())
            .into_iter()
            .chain(w.problems())
            .chain(self.database.problems())
            .chain(self.relay.problems())
            .chain(self.api.problems())
            .chain(self.retention.problems(self.api.idempotency_retention_ms))
        {
            refuse(setting, message);
        }
        // The rules that tie sections together, each with the section whose setting it
        // refuses, given what it is held against.
        let retry_horizon = w.retry_horizon(w.max_attempts_limit, &self.retry);
        let api_task = w.retry_horizon(w.default_max_attempts, &self.retry);
        // A loop's single step may wait this long; the liveness check must not take that
        // wait for a stuck loop.
        let longest_wait = [
            ("worker.drain_timeout_ms", w.drain_timeout_ms),
            (
                "database.statement_timeout_ms",
                self.database.statement_timeout_ms,
            ),
            ("relay.publish_timeout_ms", self.relay.publish_timeout_ms),
            (
                "provider.request_timeout_ms",
                self.provider.request_timeout_ms,
            ),
        ]
        .into_iter()
        .max_by_key(|(_, ms)| *ms)
        .expect("four waits");
        for (setting, message) in self
            .retry
            .problems()
            .into_iter()
            .chain(self.api.retention_problems(retry_horizon))
            .chain(self.quota.ttl_problems(
                api_task,
                self.redelivery_bound(),
                &self.transports().noticed_from(w.source),
            ))
            .chain(self.observability.liveness_problems(longest_wait))
            .chain(
                self.relay
                    .publish_problems(self.database.idle_in_transaction_session_timeout_ms),
            )
            .chain(w.prompt_problems(self.kafka.max_record_bytes))
        {
            refuse(setting, message);
        }
        // The provider's own checks (base URL, extra headers, Anthropic's settings), the same
        // ones its adapters refuse with; none of them quotes a header's value.
        for (setting, message) in self.provider.problems() {
            refuse(setting, message);
        }
        // Neither message quotes the URL, so no password leaks through them.
        match crate::store::parse_url(&self.database) {
            Err(crate::store::StoreError::Config(e)) => refuse("database.url", e),
            Err(e) => refuse("database.url", e.to_string()),
            Ok((_, tls)) => {
                if let Err(e) = crate::store::tls::connector(&tls) {
                    refuse("database.url", e);
                }
            }
        }
        out
    }

    /// The effective settings as TOML, secrets shown as `***`.
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render settings: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use figment::Figment;
    use figment::providers::{Format, Toml};

    use super::*;
    use crate::transport::Transport;
    use crate::transport::kafka::settings::GroupProtocol;
    use crate::worker::settings::MIN_READ_AHEAD;

    /// What validating `s` refuses, as the error says it.
    fn refusal(s: &Settings) -> String {
        s.validate().unwrap_err().to_string()
    }

    /// Asserts that `err` is the one problem of `setting`, mentioning each of `mentioned`.
    fn assert_names(err: &str, setting: &str, mentioned: &[&str]) {
        assert!(
            err.starts_with(&format!("{setting}:")),
            "{setting} in {err}"
        );
        for m in mentioned {
            assert!(err.contains(m), "{m} in {err}");
        }
    }

    /// The settings in the jail's file `name`.
    fn load(name: &str) -> Result<Settings, ConfigError> {
        Settings::load(Some(Path::new(name)))
    }

    #[test]
    fn defaults_are_valid() {
        Settings::default().validate().unwrap();
    }

    #[test]
    fn a_liveness_timeout_within_a_loop_s_longest_wait_is_refused_naming_the_wait() {
        let mut s = Settings::default();
        s.provider.request_timeout_ms = 200_000;
        assert_names(
            &refusal(&s),
            "observability.liveness_timeout_ms",
            &["provider.request_timeout_ms (200000)"],
        );
        s.observability.liveness_timeout_ms = 205_001;
        s.validate().unwrap();
    }

    /// A change that contradicts the rest of the settings, the setting refused for it, and what
    /// the refusal mentions.
    type Contradiction = (fn(&mut Settings), &'static str, &'static [&'static str]);

    #[test]
    fn contradictions_name_the_setting() {
        let cases: [Contradiction; 5] = [
            (
                |s| s.worker.drain_timeout_ms = s.kafka.session_timeout_ms(),
                "worker.drain_timeout_ms",
                &[],
            ),
            (
                |s| s.worker.renew_interval_ms = s.worker.lease_ms,
                "worker.renew_interval_ms",
                &[],
            ),
            (
                |s| {
                    s.kafka
                        .librdkafka
                        .insert("enable.auto.commit".into(), "true".into());
                },
                "kafka.librdkafka",
                &["enable.auto.commit"],
            ),
            (
                |s| {
                    s.kafka.group_protocol = GroupProtocol::Consumer;
                    s.kafka
                        .librdkafka
                        .insert("heartbeat.interval.ms".into(), "500".into());
                },
                "kafka.librdkafka",
                &["heartbeat.interval.ms"],
            ),
            (
                |s| s.kafka.dead_letter_topic = s.kafka.topic.clone(),
                "kafka.dead_letter_topic",
                &[],
            ),
        ];
        for (contradict, setting, mentioned) in cases {
            let mut s = Settings::default();
            contradict(&mut s);
            assert_names(&refusal(&s), setting, mentioned);
        }
    }

    /// The reservation's TTL is held against the redelivery of the source in use: on SQS the
    /// message's visibility, named as such, not the group's session.
    #[test]
    fn a_reservation_ttl_below_the_redelivery_names_what_the_source_waits_for() {
        let mut s = Settings::default();
        s.quota.reservation_ttl_ms = 1_000;
        assert_names(
            &refusal(&s),
            "quota.reservation_ttl_ms",
            &["kafka.session_timeout_ms"],
        );
        s.worker.source = Transport::Sqs;
        s.sqs.queue_url = "http://127.0.0.1:9324/000000000000/tasks".into();
        s.sqs.region = "us-east-1".into();
        let sqs = refusal(&s);
        assert_names(
            &sqs,
            "quota.reservation_ttl_ms",
            &["sqs.visibility_timeout_seconds, 60 s"],
        );
        assert!(!sqs.contains("session"), "{sqs}");
    }

    #[test]
    fn a_prompt_limit_whose_largest_record_cannot_fit_kafka_max_record_bytes_is_refused() {
        let mut s = Settings::default();
        s.worker.max_prompt_bytes = s.kafka.max_record_bytes;
        let err = s.validate().unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        let text = err.to_string();
        assert_names(
            &text,
            "worker.max_prompt_bytes",
            &["kafka.max_record_bytes"],
        );
        // The limit it suggests fits.
        let fits: usize = text
            .split("at most ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .expect("a suggested limit");
        s.worker.max_prompt_bytes = fits;
        s.validate().unwrap();
        // And so does raising the record size instead.
        let mut s = Settings::default();
        s.worker.max_prompt_bytes = 1_000_000;
        s.kafka.max_record_bytes = 1_100_000;
        s.validate().unwrap();

        let mut s = Settings::default();
        s.kafka
            .producer_librdkafka
            .insert("message.max.bytes".into(), "2000000".into());
        assert_names(
            &refusal(&s),
            "kafka.producer_librdkafka",
            &["kafka.max_record_bytes"],
        );
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's test jail returns its own error type
    fn file_then_environment_with_unknown_keys_refused() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "replyd.toml",
                r#"
                [kafka]
                topic = "from-file"
                [kafka.librdkafka]
                "fetch.wait.max.ms" = "50"
                [worker]
                partition_window = 8
                "#,
            )?;
            jail.set_env("REPLYD_KAFKA__TOPIC", "from-env");
            jail.set_env("REPLYD_LOG_JSON", "true");
            let s = load("replyd.toml").unwrap();
            assert_eq!(s.kafka.topic, "from-env");
            assert_eq!(s.worker.partition_window, 8);
            assert_eq!(s.kafka.librdkafka["fetch.wait.max.ms"], "50");

            jail.create_file("bad.toml", "[worker]\nparition_window = 8\n")?;
            let err = load("bad.toml").unwrap_err().to_string();
            assert_eq!(
                err,
                "worker.parition_window: unknown setting (in bad.toml); did you mean `worker.partition_window`?"
            );

            jail.set_env("REPLYD_WORKER__LEASE_MSS", "100");
            let err = load("replyd.toml").unwrap_err().to_string();
            assert!(
                err.contains("worker.lease_mss: unknown setting (from REPLYD_WORKER__LEASE_MSS); did you mean `worker.lease_ms`?"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn every_problem_is_reported_at_once_with_a_suggestion() {
        let err = Settings::from_toml(
            r#"
            [wroker]
            lease_ms = 1
            [worker]
            session_timeout_ms = 1000
            partition_window = "many"
            global_window = "all"
            renew_interval_ms = 900000
            [kafka]
            group_protocol = "consumer"
            session_timeout_ms = 10000
            [kafka.librdkafka]
            "fetch.wait.max.mss" = "50"
            [kafka.producer_librdkafka]
            "linger.ms" = "soon"
            "#,
        )
        .unwrap_err();
        let settings: Vec<&str> = err.0.iter().map(|p| p.setting.as_str()).collect();
        for expected in [
            "wroker",
            "worker.session_timeout_ms",
            "worker.partition_window",
            "worker.global_window",
            "worker.renew_interval_ms",
            "kafka.session_timeout_ms",
            "kafka.librdkafka",
            "kafka.producer_librdkafka",
        ] {
            assert!(settings.contains(&expected), "{expected} not in {err}");
        }
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("{} problems in the settings:", err.0.len())),
            "{text}"
        );
        assert!(text.contains("did you mean `worker`?"), "{text}");
        assert!(
            text.contains("did you mean `kafka.session_timeout_ms`?"),
            "{text}"
        );
        assert!(text.contains("fetch.wait.max.mss"), "{text}");
        assert!(
            !text.contains("default."),
            "no figment profile in the paths: {text}"
        );
    }

    #[test]
    fn the_session_timeout_is_refused_only_with_the_consumer_protocol() {
        let classic = Settings::from_toml(
            "[kafka]
session_timeout_ms = 20000
",
        )
        .unwrap();
        assert_eq!(classic.kafka.session_timeout_ms(), 20_000);
        let err = Settings::from_toml(
            "[kafka]
group_protocol = \"consumer\"
session_timeout_ms = 10000
",
        )
        .unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        assert_eq!(err.0[0].setting, "kafka.session_timeout_ms");
    }

    #[test]
    fn the_redacted_view_shows_every_setting_but_no_secret() {
        let mut s = Settings::default();
        s.database.url = Secret::new("postgres://u:hunter2@db/replyd");
        s.provider.api_key = Some(Secret::new("sk-live-123"));
        s.provider
            .extra_headers
            .insert("api-key".into(), Secret::new("azure-key-456"));
        let shown = s.to_redacted_toml();
        for secret in ["hunter2", "sk-live-123", "azure-key-456"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("partition_window = 64"), "{shown}");
        assert!(shown.contains("url = \"***\""), "{shown}");
        assert!(shown.contains("api-key = \"***\""), "{shown}");
    }

    #[test]
    fn a_provider_base_url_is_taken_as_the_sdks_take_it_and_a_bad_one_is_refused() {
        for base_url in [
            "https://api.openai.com/v1",
            "https://api.openai.com",
            "https://generativelanguage.googleapis.com/v1beta/openai",
            "https://r.openai.azure.com/openai/deployments/d?api-version=2024-10-21",
        ] {
            Settings::from_toml(&format!("[provider]\nbase_url = \"{base_url}\"\n"))
                .unwrap_or_else(|e| panic!("{base_url}: {e}"));
        }
        let err = Settings::from_toml("[provider]\nbase_url = \"ftp://llm.example.com\"\n")
            .unwrap_err()
            .to_string();
        assert_names(&err, "provider.base_url", &["not http or https"]);
        let err = Settings::from_toml(
            "[provider]\nbase_url = \"https://r.openai.azure.com/openai/deployments/d\"\n",
        )
        .unwrap_err()
        .to_string();
        assert_names(&err, "provider.base_url", &["api-version"]);
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's test jail returns its own error type
    fn extra_headers_come_from_the_file_or_the_environment_and_reserved_ones_are_refused() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "replyd.toml",
                r#"
                [provider]
                base_url = "https://r.openai.azure.com/openai"
                [provider.extra_headers]
                "OpenAI-Project" = "proj_1"
                "#,
            )?;
            jail.set_env("REPLYD_PROVIDER__EXTRA_HEADERS__API-KEY", "azure-789");
            let s = load("replyd.toml").unwrap();
            assert_eq!(s.provider.extra_headers.len(), 2, "{s:?}");
            assert_eq!(
                s.provider.extra_headers["api-key"].expose(),
                "azure-789",
                "names from the environment are lower case"
            );
            assert_eq!(
                s.provider.extra_headers["OpenAI-Project"].expose(),
                "proj_1"
            );

            jail.create_file(
                "bad.toml",
                r#"
                [provider.extra_headers]
                Authorization = "Bearer sk-hunter2"
                "x-api-key" = "hunter2"
                "two words" = "v"
                "#,
            )?;
            let err = load("bad.toml").unwrap_err();
            let settings: Vec<&str> = err.0.iter().map(|p| p.setting.as_str()).collect();
            assert_eq!(settings, ["provider.extra_headers"; 3], "{err}");
            let text = err.to_string();
            for named in ["\"Authorization\"", "\"x-api-key\"", "\"two words\""] {
                assert!(text.contains(named), "{named} in {text}");
            }
            assert!(!text.contains("hunter2"), "{text}");
            Ok(())
        });
    }

    #[test]
    fn the_example_file_is_valid_and_shows_the_defaults() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/replyd.example.toml");
        let from_file: Settings = Figment::new()
            .merge(Toml::file(path))
            .extract()
            .expect("the example parses");
        assert_eq!(from_file, Settings::default());
    }

    #[test]
    fn the_read_ahead_is_two_partition_windows_and_at_least_the_minimum_unless_set() {
        let mut worker = WorkerSettings::default();
        assert_eq!(worker.read_ahead(), MIN_READ_AHEAD);
        worker.partition_window = 1024;
        assert_eq!(worker.read_ahead(), 2048);
        worker.partition_window = 8;
        assert_eq!(worker.read_ahead(), MIN_READ_AHEAD);
        worker.read_ahead = Some(2);
        assert_eq!(worker.read_ahead(), 2);
    }

    #[test]
    fn secrets_never_print_their_value() {
        let settings = DatabaseSettings {
            url: Secret::new("postgres://u:hunter2@db/replyd"),
            ..DatabaseSettings::default()
        };
        let shown = format!("{settings:?} {}", settings.url);
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
